"""Executables kept on disk whole (jpaged/runner/executable_cache.py): loaded only under the same
key, equal in results to a fresh compile, donation kept, a damaged file compiled again."""

import functools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jpaged
from jpaged.runner import executable_cache
from jpaged.runner.executable_cache import ExecutableCache


def step(scale, pool, x):
    """A stand-in for a step: reads its input, updates the donated pool in place."""
    return (x * scale).sum(), pool.at[0].add(x[0] * scale)


def jitted(scale):
    return jax.jit(functools.partial(step, scale), donate_argnums=(0,))


def args(rng, n=8):
    return (jnp.asarray(rng.normal(size=(4, n)), jnp.float32), jnp.asarray(rng.normal(size=(3, n)), jnp.float32))


def test_same_key_loads_and_any_change_compiles(tmp_path):
    rng = np.random.default_rng()
    pool, x = args(rng)
    fn = jitted(2.0)
    first = ExecutableCache(str(tmp_path), "model-a")
    compiled = first.compile("step", fn, (pool, x))
    assert first.hits == 0 and len(os.listdir(tmp_path)) == 1
    again = ExecutableCache(str(tmp_path), "model-a")
    loaded = again.compile("step", fn, (pool, x))
    assert again.hits == 1
    expected_sum, expected_pool = np.asarray((x * 2).sum()), np.asarray(pool.at[0].add(x[0] * 2))
    total, new_pool = loaded(pool, x)
    assert pool.is_deleted()  # still donated
    np.testing.assert_allclose(total, expected_sum, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new_pool, expected_pool, rtol=1e-5, atol=1e-5)
    # Another model, name or argument shape: another key, compiled and kept beside the first.
    pool, x = args(rng)
    for cache, name, arguments in ((ExecutableCache(str(tmp_path), "model-b"), "step", (pool, x)),
                                   (ExecutableCache(str(tmp_path), "model-a"), "other", (pool, x)),
                                   (ExecutableCache(str(tmp_path), "model-a"), "step", args(rng, 16))):
        cache.compile(name, fn, arguments)
        assert cache.hits == 0
    assert len(os.listdir(tmp_path)) == 4
    del compiled


@pytest.mark.slow
def test_damaged_file_is_compiled_again(tmp_path, caplog):
    rng = np.random.default_rng()
    fn = jitted(3.0)
    pool, x = args(rng)
    ExecutableCache(str(tmp_path), "m").compile("step", fn, (pool, x))
    path, = tmp_path.iterdir()
    path.write_bytes(path.read_bytes()[:100])
    cache = ExecutableCache(str(tmp_path), "m")
    pool, x = args(rng)
    expected = np.asarray((x * 3).sum())
    total, _ = cache.compile("step", fn, (pool, x))(pool, x)
    assert cache.hits == 0 and "compiling it" in caplog.text
    np.testing.assert_allclose(total, expected, rtol=1e-5, atol=1e-5)
    assert ExecutableCache(str(tmp_path), "m").compile("step", fn, args(rng)) is not None  # rewritten whole


