"""Multi-step decode (num_scheduler_steps = K): K decode steps in one device call. Outputs must be
those of single steps, whatever the stops and limits (K larger than the tokens left), with
forks sharing blocks, prefix caching and preemption; and no block leaked."""

import numpy as np
import pytest

import jpaged
from test_engine import assert_all_blocks_free

LIMITS = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, block_size=16, enforce_eager=True)
# Exact equality across differently compiled steps: a near-tie could flip on rounding, so the
# random workloads are seeded (deterministic, as XLA's CPU results are for the same shapes).
SEED = 20261123


def generate_counting_multi_steps(llm, prompts, params):
    """llm.generate, also counting the multi-step decodes the runner ran."""
    runner = llm.llm_engine.runner
    dispatch, count = runner.dispatch, [0]

    def counting(batch, multi_step=False, *rest):
        count[0] += multi_step
        return dispatch(batch, multi_step, *rest)

    runner.dispatch = counting
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del runner.dispatch
    return outs, count[0]


def assert_same_outputs(reference, outs):
    for ref, out in zip(reference, outs):
        assert len(out.outputs) == len(ref.outputs)
        for a, b in zip(ref.outputs, out.outputs):
            assert b.token_ids == a.token_ids
            assert (b.text, b.finish_reason, b.stop_reason) == (a.text, a.finish_reason, a.stop_reason)
            assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-3)


def random_workload(rng, num_requests):
    prompts = [rng.integers(0, 256, size=rng.integers(1, 40)).tolist() for _ in range(num_requests)]
    kinds = [
        dict(temperature=0, max_tokens=int(rng.integers(1, 12)), ignore_eos=True),  # often fewer than K left
        dict(temperature=0, max_tokens=40, stop=["e", "a"]),
        dict(temperature=0, max_tokens=40, stop_token_ids=[int(t) for t in rng.integers(32, 120, 6)]),
        dict(temperature=1.0, top_k=20, top_p=0.9, seed=int(rng.integers(1 << 30)), max_tokens=25, ignore_eos=True),
        dict(temperature=0, max_tokens=30, min_tokens=int(rng.integers(1, 12))),  # single steps until reached
        # Two sequences sharing their prompt's blocks: the lookahead slots copy the shared one.
        dict(n=2, temperature=0.8, seed=int(rng.integers(1 << 30)), max_tokens=30, stop=["e"]),
        dict(temperature=0, ignore_eos=True),  # runs into max_model_len (K-1 before it: single steps)
    ]
    kinds = [kinds[i % len(kinds)] for i in range(num_requests)]
    return prompts, [jpaged.SamplingParams(**{"max_tokens": LIMITS["max_model_len"] - len(prompt), **kind})
                     for prompt, kind in zip(prompts, kinds)]


@pytest.mark.parametrize("num_steps", [3, 8])
def test_outputs_match_single_steps(num_steps):
    rng = np.random.default_rng(SEED + 0)
    prompts, params = random_workload(rng, 14)
    single = jpaged.LLM("tiny", num_gpu_blocks_override=80, **LIMITS)
    multi = jpaged.LLM("tiny", num_gpu_blocks_override=80, num_scheduler_steps=num_steps, **LIMITS)
    reference, none = generate_counting_multi_steps(single, prompts, params)
    outs, count = generate_counting_multi_steps(multi, prompts, params)
    assert none == 0 and count > 5  # multi-step did run
    assert_same_outputs(reference, outs)
    for out, sp in zip(outs, params):
        assert all(len(c.token_ids) <= sp.max_tokens for c in out.outputs)
    assert_all_blocks_free(multi)


def test_prefix_caching_and_preemption():
    """A small pool: multi-step takes lookahead blocks only when they are free, else the step is
    a single one (which may preempt); cached prefixes are found as with single steps."""
    rng = np.random.default_rng(SEED + 1)
    shared = rng.integers(0, 256, size=40).tolist()
    prompts = [shared + rng.integers(0, 256, size=rng.integers(1, 30)).tolist() for _ in range(10)]
    params = jpaged.SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    results = []
    for mode in ("recompute", "swap"):
        for num_steps in (1, 4):
            llm = jpaged.LLM("tiny", num_gpu_blocks_override=20, preemption_mode=mode, swap_space=0.05,
                             enable_prefix_caching=True, num_scheduler_steps=num_steps, **LIMITS)
            outs, count = generate_counting_multi_steps(llm, prompts, [params] * len(prompts))
            stats = llm.stats()
            assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
            assert (count > 0) == (num_steps > 1)
            assert_all_blocks_free(llm)
            results.append(outs)
    assert_same_outputs(results[0], results[1])
    assert_same_outputs(results[2], results[3])


def test_abort_between_multi_steps():
    llm = jpaged.LLM("tiny", num_gpu_blocks_override=80, num_scheduler_steps=4, **LIMITS)
    engine = llm.llm_engine
    rng = np.random.default_rng(SEED + 2)
    params = jpaged.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"a{i}", rng.integers(0, 256, size=10).tolist(), params)
    engine.step()  # the prefill
    lengths = {o.request_id: len(o.outputs[0].token_ids) for o in engine.step()}
    assert set(lengths.values()) == {5}  # 1 + a multi-step of 4
    engine.abort_request("a1")
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != "a1"
            assert len(out.outputs[0].token_ids) <= 40
    assert_all_blocks_free(llm)


def test_num_scheduler_steps_is_checked():
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        jpaged.LLM("tiny", num_scheduler_steps=0)
