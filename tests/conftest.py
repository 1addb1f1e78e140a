import os

# Debug mode: every engine the tests build checks its block pool's invariants after every step.
os.environ.setdefault("JPAGED_CHECK_INVARIANTS", "1")

# Eight CPU devices (set before jax is imported), so tensor-parallel tests can build meshes of
# 2, 4 and 8 on any machine; single-device code keeps using the first one.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


import random  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

_default_rng = np.random.default_rng


@pytest.fixture(autouse=True)
def test_seed(monkeypatch):
    """Every test's random draws replay from one seed, printed (pytest shows it with a failure's
    captured output) and taken from $JPAGED_TEST_SEED when set: np.random.default_rng() without
    a seed, numpy's global generator and Python's `random`. Draws in module-scoped fixtures happen
    before this and are seeded where they are made."""
    seed = int(os.environ.get("JPAGED_TEST_SEED") or random.SystemRandom().randrange(2**31))
    print(f"JPAGED_TEST_SEED={seed}")
    sequence = np.random.SeedSequence(seed)
    monkeypatch.setattr(np.random, "default_rng",
                        lambda seed=None: _default_rng(sequence.spawn(1)[0] if seed is None else seed))
    np.random.seed(seed)
    random.seed(seed)
    return seed