def test_engine_restart_loads_every_executable(warm, tmp_path, monkeypatch):
    """A second engine with the same model and limits loads its whole warm-up from disk and
    generates what the first (warm's engine, which compiled every executable) did."""
    directory, first = warm
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 256, size=rng.integers(2, 30)).tolist() for _ in range(5)]
    params = jpaged.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    expected = [o.outputs[0].token_ids for o in first.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("JPAGED_CACHE_DIR", str(_copy(directory, tmp_path)))
    second = jpaged.LLM(**LIMITS)
    runner = second.llm_engine.runner
    assert runner.executable_cache.hits == runner.num_compilations > 0
    assert [o.outputs[0].token_ids for o in second.generate(prompts, params, use_tqdm=False)] == expected


def test_least_recently_used_are_pruned(tmp_path, monkeypatch):

    rng = np.random.default_rng()
    files = {}  # model -> its file
    for i in range(3):
        before = set(tmp_path.iterdir())
        ExecutableCache(str(tmp_path), f"model-{i}").compile("step", jitted(1.0), args(rng))
        files[i], = set(tmp_path.iterdir()) - before
        os.utime(files[i], (1000 + i, 1000 + i))  # model-0 written first
    hit = ExecutableCache(str(tmp_path), "model-0")
    hit.compile("step", jitted(1.0), args(rng))  # used again: now the most recent
    assert hit.hits == 1
    monkeypatch.setattr(executable_cache, "MAX_CACHE_BYTES", sum(f.stat().st_size for f in files.values()))
    ExecutableCache(str(tmp_path), "model-3").compile("step", jitted(1.0), args(rng))  # over the limit by one
    remaining = set(tmp_path.iterdir())
    assert len(remaining) == 3 and files[1] not in remaining and files[0] in remaining


# ------------------------------------------------------------------ damaged, foreign and odd files
def _kept(tmp_path, name="m", scale=3.0, n=8):
    """A cache directory holding one executable; (its file, the jitted function, its arguments)."""
    fn, arguments = jitted(scale), args(np.random.default_rng(0), n)
    ExecutableCache(str(tmp_path), name).compile("step", fn, arguments)
    path, = (p for p in tmp_path.iterdir() if p.name.endswith(".bin"))
    return path, fn, arguments


@pytest.mark.slow
def test_one_flipped_bit_anywhere_is_a_miss(tmp_path, caplog):
    """A bit flipped anywhere in the file (magic, lengths, key, checksum, payload) is found before
    pickle or XLA see the file: a miss, then compiled again and rewritten whole."""
    seed = np.random.randint(2**31)
    print("seed", seed)
    rng = np.random.default_rng(seed)
    path, fn, arguments = _kept(tmp_path)
    clean = path.read_bytes()
    header = len(executable_cache.MAGIC) + executable_cache._LENGTHS.size
    # Every region gets flips: header, key, checksum and (most of the bytes) the payload.
    offsets = list(rng.integers(0, header, 4)) + list(rng.integers(header, len(clean), 28))
    for offset in offsets:
        damaged = bytearray(clean)
        damaged[offset] ^= 1 << int(rng.integers(8))
        path.write_bytes(bytes(damaged))
        cache = ExecutableCache(str(tmp_path), "m")
        assert cache.load("step", arguments) is None, offset
        assert cache.rejected == 1, offset
    assert "rejected" in caplog.text
    cache = ExecutableCache(str(tmp_path), "m")
    pool, x = args(rng)
    expected = np.asarray((x * 3).sum())
    total, _ = cache.compile("step", fn, (pool, x))(pool, x)
    np.testing.assert_allclose(total, expected, rtol=1e-5, atol=1e-5)
    assert path.read_bytes() != damaged and ExecutableCache(str(tmp_path), "m").load("step", arguments) is not None


@pytest.mark.slow
def test_truncated_swapped_and_odd_files_are_misses(tmp_path):
    seed = np.random.randint(2**31)
    print("seed", seed)
    rng = np.random.default_rng(seed)
    fn = jitted(2.0)
    small, large = args(rng, 8), args(rng, 16)
    ExecutableCache(str(tmp_path), "m").compile("step", fn, small)
    ExecutableCache(str(tmp_path), "m").compile("step", fn, large)
    cache = ExecutableCache(str(tmp_path), "m")
    path_small, path_large = (tmp_path / os.path.basename(cache._path(cache._key("step", a))) for a in (small, large))
    clean_small, clean_large = path_small.read_bytes(), path_large.read_bytes()
    for length in [0, 1, 20, *rng.integers(21, len(clean_small) - 1, 6)]:  # truncated
        path_small.write_bytes(clean_small[:length])
        assert ExecutableCache(str(tmp_path), "m").load("step", small) is None, length
    path_small.write_bytes(clean_small + b"\0")  # one byte too many
    assert ExecutableCache(str(tmp_path), "m").load("step", small) is None
    # Swapped under each other's names: each is whole and valid, but holds another key.
    path_small.write_bytes(clean_large)
    path_large.write_bytes(clean_small)
    cache = ExecutableCache(str(tmp_path), "m")
    assert cache.load("step", small) is None and cache.load("step", large) is None and cache.rejected == 2
    # Not regular files: a FIFO (opening it for reading would block forever), a directory, a symlink.
    path_small.unlink()
    os.mkfifo(path_small)
    path_large.unlink()
    path_large.mkdir()
    cache = ExecutableCache(str(tmp_path), "m")
    assert cache.load("step", small) is None and cache.load("step", large) is None
    path_small.unlink()
    (tmp_path / "elsewhere").write_bytes(clean_small)
    path_small.symlink_to(tmp_path / "elsewhere")
    assert ExecutableCache(str(tmp_path), "m").load("step", small) is None
    # The compile that follows serves and prunes without tripping on the odd entries.
    pool, x = args(rng, 16)
    path_large.rmdir()
    os.mkfifo(path_large)
    total, _ = ExecutableCache(str(tmp_path), "m").compile("step", fn, (pool, x))(pool, x)
    np.testing.assert_allclose(total, np.asarray((x * 2).sum()), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_start_that_died_while_loading_loads_nothing_next_time(tmp_path, caplog):
    """A process killed inside XLA while loading (SIGABRT) leaves its marker: the next start on
    the host loads nothing, says so and removes it; the start after that loads again. A marker of
    a process that is alive and loading is left alone."""
    import subprocess
    import sys
    import textwrap

    _, fn, arguments = _kept(tmp_path)
    dies = textwrap.dedent(f"""
        import os
        from jpaged.runner.executable_cache import ExecutableCache
        with ExecutableCache({str(tmp_path)!r}, "m").loading():
            os.abort()
    """)
    assert subprocess.run([sys.executable, "-c", dies]).returncode != 0
    assert any(p.name.startswith(".loading.") for p in tmp_path.iterdir())
    cache = ExecutableCache(str(tmp_path), "m")
    assert cache.skip_loads and "died while loading" in caplog.text
    assert cache.load("step", arguments) is None
    assert not any(p.name.startswith(".loading.") for p in tmp_path.iterdir())
    assert ExecutableCache(str(tmp_path), "m").load("step", arguments) is not None
    loading = textwrap.dedent(f"""
        import sys
        from jpaged.runner.executable_cache import ExecutableCache
        with ExecutableCache({str(tmp_path)!r}, "m").loading():
            print("loading", flush=True)
            sys.stdin.read()
    """)
    alive = subprocess.Popen([sys.executable, "-c", loading], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert alive.stdout.readline() == "loading\n"
        assert not ExecutableCache(str(tmp_path), "m").skip_loads
    finally:
        alive.communicate("")
    assert alive.returncode == 0 and not any(p.name.startswith(".loading.") for p in tmp_path.iterdir())


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL", "SIGINT", "SIGSEGV"])
def test_only_a_crash_while_loading_costs_the_cache(tmp_path, caplog, how):
    """A start stopped by a signal while loading (a supervisor's SIGTERM to a restarting replica,
    SIGKILL after its grace period, Ctrl-C) is no crash: the next start loads every executable.
    A crash inside the load (SIGSEGV here, SIGABRT in the test above) is recorded in the marker,
    and the next start loads nothing, once."""
    import signal
    import subprocess
    import sys
    import textwrap

    _, _, arguments = _kept(tmp_path)
    stop = "import ctypes; ctypes.string_at(0)" if how == "SIGSEGV" else \
        f"os.kill(os.getpid(), signal.{how}); time.sleep(30)"
    dies = textwrap.dedent(f"""
        import os, signal, time
        from jpaged.runner.executable_cache import ExecutableCache
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as a process that set no handler
        with ExecutableCache({str(tmp_path)!r}, "m").loading():
            {stop}
    """)
    run = subprocess.run([sys.executable, "-c", dies], capture_output=True, timeout=120)
    assert run.returncode == -getattr(signal, how), (run.returncode, run.stderr[-2000:])
    marker, = (p for p in tmp_path.iterdir() if p.name.startswith(".loading."))
    crashed = how == "SIGSEGV"
    assert ("Segmentation fault" in marker.read_text()) == crashed
    cache = ExecutableCache(str(tmp_path), "m")
    assert cache.skip_loads == crashed
    assert ("died while loading" in caplog.text) == crashed
    assert (cache.load("step", arguments) is None) == crashed
    assert not any(p.name.startswith(".loading.") for p in tmp_path.iterdir())
    assert ExecutableCache(str(tmp_path), "m").load("step", arguments) is not None


def test_a_start_killed_before_its_marker_says_anything_costs_nothing(tmp_path, caplog):
    """A SIGKILL between the marker's creation and its first line (just after the server's URL
    line, as the warm-up starts loading) leaves an empty marker: no load had begun, so the next
    start loads every executable (it compiled all of them again before)."""
    import socket
    import subprocess
    import sys

    _, _, arguments = _kept(tmp_path)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    marker = tmp_path / f".loading.{socket.gethostname()}.{int(gone.stdout)}"
    marker.write_text("")
    cache = ExecutableCache(str(tmp_path), "m")
    assert not cache.skip_loads and "died while loading" not in caplog.text
    assert cache.load("step", arguments) is not None and not marker.exists()


def test_loading_sets_faulthandler_back(tmp_path):
    """While loading, faulthandler writes into the marker; afterwards it is as it was."""
    import faulthandler

    _, _, arguments = _kept(tmp_path)
    was = faulthandler.is_enabled()
    try:
        for enabled in (False, True):
            faulthandler.enable() if enabled else faulthandler.disable()
            cache = ExecutableCache(str(tmp_path), "m")
            with cache.loading():
                assert faulthandler.is_enabled()
                assert cache.load("step", arguments) is not None
            assert faulthandler.is_enabled() == enabled
    finally:
        faulthandler.enable() if was else faulthandler.disable()


def test_read_only_directory_is_only_read(tmp_path, monkeypatch):
    """A cache on a read-only file system (a `:ro` mount): hits load without touching the files,
    misses compile and serve, nothing raises. A real read-only bind mount where this process may
    mount one, else every write refused as such a mount refuses it."""
    import errno
    import subprocess

    rng = np.random.default_rng()
    fn = jitted(2.0)
    kept = args(rng)
    ExecutableCache(str(tmp_path / "src"), "m").compile("step", fn, kept)
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in (tmp_path / "src").iterdir()}
    directory = tmp_path / "ro"
    directory.mkdir()
    mounted = subprocess.run(["mount", "--bind", "-o", "ro", str(tmp_path / "src"), str(directory)],
                             capture_output=True).returncode == 0
    print("real read-only mount:", mounted)
    if not mounted:
        directory.rmdir()
        directory = tmp_path / "src"

        def refuse(*a, **k):
            raise OSError(errno.EROFS, "Read-only file system")

        for name in ("utime", "replace", "remove", "mkfifo"):
            monkeypatch.setattr(os, name, refuse)
        monkeypatch.setattr(executable_cache.tempfile, "NamedTemporaryFile", refuse)
        real_open = open
        monkeypatch.setattr("builtins.open", lambda f, mode="r", *a, **k:
                            refuse() if any(c in mode for c in "wax+") else real_open(f, mode, *a, **k))
    try:
        cache = ExecutableCache(str(directory), "m")
        pool, x = kept
        total, _ = cache.compile("step", fn, (pool, x))(pool, x)
        assert cache.hits == 1
        np.testing.assert_allclose(total, np.asarray((x * 2).sum()), rtol=1e-5, atol=1e-5)
        pool, x = args(rng, 16)  # a miss: compiled, not kept
        total, _ = cache.compile("step", fn, (pool, x))(pool, x)
        np.testing.assert_allclose(total, np.asarray((x * 2).sum()), rtol=1e-5, atol=1e-5)
        assert cache.hits == 1
        after = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in directory.iterdir()}
        assert after == before
    finally:
        if mounted:
            subprocess.run(["umount", str(directory)], check=True)


# ------------------------------------------------------------------ whole engines
LIMITS = dict(model="tiny", max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64,
              background_warmup=False)  # every executable in (or loaded) at construction


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """(a cache directory warmed by an engine with LIMITS, that engine), built once for the file:
    it compiled every executable into the fresh directory. Tests that damage, fail or reload a warm
    cache work on a copy (_copy) and take their expected outputs from this engine (greedy: what a
    test ran on it before changes nothing), instead of compiling the same warm-up again."""
    directory = tmp_path_factory.mktemp("warm_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JPAGED_CACHE_DIR", str(directory))
        llm = jpaged.LLM(**LIMITS)
    assert llm.llm_engine.runner.executable_cache.hits == 0
    return directory, llm


def _copy(directory, to):
    """A copy of the warm cache `directory` at `to` (created or added to)."""
    shutil.copytree(directory, to, dirs_exist_ok=True)
    return to


def _greedy(llm, seed):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 256, size=rng.integers(2, 30)).tolist() for _ in range(4)]
    params = jpaged.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.slow
