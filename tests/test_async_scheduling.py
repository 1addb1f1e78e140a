"""Overlapped steps (async_scheduling): the next step is dispatched before the last one's sampled
ids are read (the default). Outputs must be those of the synchronous engine, stops and limits
exact, aborts and preemption safe while a step is in flight, and no block leaked. What used to
refuse the overlap is corrected a step late: a sequence ending with its pending token, a block
it fills under prefix caching (hashed once read), requests waiting while no seat is free."""

import numpy as np
import pytest

import jpaged
from test_engine import assert_all_blocks_free, assert_same_greedy

LIMITS = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, block_size=16, enforce_eager=True)


@pytest.fixture(scope="module")
def engines():
    return (jpaged.LLM("tiny", num_gpu_blocks_override=80, async_scheduling=False, **LIMITS),
            jpaged.LLM("tiny", num_gpu_blocks_override=80, **LIMITS))  # (on by default)


def generate_counting_overlaps(llm, prompts, params):
    """llm.generate, stepping by hand: also how many steps left a step in flight."""
    engine = llm.llm_engine
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, sp)
    finals, overlapped = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        overlapped += engine._in_flight is not None
    engine.step()  # a step still in flight only carries tokens of finished requests
    return [finals[str(i)] for i in range(len(prompts))], overlapped


def test_outputs_match_the_synchronous_engine(engines):
    sync, overlap = engines
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 256, size=rng.integers(2, 40)).tolist() for _ in range(12)]
    kinds = [
        dict(temperature=0, max_tokens=int(rng.integers(1, 30)), ignore_eos=True, logprobs=1),
        dict(temperature=0, max_tokens=40, stop=["e", "a"], min_tokens=int(rng.integers(0, 5)), logprobs=1),
        dict(temperature=0, max_tokens=40, stop_token_ids=[int(t) for t in rng.integers(32, 120, 6)], logprobs=1),
        dict(temperature=1.0, seed=int(rng.integers(1 << 30)), max_tokens=25, ignore_eos=True, logprobs=1),
        dict(temperature=0, max_tokens=30, logprobs=1),  # EOS allowed
        # Two sequences: one may stop while the other goes on.
        dict(n=2, temperature=1.0, seed=int(rng.integers(1 << 30)), max_tokens=30, stop=["e"], logprobs=1),
    ]
    params = [jpaged.SamplingParams(**kinds[i % len(kinds)]) for i in range(len(prompts))]
    reference, _ = generate_counting_overlaps(sync, prompts, params)
    outs, overlapped = generate_counting_overlaps(overlap, prompts, params)
    assert overlapped > 10  # the overlap did happen
    assert_same_greedy(reference, outs)
    for ref, out, sp in zip(reference, outs, params):
        assert len(out.outputs) == len(ref.outputs)
        for a, b in zip(ref.outputs, out.outputs):
            assert len(b.token_ids) <= sp.max_tokens
            if a.token_ids == b.token_ids:  # (a near-tie may diverge; then the rest is moot)
                assert (b.text, b.finish_reason, b.stop_reason) == (a.text, a.finish_reason, a.stop_reason)
                assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-3)
    # Both sequences of the n=2 requests, in full (sampling is seeded, so it does not depend on the batch).
    assert_same_greedy([r for r, sp in zip(reference, params) if sp.n == 2],
                       [o for o, sp in zip(outs, params) if sp.n == 2])
    assert sorted(len(c.token_ids) for o in outs for c in o.outputs) == \
        sorted(len(c.token_ids) for o in reference for c in o.outputs)
    assert_all_blocks_free(overlap)


def test_penalties_overlap_and_match_the_synchronous_engine(engines):
    """Penalised requests no longer stop the overlap: the sampler appends each sampled token to
    the sequence's device token history, and the next step's penalties read it there (the host
    has not seen it yet). Tokens and logprobs equal the synchronous engine's."""
    sync, overlap = engines
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 64, size=rng.integers(4, 40)).tolist() for _ in range(10)]  # repeats: penalties bite
    params = [jpaged.SamplingParams(
        temperature=0, max_tokens=int(rng.integers(5, 40)), ignore_eos=True, logprobs=1,
        repetition_penalty=float(rng.choice([1.0, 1.5, 0.6])), presence_penalty=float(rng.choice([0.0, 1.0, -0.5])),
        frequency_penalty=float(rng.choice([0.0, 0.7]))) for _ in prompts]
    reference, _ = generate_counting_overlaps(sync, prompts, params)
    outs, overlapped = generate_counting_overlaps(overlap, prompts, params)
    assert overlapped > 10  # the overlap did happen, with penalties in every step
    for ref, out in zip(reference, outs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].cumulative_logprob == pytest.approx(ref.outputs[0].cumulative_logprob, abs=1e-4)
    assert_all_blocks_free(overlap)


