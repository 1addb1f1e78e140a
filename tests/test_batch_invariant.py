"""Batch-invariant mode (issue 41): a request's tokens and logprobs have the same bits whatever
shares its steps. First the negative control at the op level (what XLA's CPU backend does without
the mode: a row of x @ W and the attention twins change with the batch), then the engine: each
prompt alone vs in random batches, with prefix caching and different chunk sizes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jpaged
import pallas_kernels.invariant as inv
import pallas_kernels.xla as xla_kernels
from jpaged.config import EngineConfig
from jpaged.models.batch_invariant import logsumexp_last, row_tiled_dot

HIGHEST = jax.lax.Precision.HIGHEST


# ---------------------------------------------------------------- ops --
def test_plain_dot_changes_with_rows_tiled_dot_does_not():
    """The negative control: jax 0.10.2's CPU dot sums a row differently for 1, 2-32 and 64+ rows."""
    rng = np.random.default_rng()
    w = jnp.asarray(rng.standard_normal((576, 1536)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((80, 576)), jnp.float32)
    plain = jax.jit(lambda x: jnp.dot(x, w, precision=HIGHEST))
    tiled = jax.jit(lambda x: row_tiled_dot(x, w, ((1,), (0,)), HIGHEST))
    plain_diffs = [float(np.abs(np.asarray(plain(x[:m]))[0] - np.asarray(plain(x[:1]))[0]).max()) for m in (2, 64)]
    print("plain dot, row 0 with 2 / 64 rows vs alone:", plain_diffs)
    ref = np.asarray(tiled(x[:1]))[0]
    for m in (2, 15, 16, 17, 64, 80):
        assert np.array_equal(np.asarray(tiled(x[:m]))[0], ref), m
    rolled = np.asarray(tiled(jnp.roll(x[:40], 21, axis=0)))  # row 0 at position 21 (second tile)
    assert np.array_equal(rolled[21], ref)
    np.testing.assert_allclose(ref, np.asarray(x[0], np.float64) @ np.asarray(w, np.float64), rtol=1e-4, atol=1e-3)


def test_logsumexp_fixed_order():
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((16, 576)) * 3, jnp.float32)
    f = jax.jit(logsumexp_last)
    ref = np.asarray(f(x[:1]))[0]
    assert all(np.array_equal(np.asarray(f(x[:m]))[0], ref) for m in (2, 8, 16))
    np.testing.assert_allclose(ref, np.log(np.exp(np.asarray(x[0], np.float64)).sum()), rtol=1e-6)
    assert float(f(jnp.array([[0.0, -jnp.inf]]))[0]) == 0.0


def _attention(fn, k, v, lens, qlens, q, width=12, pad=5):
    s = len(lens)
    tables = (np.arange(s * width).reshape(s, width) % k.shape[1]).astype(np.int32)
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    q = jnp.concatenate([q, jnp.zeros((pad,) + q.shape[1:], q.dtype)])
    return np.asarray(fn(q, k, v, jnp.asarray(tables), jnp.asarray(lens, jnp.int32), jnp.asarray(qsl)))


@pytest.mark.parametrize("fixed_chunk", [False, True])
def test_attention(monkeypatch, fixed_chunk):
    """One sequence's 100 query rows: prefill alone, batched, as a chunk over cached keys, and its
    last row as a decode (alone and batched) all give the same bits; the XLA twin does not."""
    rng = np.random.default_rng()
    kvh, heads, d, page, pages = 2, 4, 64, 16, 200
    k, v = (jnp.asarray(rng.standard_normal((kvh, pages, page, d)), jnp.float32) for _ in range(2))
    q0 = jnp.asarray(rng.standard_normal((100, heads, d)), jnp.float32)
    other = jnp.asarray(rng.standard_normal((150, heads, d)), jnp.float32)

    def cases(fn):
        alone = _attention(fn, k, v, [100], [100], q0)[:100]
        return alone, {
            "batched": _attention(fn, k, v, [100, 150, 37], [100, 1, 37], jnp.concatenate([q0, other[:38]]))[:100],
            "chunk": np.concatenate([alone[:70], _attention(fn, k, v, [100], [30], q0[70:])[:30]]),
            "decode": np.concatenate([alone[:99], _attention(fn, k, v, [100], [1], q0[99:])[:1]]),
            "decode batched": np.concatenate([alone[:99], _attention(fn, k, v, [100, 150, 1], [1, 1, 1],
                                                                     jnp.concatenate([q0[99:], other[:2]]))[:1]]),
        }

    alone, got = cases(inv.ragged_paged_attention_invariant)
    for name, out in got.items():
        assert np.array_equal(out, alone), name
    if fixed_chunk:  # the twin's chunk fixed too: its dots still differ
        monkeypatch.setattr(xla_kernels, "chunk_pages", lambda n, pages: 4)
    twin, twin_got = cases(xla_kernels.ragged_paged_attention_xla)
    print("XLA twin, max |case - alone|:", {n: float(np.abs(o - twin).max()) for n, o in twin_got.items()})
    assert any(not np.array_equal(o, twin) for o in twin_got.values())
    np.testing.assert_allclose(alone, twin, atol=1e-5)