def test_engine_starts_over_a_damaged_cache(warm, tmp_path, monkeypatch):
    """Every file of a warm cache damaged (each one: a flipped bit at a random offset, swapped
    with another file, or truncated): the engine starts, compiles exactly those, and generates
    what a clean start did; the start after that loads every rewritten file."""
    seed = np.random.randint(2**31)
    print("seed", seed)
    rng = np.random.default_rng(seed)
    directory, clean = warm
    monkeypatch.setenv("JPAGED_CACHE_DIR", str(_copy(directory, tmp_path)))
    expected = _greedy(clean, seed)
    n = clean.llm_engine.runner.num_compilations
    files = sorted(p for p in tmp_path.iterdir() if p.name.endswith(".bin"))
    assert len(files) == n
    kinds = rng.permutation(["flip", "swap", "truncate"] * n)[:n]
    kinds[:3] = ["flip", "swap", "truncate"]  # each kind at least once
    contents = {p: p.read_bytes() for p in files}
    swapped = [p for p, kind in zip(files, kinds) if kind == "swap"]
    if len(swapped) == 1:  # a swap needs a partner: another executable's file
        swapped.append(next(p for p, kind in zip(files, kinds) if kind == "flip"))
    for p, kind in zip(files, kinds):
        data = bytearray(contents[p])
        if kind == "flip":
            data[rng.integers(len(data))] ^= 1 << int(rng.integers(8))
        elif kind == "truncate":
            data = data[:rng.integers(len(data))]
        p.write_bytes(bytes(data))
    for p, q in zip(swapped, swapped[1:] + swapped[:1]):
        p.write_bytes(contents[q])
    print("damage:", dict(zip((p.name[:8] for p in files), kinds)))
    damaged = jpaged.LLM(**LIMITS)
    cache = damaged.llm_engine.runner.executable_cache
    assert cache.hits == 0 and cache.rejected == n and damaged.llm_engine.runner.num_compilations == n
    assert _greedy(damaged, seed) == expected
    del damaged
    again = jpaged.LLM(**LIMITS)
    assert again.llm_engine.runner.executable_cache.hits == n
    assert _greedy(again, seed) == expected
    del again
    # The same cache mounted read-only (a `:ro` volume; start-up used to exit 1 on os.utime), where
    # this process may mount one: every executable loads, nothing is written.
    import subprocess

    read_only = tmp_path.parent / f"{tmp_path.name}-ro"
    read_only.mkdir()
    if subprocess.run(["mount", "--bind", "-o", "ro", str(tmp_path), str(read_only)],
                      capture_output=True).returncode != 0:
        print("no read-only mount here: test_read_only_directory_is_only_read simulates one")
        return
    try:
        before = sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.iterdir())
        monkeypatch.setenv("JPAGED_CACHE_DIR", str(read_only))
        engine = jpaged.LLM(**LIMITS)
        assert engine.llm_engine.runner.executable_cache.hits == n
        assert _greedy(engine, seed) == expected
        assert sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.iterdir()) == before
    finally:
        subprocess.run(["umount", str(read_only)], check=True)


