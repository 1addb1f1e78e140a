"""The sampler against an independent float64 numpy reference (fresh random inputs on every run)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.runner.sampler import SamplerOutput, SamplingMetadata, SamplingRow, apply_penalties, sample
from jpaged.sampling_params import SamplingParams

_sample = jax.jit(sample)


@pytest.fixture
def rng():
    seed = int(np.random.SeedSequence().entropy % (1 << 63))
    print(f"numpy seed of this test: {seed}")  # shown by pytest when the test fails
    return np.random.default_rng(seed)


def make_meta(s, *, prompt=None, output=None, banned=None, num_logprobs=0, do_penalties=None, bias=None,
              bitmask=None, targets=None, **arrays):
    """SamplingMetadata built directly from arrays (defaults: greedy, every knob off)."""
    defaults = dict(temperature=(np.float32, 0.0), top_k=(np.int32, -1), top_p=(np.float32, 1.0),
                    min_p=(np.float32, 0.0), presence_penalty=(np.float32, 0.0),
                    frequency_penalty=(np.float32, 0.0), repetition_penalty=(np.float32, 1.0),
                    seeds=(np.uint32, 0), seq_index=(np.int32, 0), sample_index=(np.int32, 0))
    fields = {}
    for name, (dtype, value) in defaults.items():
        fields[name] = np.broadcast_to(np.asarray(arrays.pop(name, value), dtype), (s,)).copy()
    assert not arrays, arrays
    tokens = lambda x: np.full((s, 0), -1, np.int32) if x is None else np.asarray(x, np.int32)
    targets = np.full(s, -1) if targets is None else targets
    if do_penalties is None:
        do_penalties = prompt is not None or output is not None
    bias_ids, bias_values = bias if bias is not None else (np.full((s, 4), -1, np.int32), np.zeros((s, 4), np.float32))
    return SamplingMetadata(**fields, prompt_token_ids=tokens(prompt), output_token_ids=tokens(output),
                            banned_token_ids=tokens(banned), logit_bias_ids=np.asarray(bias_ids, np.int32),
                            logit_bias_values=np.asarray(bias_values, np.float32),
                            allowed_bitmask=tokens(bitmask), target_token_ids=np.asarray(targets, np.int32),
                            do_penalties=do_penalties, num_logprobs=num_logprobs,
                            do_guided=bitmask is not None)


# ----------------------------------------------------------------------------- float64 reference


def ref_penalize(logits, prompt, output, presence, frequency, repetition):
    out = np.array(logits, np.float64)
    s, v = out.shape
    for i in range(s):
        counts = np.zeros(v)
        for t in output[i]:
            if t >= 0:
                counts[t] += 1
        seen = counts > 0
        for t in prompt[i]:
            if t >= 0:
                seen[t] = True
        row = out[i]
        r = float(repetition[i])
        row = np.where(seen, np.where(row > 0, row / r, row * r), row)
        out[i] = row - float(frequency[i]) * counts - float(presence[i]) * (counts > 0)
    return out


def ref_ban(logits, banned):
    out = np.array(logits, np.float64)
    for i, row in enumerate(banned):
        for t in row:
            if t >= 0:
                out[i, t] = -np.inf
    return out


def ref_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def ref_distribution(logits_row, temperature, top_k, top_p, min_p):
    """Probabilities of one random row after temperature, top-k, top-p (on top-k), min-p."""
    z = np.asarray(logits_row, np.float64) / temperature
    v = len(z)
    order = np.argsort(-z, kind="stable")
    k = v if top_k <= 0 or top_k >= v else top_k
    kept = order[:k]
    kept = kept[np.isfinite(z[kept])]
    p = np.exp(z[kept] - z[kept[0]])
    p /= p.sum()
    if top_p < 1.0:
        n = int(np.searchsorted(np.cumsum(p), top_p)) + 1  # smallest prefix with mass >= top_p
        kept = kept[:max(1, min(n, len(kept)))]
    p_full = np.exp(z[kept] - z[kept[0]])  # relative to the max probability
    kept = kept[p_full >= min_p]
    probs = np.zeros(v)
    probs[kept] = np.exp(z[kept] - z[kept[0]])
    return probs / probs.sum()


def check_draws(draws, probs, what):
    """Every draw is allowed, and the counts fit the reference distribution (chi-square + TV)."""
    n = len(draws)
    counts = np.bincount(draws, minlength=len(probs))
    forbidden = counts[probs == 0].sum()
    assert forbidden == 0, f"{what}: {forbidden} draws outside the allowed set"
    tv = 0.5 * np.abs(counts / n - probs).sum()
    assert tv < 0.09, f"{what}: total variation {tv:.3f}"
    expected = n * probs
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:  # fold the small bins into the last real one
        obs[-2] += obs[-1]
        exp[-2] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    df = max(len(obs) - 1, 1)
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    assert chi2 < df + 8 * math.sqrt(2 * df) + 10, f"{what}: chi2={chi2:.1f} with df={df}"


# ----------------------------------------------------------------------------- tests


def test_penalties_match_reference(rng):
    s, v, lp, lo = 6, 40, 12, 10
    logits = rng.normal(0, 3, (s, v)).astype(np.float32)
    # Token lists with repeats, -1 padding at the end (like the builder), ids shared by prompt and output.
    # (test_logprobs_and_top_k_match_reference also puts -1 in the middle of rows.)
    prompt = np.full((s, lp), -1, np.int32)
    output = np.full((s, lo), -1, np.int32)
    for i in range(s):
        n_p, n_o = rng.integers(0, lp + 1), rng.integers(0, lo + 1)
        prompt[i, :n_p] = rng.integers(0, v // 2, n_p)
        output[i, :n_o] = rng.integers(0, v // 2, n_o)
    output[0, :4] = [3, 3, 3, 5]
    presence = np.zeros(s, np.float32)
    frequency = np.zeros(s, np.float32)
    repetition = np.ones(s, np.float32)
    presence[0], frequency[1], repetition[2] = rng.uniform(-2, 2), rng.uniform(-2, 2), rng.uniform(1.1, 2)
    repetition[3] = rng.uniform(0.3, 0.9)  # < 1 favours repeats
    presence[4], frequency[4], repetition[4] = rng.uniform(-2, 2), rng.uniform(-2, 2), rng.uniform(0.5, 2)
    # row 5: every penalty off, tokens present: untouched
    meta = make_meta(s, prompt=prompt, output=output, presence_penalty=presence, frequency_penalty=frequency,
                     repetition_penalty=repetition)
    got = np.asarray(jax.jit(apply_penalties)(jnp.asarray(logits), meta))
    want = ref_penalize(logits, prompt, output, presence, frequency, repetition)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[5], logits[5])
    assert not np.allclose(got[:5], logits[:5])


def test_greedy_is_argmax_of_penalized_logits(rng):
    s, v = 8, 100
    logits = rng.normal(0, 2, (s, v)).astype(np.float32)
    output = np.full((s, 4), -1, np.int32)
    output[:, 0] = logits.argmax(-1)  # penalise the favourite so the penalty matters
    banned = np.full((s, 2), -1, np.int32)
    banned[1, 0] = np.argsort(-logits[1])[0]
    banned[1, 1] = np.argsort(-logits[1])[1]
    temperature = np.zeros(s, np.float32)
    temperature[1] = 1e-6
    top_k = np.where(np.arange(s) % 2 == 0, 3, -1)  # ignored by greedy rows
    frequency = np.full(s, 1.5, np.float32)
    ref = ref_ban(ref_penalize(logits, np.full((s, 0), -1), output, np.zeros(s), frequency, np.ones(s)), banned)
    meta = make_meta(s, output=output, banned=banned, temperature=temperature, top_k=top_k, top_p=0.3,
                     frequency_penalty=frequency, seeds=rng.integers(0, 2**32, s))
    out = _sample(jnp.asarray(logits), meta)
    np.testing.assert_array_equal(np.asarray(out.token_ids), ref.argmax(-1))
    # Mixed batch (the random branch runs): greedy rows still take the argmax.
    temperature[5:] = 1.0
    meta = make_meta(s, output=output, banned=banned, temperature=temperature, top_k=top_k, top_p=0.3,
                     frequency_penalty=frequency, seeds=rng.integers(0, 2**32, s))
    out = _sample(jnp.asarray(logits), meta)
    np.testing.assert_array_equal(np.asarray(out.token_ids)[:5], ref.argmax(-1)[:5])


def test_logprobs_and_top_k_match_reference(rng):
    s, v, k = 8, 64, 5
    logits = rng.normal(0, 2, (s, v)).astype(np.float32)
    prompt = rng.integers(-1, v, (s, 6)).astype(np.int32)
    output = rng.integers(-1, v, (s, 5)).astype(np.int32)
    banned = np.full((s, 4), -1, np.int32)
    banned[:, 0] = logits.argmax(-1)
    banned[::2, 1] = rng.integers(0, v, s)[::2]
    presence, frequency = rng.uniform(-1, 1, s), rng.uniform(-1, 1, s)
    repetition = rng.uniform(0.7, 1.5, s)
    temperature = np.where(np.arange(s) < 4, 0.0, rng.uniform(0.5, 1.5, s))
    meta = make_meta(s, prompt=prompt, output=output, banned=banned, num_logprobs=k, temperature=temperature,
                     top_p=0.9, presence_penalty=presence, frequency_penalty=frequency,
                     repetition_penalty=repetition, seeds=rng.integers(0, 2**32, s))
    out = _sample(jnp.asarray(logits), meta)
    assert isinstance(out, SamplerOutput)
    assert out.token_ids.dtype == jnp.int32 and out.top_ids.dtype == jnp.int32
    assert out.top_ids.shape == (s, k) and out.top_logprobs.shape == (s, k)
    ref = ref_log_softmax(ref_ban(ref_penalize(logits, prompt, output, presence, frequency, repetition), banned))
    tokens = np.asarray(out.token_ids)
    # Logprobs come from the penalized logits, before temperature and top-p.
    np.testing.assert_allclose(np.asarray(out.logprobs), ref[np.arange(s), tokens], rtol=1e-5, atol=1e-5)
    want_ids = np.argsort(-ref, axis=-1, kind="stable")[:, :k]
    np.testing.assert_array_equal(np.asarray(out.top_ids), want_ids)
    np.testing.assert_allclose(np.asarray(out.top_logprobs), np.take_along_axis(ref, want_ids, -1),
                               rtol=1e-5, atol=1e-5)
    for i in range(s):
        assert not set(banned[i][banned[i] >= 0]) & set(np.asarray(out.top_ids)[i])
        assert tokens[i] not in banned[i]
    # num_logprobs=0: empty top arrays, same tokens and logprobs.
    out0 = _sample(jnp.asarray(logits), make_meta(s, prompt=prompt, output=output, banned=banned,
                                                  temperature=temperature, top_p=0.9,
                                                  presence_penalty=presence, frequency_penalty=frequency,
                                                  repetition_penalty=repetition, seeds=meta.seeds))
    assert out0.top_ids.shape == (s, 0) and out0.top_logprobs.shape == (s, 0)
    np.testing.assert_array_equal(np.asarray(out0.token_ids), tokens)


def test_sampling_distributions_match_reference(rng):
    """Seven configurations x 2000 draws (one row per draw, distinct seeds) in one batched call."""
    v, n = 24, 2000
    configs = [  # temperature, top_k, top_p, min_p, banned, penalties
        dict(temperature=1.0),
        dict(temperature=rng.uniform(0.4, 0.7)),
        dict(temperature=rng.uniform(1.5, 2.0), top_k=int(rng.integers(3, 10))),
        dict(temperature=1.0, top_p=rng.uniform(0.5, 0.9)),
        dict(temperature=rng.uniform(1.0, 1.5), min_p=rng.uniform(0.05, 0.3)),
        dict(temperature=rng.uniform(0.8, 1.6), top_k=int(rng.integers(6, 16)), top_p=rng.uniform(0.6, 0.95),
             min_p=rng.uniform(0.01, 0.1)),
        dict(temperature=1.0, banned=True, penalties=True),
    ]
    s = n * len(configs)
    logits_c = [rng.normal(0, 1.5, v) for _ in configs]
    logits = np.repeat(np.stack(logits_c), n, axis=0).astype(np.float32)
    fields = {name: np.zeros(s) for name in ("temperature", "min_p", "presence_penalty", "frequency_penalty")}
    fields.update(top_k=np.full(s, -1), top_p=np.ones(s), repetition_penalty=np.ones(s))
    prompt = np.full((s, 4), -1, np.int32)
    output = np.full((s, 4), -1, np.int32)
    banned = np.full((s, 4), -1, np.int32)
    refs = []
    for c, (config, lg) in enumerate(zip(configs, logits_c)):
        rows = slice(c * n, (c + 1) * n)
        for name in ("temperature", "top_k", "top_p", "min_p"):
            if name in config:
                fields[name][rows] = config[name]
        ref_logits = lg[None]
        if config.get("penalties"):
            top = np.argsort(-lg)
            prompt[rows, :2] = top[:2]
            output[rows, :3] = [top[2], top[2], top[3]]
            fields["repetition_penalty"][rows] = 1.3
            fields["frequency_penalty"][rows] = 0.4
            fields["presence_penalty"][rows] = 0.2
            ref_logits = ref_penalize(ref_logits, prompt[rows][:1], output[rows][:1], [0.2], [0.4], [1.3])
        if config.get("banned"):
            banned[rows, :2] = np.argsort(-ref_logits[0])[:2]  # the two favourites are forbidden
            ref_logits = ref_ban(ref_logits, banned[rows][:1])
        refs.append(ref_distribution(ref_logits[0], fields["temperature"][c * n], fields["top_k"][c * n],
                                     fields["top_p"][c * n], fields["min_p"][c * n]))
    seeds = rng.choice(2**32, s, replace=False)
    meta = make_meta(s, prompt=prompt, output=output, banned=banned, seeds=seeds,
                     sample_index=rng.integers(0, 1000, s), **fields)
    tokens = np.asarray(_sample(jnp.asarray(logits), meta).token_ids)
    for c, config in enumerate(configs):
        check_draws(tokens[c * n:(c + 1) * n], refs[c], f"config {c} {config}")


def test_seeded_rows_do_not_depend_on_the_batch(rng):
    v = 500
    tracked = 12
    logits_t = rng.normal(0, 1, (tracked, v)).astype(np.float32)
    knobs = dict(temperature=rng.uniform(0.7, 1.5, tracked),
                 top_k=np.where(np.arange(tracked) % 3 == 0, 50, -1),
                 top_p=np.where(np.arange(tracked) % 3 == 1, 0.9, 1.0),
                 seeds=rng.integers(0, 2**32, tracked), seq_index=rng.integers(0, 8, tracked),
                 sample_index=rng.integers(0, 4096, tracked))

    def run(s, positions, others_random):
        logits = rng.normal(0, 1, (s, v)).astype(np.float32)
        logits[positions] = logits_t
        fields = dict(temperature=np.full(s, 1.0 if others_random else 0.0), top_k=np.full(s, -1),
                      top_p=np.where(rng.random(s) < 0.5, 0.5, 1.0), seeds=rng.integers(0, 2**32, s),
                      seq_index=rng.integers(0, 8, s), sample_index=rng.integers(0, 4096, s))
        for name, values in knobs.items():
            fields[name][positions] = values
        out = _sample(jnp.asarray(logits), make_meta(s, **fields))
        return np.asarray(out.token_ids)[positions], np.asarray(out.logprobs)[positions]

    a, lp_a = run(16, np.arange(tracked), False)  # others greedy: truncation only for tracked rows
    b, lp_b = run(32, rng.permutation(32)[:tracked], True)
    c, _ = run(16, rng.permutation(16)[:tracked], True)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    np.testing.assert_allclose(lp_a, lp_b, rtol=1e-6, atol=1e-6)


def test_counters_give_different_streams(rng):
    v, s = 1000, 64
    logits = jnp.zeros((s, v), jnp.float32)  # uniform: every token equally likely
    seed = int(rng.integers(0, 2**32))

    def draw(**counters):
        return np.asarray(_sample(logits, make_meta(s, temperature=1.0, seeds=seed, **counters)).token_ids)

    by_step = draw(sample_index=np.arange(s))
    by_seq = draw(seq_index=np.arange(s))
    swapped = draw(seq_index=np.arange(s), sample_index=1)
    swapped_back = draw(seq_index=1, sample_index=np.arange(s))
    for tokens in (by_step, by_seq):
        assert len(set(tokens.tolist())) > 45  # ~62 expected among 1000 equally likely tokens
    assert np.mean(by_step == by_seq) < 0.15
    assert np.mean(swapped == swapped_back) < 0.15  # (a, b) and (b, a) are different streams
    np.testing.assert_array_equal(draw(sample_index=np.arange(s)), by_step)  # and reproducible
    other_seeds = np.asarray(_sample(logits, make_meta(s, temperature=1.0, seeds=(seed + 1) % 2**32,
                                                       sample_index=np.arange(s))).token_ids)
    assert np.mean(other_seeds == by_step) < 0.15


def test_jit_does_not_retrace_for_new_values(rng):
    traces = []

    @jax.jit
    def step(logits, meta):
        traces.append(1)
        return sample(logits, meta)

    s, v = 8, 32
    for i in range(4):
        meta = make_meta(s, prompt=rng.integers(-1, v, (s, 4)), output=rng.integers(-1, v, (s, 4)),
                         banned=rng.integers(-1, v, (s, 2)), num_logprobs=3,
                         temperature=rng.uniform(0, 2, s) * (i % 2), top_k=rng.integers(-1, v + 2, s),
                         top_p=rng.uniform(0.1, 1, s), min_p=rng.uniform(0, 0.5, s),
                         presence_penalty=rng.uniform(-2, 2, s), frequency_penalty=rng.uniform(-2, 2, s),
                         repetition_penalty=rng.uniform(0.5, 2, s), seeds=rng.integers(0, 2**32, s),
                         seq_index=rng.integers(0, 9, s), sample_index=rng.integers(0, 999, s))
        step(jnp.asarray(rng.normal(0, 1, (s, v)), jnp.float32), meta).token_ids.block_until_ready()
    assert len(traces) == 1
    # Static fields are part of the compiled variant.
    meta = dataclasses.replace(meta, num_logprobs=2)
    step(jnp.zeros((s, v)), meta)
    assert len(traces) == 2


def test_builder_from_rows():
    sp = SamplingParams
    rows = [
        SamplingRow(sp(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, logprobs=3), seed=2**40 + 7, seq_index=1,
                    sample_index=9, prompt_token_ids=[1, 2, 3], output_token_ids=[4], banned_token_ids=[0, 2]),
        (sp(temperature=0.0), -1),  # a plain tuple; seed taken modulo 2**32
        SamplingRow(sp(repetition_penalty=1.2, frequency_penalty=0.5), seed=3, prompt_token_ids=list(range(20)),
                    output_token_ids=[7, 7]),
    ]
    meta = SamplingMetadata.from_rows(rows, 4, vocab_size=100)
    np.testing.assert_allclose(meta.temperature, [0.7, 0.0, 1.0, 0.0])
    np.testing.assert_array_equal(meta.top_k, [5, -1, -1, -1])
    np.testing.assert_allclose(meta.top_p, [0.9, 1.0, 1.0, 1.0])
    np.testing.assert_allclose(meta.min_p, [0.1, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(meta.repetition_penalty, [1.0, 1.0, 1.2, 1.0])
    np.testing.assert_allclose(meta.frequency_penalty, [0.0, 0.0, 0.5, 0.0])
    assert meta.seeds.dtype == np.uint32
    np.testing.assert_array_equal(meta.seeds, [7, 2**32 - 1, 3, 0])
    np.testing.assert_array_equal(meta.seq_index, [1, 0, 0, 0])
    np.testing.assert_array_equal(meta.sample_index, [9, 0, 0, 0])
    assert meta.do_penalties and meta.num_logprobs == 3
    # Only the penalised row carries tokens; widths are power-of-two buckets.
    assert meta.prompt_token_ids.shape == (4, 32) and meta.output_token_ids.shape == (4, 16)
    np.testing.assert_array_equal(meta.prompt_token_ids[2, :21], list(range(20)) + [-1])
    assert (meta.prompt_token_ids[[0, 1, 3]] == -1).all() and (meta.output_token_ids[[0, 1, 3]] == -1).all()
    np.testing.assert_array_equal(meta.output_token_ids[2, :3], [7, 7, -1])
    assert meta.banned_token_ids.shape == (4, 4)
    np.testing.assert_array_equal(meta.banned_token_ids[:2], [[0, 2, -1, -1], [-1, -1, -1, -1]])

    plain = SamplingMetadata.from_rows(rows[:2], 2, num_logprobs=0, banned_width=2)
    assert not plain.do_penalties and plain.num_logprobs == 0
    assert plain.prompt_token_ids.shape == (2, 0) and plain.banned_token_ids.shape == (2, 2)
    assert SamplingMetadata.from_rows(rows[:1], 1, vocab_size=2).num_logprobs == 2
    warm = SamplingMetadata.from_rows([], 8, num_logprobs=5, do_penalties=True, prompt_width=64,
                                      output_width=32, banned_width=4)
    assert warm.prompt_token_ids.shape == (8, 64) and (warm.temperature == 0).all()
    with pytest.raises(ValueError):
        SamplingMetadata.from_rows(rows, 2)
    with pytest.raises(ValueError):
        SamplingMetadata.from_rows(rows, 4, prompt_width=8)
    with pytest.raises(ValueError):
        SamplingMetadata.from_rows([(sp(), None)], 1)
    # The builder's output runs through the jitted sampler as is.
    out = _sample(jnp.zeros((4, 100)), meta)
    assert out.top_ids.shape == (4, 3)
    assert int(out.token_ids[1]) == 0  # greedy over equal logits: first index


def test_logit_bias_and_grammar_mask_match_reference(rng):
    """logit_bias is added after the bans, then the grammar's bitmask keeps only allowed tokens;
    greedy picks and logprobs follow the biased, masked logits (float64 reference)."""
    s, v = 6, 77
    logits = rng.normal(size=(s, v)).astype(np.float32) * 3
    bias_ids = np.full((s, 5), -1, np.int32)
    bias_values = np.zeros((s, 5), np.float32)
    allowed = rng.random((s, v)) < 0.3
    allowed[:, rng.integers(0, v)] = True  # at least one allowed token per row
    allowed[-1] = True  # a row without a grammar
    bitmask = np.zeros((s, -(-v // 32)), np.uint32)
    for i in range(s):
        for t in np.flatnonzero(allowed[i]):
            bitmask[i, t // 32] |= np.uint32(1 << (t % 32))
    ref = np.array(logits, np.float64)
    for i in range(s):
        ids = rng.choice(v, size=rng.integers(0, 6), replace=False)
        bias_ids[i, :len(ids)] = ids
        bias_values[i, :len(ids)] = rng.uniform(-100, 100, size=len(ids))
        ref[i, ids] += bias_values[i, :len(ids)]
    ref = np.where(allowed, ref, -np.inf)
    meta = make_meta(s, bias=(bias_ids, bias_values), bitmask=bitmask.view(np.int32), num_logprobs=3)
    out = _sample(jnp.asarray(logits), meta)
    np.testing.assert_array_equal(np.asarray(out.token_ids), np.argmax(ref, axis=-1))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.max(ref_log_softmax(ref), axis=-1), atol=1e-4)
    assert np.all(allowed[np.arange(s)[:, None], np.asarray(out.top_ids)] | ~np.isfinite(np.asarray(out.top_logprobs)))
    # Sampled rows never leave the grammar either.
    hot = make_meta(s, bias=(bias_ids, bias_values), bitmask=bitmask.view(np.int32), temperature=1.5,
                    seeds=rng.integers(0, 2**32, size=s))
    assert np.all(allowed[np.arange(s), np.asarray(_sample(jnp.asarray(logits), hot).token_ids)])


def test_target_logprobs_match_reference(rng):
    """A row's target token (prompt logprobs: the prompt's next token) gets its logprob under the
    row's processed distribution, wherever it ranks; rows without one report 0."""
    s, v = 5, 300
    logits = rng.normal(size=(s, v)).astype(np.float32) * 4
    targets = rng.integers(0, v, size=s)
    targets[2] = -1
    out = _sample(jnp.asarray(logits), make_meta(s, targets=targets))
    expected = np.take_along_axis(ref_log_softmax(logits), np.maximum(targets, 0)[:, None], axis=-1)[:, 0]
    expected[2] = 0.0
    np.testing.assert_allclose(np.asarray(out.target_logprobs), expected, atol=1e-4)