def test_max_tokens_one_and_limits_while_in_flight(engines):
    _, overlap = engines
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 256, size=int(rng.integers(2, 20))).tolist() for _ in range(6)]
    # max_tokens 1 and 2 end while a step is in flight; the last request hits max_model_len.
    max_tokens = [1, 2, 3, 17, 30, 128 - len(prompts[5])]
    params = [jpaged.SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs, _ = generate_counting_overlaps(overlap, prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == max_tokens
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert_all_blocks_free(overlap)


def test_abort_while_a_step_is_in_flight(engines):
    _, overlap = engines
    engine = overlap.llm_engine
    rng = np.random.default_rng()
    params = jpaged.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"a{i}", rng.integers(0, 256, size=10).tolist(), params)
    seen = {}
    while engine._in_flight is None:
        for out in engine.step():
            seen[out.request_id] = len(out.outputs[0].token_ids)
    engine.abort_request("a1")
    for _ in range(3):
        for out in engine.step():
            assert out.request_id != "a1"  # nothing after the abort, not even the step in flight
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != "a1"
    engine.step()
    assert_all_blocks_free(overlap)


def test_preemption_and_swaps_with_async_scheduling():
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 256, size=int(rng.integers(20, 60))).tolist() for _ in range(8)]
    params = jpaged.SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=1)
    results = []
    for mode in ("recompute", "swap"):
        for async_scheduling in (False, True):
            llm = jpaged.LLM("tiny", num_gpu_blocks_override=14, preemption_mode=mode, swap_space=0.05,
                             async_scheduling=async_scheduling, **LIMITS)
            outs, overlapped = generate_counting_overlaps(llm, prompts, [params] * len(prompts))
            assert llm.stats()["num_preemptions"] > 0
            assert_all_blocks_free(llm)
            results.append((outs, overlapped))
    for (reference, _), (outs, overlapped) in (results[:2], results[2:]):
        assert overlapped > 0
        assert_same_greedy(reference, outs)


def overlaps_by_reason(llm, prompts, params):
    """generate_counting_overlaps, also counting the overlapped steps whose in-flight pending token
    fills a block (prefix caching used to refuse those) and those with requests waiting."""
    engine = llm.llm_engine
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, sp)
    finals, counts = {}, {"overlapped": 0, "block_filled": 0, "waiting": 0, "admitted": 0}
    bs = engine.scheduler.block_manager.block_size
    schedule = engine.scheduler.schedule

    def scheduling(*args, **kwargs):  # counts the plans made behind a step in flight that admit a request
        waiting = {g.request_id for g in engine.scheduler.waiting}
        behind = any(seq.num_pending_tokens for g in engine.scheduler.running for seq in g.seqs)  # (tokens unread)
        plan = schedule(*args, **kwargs)
        counts["admitted"] += behind and any(s.seq_group.request_id in waiting for s in plan.scheduled_seq_groups)
        return plan

    engine.scheduler.schedule = scheduling
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if engine._in_flight is not None:
            counts["overlapped"] += 1
            seqs = [seq for g in engine.scheduler.running for seq in g.seqs if seq.num_pending_tokens]
            counts["block_filled"] += any(seq.get_len() % bs == 0 for seq in seqs)
            counts["waiting"] += bool(engine.scheduler.waiting)
    engine.step()
    return [finals[str(i)] for i in range(len(prompts))], counts


def test_prefix_caching_hashes_a_block_filled_by_a_pending_token_once_read():
    """With prefix caching, steps overlap also when a pending token fills a block: the block is
    hashed when the token is read, with the token in its hash. A later request that shares the
    first request's prompt and output finds the blocks the synchronous engine cached, and one
    more: the first request's last token fills its 4th block, and the step in flight when it was
    read computed that token's K/V (the synchronous engine never computes it). Outputs equal the
    synchronous engine's."""
    seed = 20261128
    print("seed", seed)
    rng = np.random.default_rng(seed)
    first, extra = rng.integers(0, 256, size=21).tolist(), rng.integers(0, 256, size=5).tolist()
    params = jpaged.SamplingParams(temperature=0, max_tokens=43, ignore_eos=True)
    results = []
    for async_scheduling in (False, True):
        llm = jpaged.LLM("tiny", num_gpu_blocks_override=80, enable_prefix_caching=True,
                         async_scheduling=async_scheduling, **LIMITS)
        (a,), counts = overlaps_by_reason(llm, [first], [params])
        # 21 + 43 tokens: synchronously the last output token gets no K/V (63 computed: 3 full
        # blocks); overlapped, the step in flight when it is read computes it (4 blocks).
        second = first + list(a.outputs[0].token_ids) + extra
        (b,), _ = overlaps_by_reason(llm, [second], [jpaged.SamplingParams(temperature=0, max_tokens=8,
                                                                             ignore_eos=True)])
        results.append((a, b, counts))
        assert_all_blocks_free(llm)
    (ref_a, ref_b, sync_counts), (a, b, counts) = results
    assert sync_counts["overlapped"] == 0 and counts["block_filled"] >= 2  # blocks 2 and 3 filled in flight
    assert a.outputs[0].token_ids == ref_a.outputs[0].token_ids
    assert b.outputs[0].token_ids == ref_b.outputs[0].token_ids
    assert (ref_b.num_cached_tokens, b.num_cached_tokens) == (48, 64)