def test_warm_up_failing_after_loads_is_retried_without_the_cache(warm, tmp_path, monkeypatch, caplog):
    """XLA is the last judge: a start-up that fails after loading cached executables (here the
    fourth load raises) is retried once with the cache bypassed, says so, and serves correctly."""
    directory, first = warm
    monkeypatch.setenv("JPAGED_CACHE_DIR", str(_copy(directory, tmp_path)))
    seed = np.random.randint(2**31)
    print("seed", seed)
    expected = _greedy(first, seed)
    real_load, calls = ExecutableCache.load, []

    def load(self, name, arguments):
        calls.append(name)
        if len(calls) == 4:
            raise RuntimeError("INTERNAL: executable failed to load")
        return real_load(self, name, arguments)

    monkeypatch.setattr(ExecutableCache, "load", load)
    second = jpaged.LLM(**LIMITS)
    assert "retrying once with the executable cache bypassed" in caplog.text
    runner = second.llm_engine.runner
    assert runner.executable_cache.skip_loads and runner.num_compilations == len(list(runner.buckets.keys()))
    assert _greedy(second, seed) == expected


def test_no_executable_cache_reads_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("JPAGED_CACHE_DIR", str(tmp_path / "cache"))
    llm = jpaged.LLM(**LIMITS, executable_cache=False)
    assert llm.llm_engine.runner.num_compilations > 0 and not (tmp_path / "cache").exists()


