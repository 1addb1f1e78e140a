"""Executables kept on disk whole (jpaged/runner/executable_cache.py): loaded only under the same
key, equal in results to a fresh compile, donation kept, a damaged file compiled again."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

import jpaged
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
    np.testing.assert_allclose(total, expected_sum, rtol=1e-6)
    np.testing.assert_allclose(new_pool, expected_pool, rtol=1e-6)
    # Another model, name or argument shape: another key, compiled and kept beside the first.
    pool, x = args(rng)
    for cache, name, arguments in ((ExecutableCache(str(tmp_path), "model-b"), "step", (pool, x)),
                                   (ExecutableCache(str(tmp_path), "model-a"), "other", (pool, x)),
                                   (ExecutableCache(str(tmp_path), "model-a"), "step", args(rng, 16))):
        cache.compile(name, fn, arguments)
        assert cache.hits == 0
    assert len(os.listdir(tmp_path)) == 4
    del compiled


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
    np.testing.assert_allclose(total, expected, rtol=1e-6)
    assert ExecutableCache(str(tmp_path), "m").compile("step", fn, args(rng)) is not None  # rewritten whole


def test_engine_restart_loads_every_executable():
    """A second engine with the same model and limits loads its whole warm-up from disk and
    generates what the first did."""
    limits = dict(model="tiny", max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64)
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 256, size=rng.integers(2, 30)).tolist() for _ in range(5)]
    params = jpaged.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    first = jpaged.LLM(**limits)
    expected = [o.outputs[0].token_ids for o in first.generate(prompts, params, use_tqdm=False)]
    del first
    second = jpaged.LLM(**limits)
    runner = second.llm_engine.runner
    assert runner.executable_cache.hits == runner.num_compilations > 0
    assert [o.outputs[0].token_ids for o in second.generate(prompts, params, use_tqdm=False)] == expected


def test_least_recently_used_are_pruned(tmp_path, monkeypatch):
    from jpaged.runner import executable_cache

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
