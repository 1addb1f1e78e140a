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
try:  # CI's GPU readiness job runs the kernel tests without the test extra's hypothesis
    from hypothesis import settings  # noqa: E402
except ImportError:
    settings = None

# Every run draws the same inputs (CI included): a fixed seed unless JPAGED_TEST_SEED names another,
# and hypothesis derandomized (HYPOTHESIS_PROFILE=random explores new examples on demand).
DEFAULT_SEED = 20261125
if settings is not None:
    settings.register_profile("derandomized", derandomize=True, deadline=None, print_blob=True)
    settings.register_profile("random", deadline=None, print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "derandomized"))

_default_rng = np.random.default_rng
_Random = random.Random


@pytest.fixture(autouse=True)
def test_seed(monkeypatch):
    """Every test's random draws replay from one seed, printed (pytest shows it with a failure's
    captured output): DEFAULT_SEED, or $JPAGED_TEST_SEED when set. It seeds np.random.default_rng()
    and random.Random() made without a seed, numpy's global generator and Python's `random`.
    Draws in module-scoped fixtures happen before this and are seeded where they are made."""
    seed = int(os.environ.get("JPAGED_TEST_SEED") or DEFAULT_SEED)
    print(f"JPAGED_TEST_SEED={seed}")
    sequence = np.random.SeedSequence(seed)

    def spawned() -> int:
        return int(sequence.spawn(1)[0].generate_state(1)[0])

    class SeededRandom(_Random):
        def __init__(self, x=None):
            super().__init__(spawned() if x is None else x)

    monkeypatch.setattr(np.random, "default_rng",
                        lambda seed=None: _default_rng(sequence.spawn(1)[0] if seed is None else seed))
    monkeypatch.setattr(random, "Random", SeededRandom)
    np.random.seed(seed)
    random.seed(seed)
    return seed