# ---------------------------------------------------------------- engine --
def _prompts(rng, n=32):
    """Prompts sharing prefixes (prefix-cache hits): 4 stems, each prompt a stem's head and its own tail."""
    stems = [[int(t) for t in rng.integers(0, 256, 48)] for _ in range(4)]
    return [stems[i % 4][:int(rng.integers(8, 48))] + [int(t) for t in rng.integers(0, 256, int(rng.integers(1, 24)))]
            for i in range(n)]


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), np.array([lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]),
             np.array([next(iter(lp.values())) for lp in o.prompt_logprobs[1:]])) for o in outs]


def _params(n):
    # seeded sampling at temperature 1, greedy, and top-k: each prompt its own
    kinds = [dict(temperature=1.0), dict(temperature=0.0), dict(temperature=0.7, top_k=20)]
    return [jpaged.SamplingParams(max_tokens=10, ignore_eos=True, logprobs=0, prompt_logprobs=0, seed=1000 + i,
                                  **kinds[i % 3]) for i in range(n)]


@pytest.fixture(scope="module")
def engines():
    common = dict(max_model_len=128, max_num_seqs=64, enable_prefix_caching=True, enforce_eager=True,
                  executable_cache=False)
    return {"on": jpaged.LLM("tiny", batch_invariant=True, **common),
            "on_small_chunks": jpaged.LLM("tiny", batch_invariant=True, max_num_batched_tokens=64, **common),
            "off": jpaged.LLM("tiny", **common)}


def _differences(llm, prompts, params, rng):
    alone = [_run(llm, [p], [sp])[0] for p, sp in zip(prompts, params)]
    differ = 0
    for size in (2, 5, 16, 32):
        order = rng.permutation(len(prompts))[:size]
        got = _run(llm, [prompts[i] for i in order], [params[i] for i in order])
        for i, (tokens, lps, plps) in zip(order, got):
            a_tokens, a_lps, a_plps = alone[i]
            same = tokens == a_tokens and np.array_equal(lps, a_lps) and np.array_equal(plps, a_plps)
            differ += not same
    return alone, differ


def test_bs1_vs_bsn(engines):
    rng = np.random.default_rng()
    prompts = _prompts(rng)
    params = _params(len(prompts))
    alone, differ = _differences(engines["on"], prompts, params, rng)
    assert differ == 0
    # Chunk boundaries (max_num_batched_tokens=64 cuts long prompts and batches) change no bit.
    small = [_run(engines["on_small_chunks"], [p], [sp])[0] for p, sp in zip(prompts[:8], params[:8])]
    batched = _run(engines["on_small_chunks"], prompts, params)
    for a, s, b in zip(alone, small, batched):
        assert a[0] == s[0] == b[0]
        assert np.array_equal(a[1], s[1]) and np.array_equal(a[1], b[1])
        assert np.array_equal(a[2], s[2]) and np.array_equal(a[2], b[2])


def test_negative_control(engines):
    """Without the flag the same test finds differences (logprobs, at least)."""
    rng = np.random.default_rng()
    prompts = _prompts(rng, 16)
    _, differ = _differences(engines["off"], prompts, _params(len(prompts)), rng)
    print("requests that differ without batch_invariant:", differ)
    assert differ > 0


@pytest.mark.parametrize("option, value", [("attention_backend", "pallas"), ("attention_backend", "mosaic"),
                                           ("quantization", "int8"), ("kv_cache_dtype", "fp8"), ("enable_lora", True),
                                           ("speculative_config", {"method": "draft_model", "model": "tiny",
                                                                   "num_speculative_tokens": 2})])
def test_refused_options(option, value):
    with pytest.raises(ValueError, match=option):
        EngineConfig(batch_invariant=True, **{option: value})


def test_vllm_env_switch(monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert EngineConfig().batch_invariant
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert not EngineConfig().batch_invariant