def test_two_engines_sharing_a_cache_start_at_once(tmp_path):
    """Two processes start on one empty cache directory at the same time (both compile and write
    the same files): both serve the same greedy tokens, and a third start loads everything."""
    import json
    import subprocess
    import sys
    import textwrap

    seed = np.random.randint(2**31)
    print("seed", seed)
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import jpaged
        from test_executable_cache import LIMITS, _greedy
        llm = jpaged.LLM(**LIMITS)
        cache = llm.llm_engine.runner.executable_cache
        print(json.dumps([cache.hits, cache.rejected, _greedy(llm, {seed})]))
    """)
    env = {**os.environ, "JPAGED_CACHE_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    runs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
            for _ in range(2)]
    results = [json.loads(run.communicate(timeout=600)[0].splitlines()[-1]) for run in runs]
    assert [run.returncode for run in runs] == [0, 0]
    (_, rejected_a, tokens_a), (_, rejected_b, tokens_b) = results
    assert tokens_a == tokens_b and rejected_a == rejected_b == 0
    third = subprocess.run([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True, timeout=600)
    hits, rejected, tokens = json.loads(third.stdout.splitlines()[-1])
    assert hits > 0 and rejected == 0 and tokens == tokens_a
    assert not any(p.name.startswith((".loading", ".tmp")) for p in tmp_path.iterdir())