def test_requests_waiting_for_a_seat_do_not_stop_the_overlap():
    """More requests than max_num_seqs: steps overlap while requests wait, and a step scheduled
    behind one in flight admits the next request as soon as a seat is free (its prefill needs no
    token of the step in flight; the scheduler admits after the running decodes, so an admission
    never preempts). Outputs equal the synchronous engine's."""
    seed = 20261129
    print("seed", seed)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 256, size=int(rng.integers(4, 30))).tolist() for _ in range(20)]
    params = [jpaged.SamplingParams(temperature=0, max_tokens=int(rng.integers(3, 40)), ignore_eos=True)
              for _ in prompts]
    runs = []
    for async_scheduling in (False, True):
        llm = jpaged.LLM("tiny", num_gpu_blocks_override=80, async_scheduling=async_scheduling, **LIMITS)
        outs, counts = overlaps_by_reason(llm, prompts, params)
        assert_all_blocks_free(llm)
        runs.append((outs, counts))
    (reference, _), (outs, counts) = runs
    print(counts)
    assert counts["waiting"] > 10 and counts["admitted"] > 5
    assert_same_greedy(reference, outs)
    assert [len(o.outputs[0].token_ids) for o in outs] == [sp.max_tokens for sp in params]


@pytest.mark.parametrize("model", ["tiny", "llama"])
def test_a_long_prompts_next_chunk_is_scheduled_behind_the_one_in_flight(model, test_seed, tmp_path):
    """Prompts longer than a step's token budget are prefilled in chunks; a chunk's tokens are the
    host's, so the next one is scheduled while the last is in flight (with blocks for it kept
    free: no preemption), also for a lone prompt with nothing decoding. Outputs equal the
    synchronous engine's; no block leaked. On `tiny` and on a Llama made by save_pretrained."""
    from test_kv_pool_size import _random_llama

    path = "tiny" if model == "tiny" else _random_llama(tmp_path / "llama", test_seed)
    rng = np.random.default_rng(test_seed)
    prompts = [rng.integers(0, 256, size=int(n)).tolist() for n in (150, 5, 90, 200, 12, 130)]
    params = [jpaged.SamplingParams(temperature=0, max_tokens=int(rng.integers(3, 20)), ignore_eos=True, logprobs=1,
                                    prompt_logprobs=2 if i == 3 else None)  # (its chunks wait for the read)
              for i in range(len(prompts))]
    limits = dict(LIMITS, max_model_len=256, max_num_batched_tokens=32)
    runs = []
    for async_scheduling in (False, True):
        llm = jpaged.LLM(path, num_gpu_blocks_override=120, async_scheduling=async_scheduling, **limits)
        engine = llm.llm_engine
        events = {"dispatched": 0, "completed": 0, "chunks_behind": 0}
        dispatch, complete, schedule = engine._dispatch, engine._complete, engine.scheduler.schedule

        def dispatching(*args, _f=dispatch, _e=events):
            _e["dispatched"] += 1
            return _f(*args)

        def completing(*args, _f=complete, _e=events):
            _e["completed"] += 1
            return _f(*args)

        def scheduling(*args, _f=schedule, _e=events, _engine=engine, **kwargs):
            prefilling = {g.request_id for g in _engine.scheduler.running if g.is_prefill()}
            plan = _f(*args, **kwargs)
            _e["chunks_behind"] += _e["dispatched"] > _e["completed"] and any(
                s.seq_group.request_id in prefilling for s in plan.scheduled_seq_groups)
            return plan

        engine._dispatch, engine._complete, engine.scheduler.schedule = dispatching, completing, scheduling
        first = llm.generate(prompts[:1], params[:1], use_tqdm=False)  # a lone prompt: only its chunks run
        lone_behind = events["chunks_behind"]
        outs = first + llm.generate(prompts[1:], params[1:], use_tqdm=False)
        assert_all_blocks_free(llm)
        runs.append((outs, lone_behind, events["chunks_behind"]))
    (reference, _, _), (outs, lone_behind, behind) = runs
    print("chunks scheduled behind a step in flight: lone prompt", lone_behind, "all", behind)
    assert lone_behind >= 3 and behind > lone_behind
    assert_same_greedy(reference, outs)
    for ref, out in zip(reference, outs):
        assert out.outputs[0].cumulative_logprob == pytest.approx(ref.outputs[0].cumulative_logprob, abs=1e-3)
        assert (out.prompt_logprobs is None) == (ref.prompt_logprobs is None)
    assert len(outs[3].prompt_logprobs) == len(prompts[3])
    for ours, theirs in zip(outs[3].prompt_logprobs[1:], reference[3].prompt_logprobs[1:]):
        assert ours.keys() == theirs.keys() and all(abs(ours[t] - theirs[t]) < 1e-4 for t in ours)
