"""Batch-invariant mode (issue 41): a request's tokens and logprobs have the same bits whatever
shares its steps. First the negative control at the op level (what XLA's CPU backend does without
the mode: a row of x @ W and the attention twins change with the batch), then the engine: each
prompt alone vs in random batches, with prefix caching and different chunk sizes.
"""

import asyncio
import functools
import json

import aiohttp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jpaged
import pallas_kernels.invariant as inv
import pallas_kernels.xla as xla_kernels
from jpaged.config import EngineConfig
from jpaged.models.batch_invariant import logsumexp_last, row_tiled_dot
from jpaged.models.layers import Attention

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
    # Decode rows in smaller tiles (what the engine runs where the probe allows it): the same bits.
    tiles = inv.invariant_tiles(heads // kvh, d)
    print("tiles (decode, prefill):", tiles)
    _, small_got = cases(functools.partial(inv.ragged_paged_attention_invariant, tiles=tiles))
    for name, out in small_got.items():
        assert np.array_equal(out, alone), name
    if fixed_chunk:  # the twin's chunk fixed too: its dots still differ
        monkeypatch.setattr(xla_kernels, "chunk_pages", lambda n, pages: 4)
    twin, twin_got = cases(xla_kernels.ragged_paged_attention_xla)
    print("XLA twin, max |case - alone|:", {n: float(np.abs(o - twin).max()) for n, o in twin_got.items()})
    assert any(not np.array_equal(o, twin) for o in twin_got.values())
    np.testing.assert_allclose(alone, twin, atol=1e-5)


@pytest.mark.parametrize("kvh, heads", [(2, 2), (1, 3), (2, 8)])
def test_decode_tile_ragged_batches(kvh, heads):
    """Random ragged batches, most sequences one token (decode rows): with the probe's tiles (on
    jax 0.10.2's CPU: decode rows alone, or 2 rows for one head per kv head; prefill rows in 16-row
    tiles) every row has the bits of QUERY_TILE-row tiles, and so has each prefill tile size."""
    seed = int(np.random.default_rng().integers(1 << 30))
    print("seed", seed)
    rng = np.random.default_rng(seed)
    d, page, pages = 64, 16, 300
    k, v = (jnp.asarray(rng.standard_normal((kvh, pages, page, d)), jnp.float32) for _ in range(2))
    tiles = inv.invariant_tiles(heads // kvh, d)
    print("tiles (decode, prefill):", tiles)
    assert tiles[0] < inv.QUERY_TILE and tiles[0] * heads // kvh >= 2 and tiles[1] > inv.QUERY_TILE
    for _ in range(4):
        s = int(rng.integers(1, 9))
        qlens = rng.integers(1, 20, s)
        qlens[rng.random(s) < 0.6] = 1
        lens = qlens + rng.integers(0, 150, s)
        tables = rng.permutation(pages)[:s * 12].reshape(s, 12).astype(np.int32)
        q = jnp.asarray(rng.standard_normal((int(qlens.sum()) + 3, heads, d)), jnp.float32)
        qsl = jnp.asarray(np.concatenate([[0], np.cumsum(qlens)]), jnp.int32)
        args = (q, k, v, jnp.asarray(tables), jnp.asarray(lens, jnp.int32), qsl)
        ref = np.asarray(inv.ragged_paged_attention_invariant(*args))
        for t in {tiles, (tiles[0], 8), (inv.QUERY_TILE, tiles[1])}:
            assert np.array_equal(np.asarray(inv.ragged_paged_attention_invariant(*args, tiles=t)), ref), (t, qlens)


def test_invariant_tiles_probe_falls_back(monkeypatch):
    """A backend whose dots change a row's bits with the number of rows keeps QUERY_TILE tiles."""
    real = inv._probe_dot

    def drifting(a, b, contract):  # rows summed another way at any row count but QUERY_TILE * group
        out = np.asarray(real(a, b, contract))
        return out if a.shape[1] == 8 else out * np.float32(1 + 2 ** -20)

    monkeypatch.setattr(inv, "_probe_dot", drifting)
    inv.invariant_tiles.cache_clear()
    try:
        assert inv.invariant_tiles(2, 64) == (inv.QUERY_TILE, inv.QUERY_TILE)
    finally:
        monkeypatch.undo()
        inv.invariant_tiles.cache_clear()
    assert inv.invariant_tiles(2, 64) == (1, 16)


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


def _params(n, seed=1000):
    # seeded sampling at temperature 1, greedy, and top-k: each prompt its own
    kinds = [dict(temperature=1.0), dict(temperature=0.0), dict(temperature=0.7, top_k=20)]
    return [jpaged.SamplingParams(max_tokens=10, ignore_eos=True, logprobs=0, prompt_logprobs=0, seed=seed + i,
                                  **kinds[i % 3]) for i in range(n)]


@pytest.fixture(scope="module")
def engines():
    common = dict(max_model_len=128, max_num_seqs=64, enable_prefix_caching=True, enforce_eager=True,
                  executable_cache=False)
    return {"on": jpaged.LLM("tiny", batch_invariant=True, **common),
            "on_small_chunks": jpaged.LLM("tiny", batch_invariant=True, max_num_batched_tokens=64, **common),
            "off": jpaged.LLM("tiny", **common)}


def _differences(llm, prompts, params, rng):
    """Each request alone, then in batches of 2 to 64 with random neighbours (past the prompts
    given: new random prompts of the same kind), counting those that differ in any bit."""
    alone = [_run(llm, [p], [sp])[0] for p, sp in zip(prompts, params)]
    differ = 0
    for size in (2, 5, 16, 32, 64):
        order = rng.permutation(len(prompts))[:size]
        extra = _prompts(rng, size - len(order))
        got = _run(llm, [prompts[i] for i in order] + extra,
                   [params[i] for i in order] + _params(len(extra), seed=5000))
        for i, (tokens, lps, plps) in zip(order, got):
            a_tokens, a_lps, a_plps = alone[i]
            same = tokens == a_tokens and np.array_equal(lps, a_lps) and np.array_equal(plps, a_plps)
            differ += not same
    return alone, differ


def test_bs1_vs_bsn(engines):
    runner = engines["on"].llm_engine.runner
    model = nnx.merge(runner.graphdef, runner.state)
    tiles = {node.ops.invariant_tiles for _, node in nnx.iter_graph(model) if isinstance(node, Attention)}
    assert tiles == {(1, 16)}, tiles  # tiny (2 heads per kv head): the probe's tiles run here
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


def test_parallel_sampling(engines):
    """n > 1 (seeded, temperature 1 and 0.8 with top-p): every sample of a request has the same bits
    alone and among 20 neighbours."""
    llm = engines["on"]
    rng = np.random.default_rng()
    prompts = _prompts(rng, 4)
    params = [jpaged.SamplingParams(n=3, temperature=1.0 if i % 2 else 0.8, top_p=1.0 if i % 2 else 0.9, seed=40 + i,
                                    max_tokens=8, ignore_eos=True, logprobs=0) for i in range(4)]

    def samples(out):
        return [(list(c.token_ids), np.array([lp[t] for lp, t in zip(c.logprobs, c.token_ids)])) for c in out.outputs]

    alone = [samples(llm.generate([p], [sp], use_tqdm=False)[0]) for p, sp in zip(prompts, params)]
    neighbours = _prompts(rng, 20)
    outs = llm.generate(neighbours[:10] + prompts + neighbours[10:], _params(10) + params + _params(10, seed=77),
                        use_tqdm=False)
    got = [samples(out) for out in outs[10:14]]
    assert all(len(g) == 3 for g in got)
    # the samples of a request are not one sample repeated (not in every request: seeded draws may agree)
    assert any(len({tuple(t) for t, _ in g}) > 1 for g in got)
    for a, g in zip(alone, got):
        for (a_tokens, a_lps), (tokens, lps) in zip(a, g):
            assert a_tokens == tokens and np.array_equal(a_lps, lps)


def test_negative_control(engines):
    """Without the flag the same test finds differences (logprobs, at least)."""
    rng = np.random.default_rng()
    prompts = _prompts(rng, 16)
    _, differ = _differences(engines["off"], prompts, _params(len(prompts)), rng)
    print("requests that differ without batch_invariant:", differ)
    assert differ > 0


@pytest.mark.parametrize("option, value", [("attention_backend", "pallas"), ("attention_backend", "mosaic"),
                                           ("quantization", "int8"), ("kv_cache_dtype", "fp8"), ("enable_lora", True)])
def test_refused_options(option, value):
    with pytest.raises(ValueError, match=option):
        EngineConfig(batch_invariant=True, **{option: value})


def test_vllm_env_switch(monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert EngineConfig().batch_invariant
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert not EngineConfig().batch_invariant


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_overlap_options(engines, mode):
    """Forced preemption (14 blocks for 8 prompts of 20-60 tokens + 24), with async scheduling,
    multi-step decode or n-gram speculation: the same bits as each request alone on the roomy engine."""
    rng = np.random.default_rng()
    prompts = [[int(t) for t in rng.integers(0, 256, int(rng.integers(20, 60)))] for _ in range(8)]
    params = [jpaged.SamplingParams(max_tokens=24, ignore_eos=True, logprobs=0, prompt_logprobs=0, seed=7 + i,
                                    temperature=1.0 if i % 2 else 0.0) for i in range(8)]
    alone = [_run(engines["on"], [p], [sp])[0] for p, sp in zip(prompts, params)]
    extra = {"recompute": dict(async_scheduling=True, num_scheduler_steps=4),
             "swap": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                              "prompt_lookup_max": 3, "prompt_lookup_min": 1})}[mode]
    llm = jpaged.LLM("tiny", batch_invariant=True, num_gpu_blocks_override=14, preemption_mode=mode, swap_space=0.05,
                     max_model_len=128, enforce_eager=True, executable_cache=False, **extra)
    got = _run(llm, prompts, params)
    assert llm.stats()["num_preemptions"] > 0
    for a, b in zip(alone, got):
        assert a[0] == b[0] and np.array_equal(a[1], b[1]) and np.array_equal(a[2], b[2])


def test_policy(engines):
    """LLM.policy(): its logprobs equal the engine's bit for bit, however the trainer batches its
    call (all together, one alone, a reordered subset), and jax.grad runs through them."""
    llm = engines["on"]
    rng = np.random.default_rng()
    prompts = _prompts(rng, 6)
    outs = llm.generate(prompts, [jpaged.SamplingParams(temperature=1.0, seed=i, max_tokens=int(rng.integers(3, 14)),
                                                        logprobs=0, prompt_logprobs=0, ignore_eos=True)
                                  for i in range(6)], use_tqdm=False)
    seqs = tuple(tuple(p + list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs))
    # the engine's: prompt logprobs (tokens 1..) then those of the sampled tokens
    engine = [np.array([next(iter(lp.values())) for lp in o.prompt_logprobs[1:]]
                       + [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outs]
    policy = llm.policy()
    logprobs = jax.jit(policy.token_logprobs, static_argnums=1)
    together = [np.asarray(x) for x in logprobs(policy.params, seqs)]
    alone = np.asarray(logprobs(policy.params, (seqs[3],))[0])
    subset = [np.asarray(x) for x in logprobs(policy.params, (seqs[5], seqs[0], seqs[2]))]
    gaps = [float(np.abs(lp - e).max()) for lp, e in zip(together, engine)]
    print("max |policy - engine| per sequence:", gaps)
    for lp, e in zip(together, engine):
        assert lp.shape == e.shape and np.array_equal(lp, e)
    assert np.array_equal(alone, engine[3])
    for lp, i in zip(subset, (5, 0, 2)):
        assert np.array_equal(lp, engine[i])

    def loss(params):
        return -sum(jnp.sum(x) for x in policy.token_logprobs(params, seqs[:2]))

    grads = jax.grad(loss)(policy.params)
    leaves = jax.tree.leaves(grads)
    assert leaves and all(bool(jnp.isfinite(g).all()) for g in leaves)
    assert any(float(jnp.abs(g).max()) > 0 for g in leaves)


def test_tensor_parallel_2(engines):
    """TP 2 (two of the 8 forced host devices) is invariant across batchings too; whether it equals
    TP 1 is printed (not required: the row-parallel layers add two partial sums)."""
    rng = np.random.default_rng()
    prompts = _prompts(rng, 6)
    params = _params(len(prompts))
    llm = jpaged.LLM("tiny", batch_invariant=True, tensor_parallel_size=2, max_model_len=128, max_num_seqs=8,
                     enforce_eager=True, executable_cache=False)
    alone = [_run(llm, [p], [sp])[0] for p, sp in zip(prompts, params)]
    batched = _run(llm, prompts[::-1], params[::-1])[::-1]
    for a, b in zip(alone, batched):
        assert a[0] == b[0] and np.array_equal(a[1], b[1]) and np.array_equal(a[2], b[2])
    same = [np.array_equal(a[2], c[2]) for a, c in zip(alone, _run(engines["on"], prompts, params))]
    print("TP 2 prompt logprobs bitwise equal to TP 1's:", same)


def test_server_same_request_one_unique_completion():
    """SGLang's check: the same seeded request sent 50 times (10 at a time) while 16 other clients
    keep `jpaged serve --batch-invariant` busy with random requests gives one unique completion
    (text and logprobs)."""
    from test_server import Server, post

    rng = np.random.default_rng()
    server = Server("--batch-invariant", "--max-num-seqs", "32", "--max-model-len", "128", "--enforce-eager")
    probe = {"model": "tiny", "prompt": [int(t) for t in rng.integers(0, 256, 20)], "max_tokens": 12,
             "temperature": 1.0, "seed": 1234, "logprobs": 1, "ignore_eos": True}
    loads = [{"model": "tiny", "prompt": [int(t) for t in rng.integers(0, 256, int(rng.integers(4, 60)))],
              "max_tokens": int(rng.integers(4, 24)), "temperature": 1.0, "ignore_eos": True} for _ in range(64)]

    async def main():
        done = asyncio.Event()

        async def load(i):
            n = 0
            async with aiohttp.ClientSession() as session:
                while not done.is_set():
                    async with session.post(server.url + "/v1/completions", json=loads[(i + 16 * n) % 64]) as r:
                        assert r.status == 200, await r.text()
                    n += 1
            return n

        loaders = [asyncio.create_task(load(i)) for i in range(16)]
        answers = []
        for _ in range(5):
            answers += await asyncio.gather(*(post(server.url, "/v1/completions", probe, headers={})
                                              for _ in range(10)))
        done.set()
        return answers, await asyncio.gather(*loaders)

    try:
        answers, loaded = asyncio.run(main())
    finally:
        assert server.stop() == 0, "".join(server.log[-30:])
    assert all(status == 200 for status, _ in answers), answers[0]
    unique = {json.dumps([c["text"], c["logprobs"]["token_logprobs"]]) for _, body in answers for c in body["choices"]}
    print("unique samples:", len(unique), "load requests served:", sum(loaded))
    assert sum(loaded) >= 16 and len(unique) == 1


def test_cli_flag():
    from serving import cli

    assert cli.build_parser().parse_args(["serve", "--batch-invariant"]).batch_invariant
