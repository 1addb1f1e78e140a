"""The steady decode lane (jpaged/core/decode_lane.py, the runner's StepBuilder._build_lane): a
step that repeats the last one's decode is scheduled from arrays, applied by the runner as a
diff, dispatched and read back with the rows' stop checks as arrays (Scheduler._update_lane). It must change nothing: the same tokens, logprobs, finish and stop reasons as every step
the general way (Scheduler.use_lane False), over seeded random workloads with stop tokens hit
midway, EOS, max_tokens, min_tokens, logprobs, seeded sampling, requests arriving mid-run,
preemption (recompute and swap), prefix caching, with and without overlap.
Seeded: conftest's seed (printed), or JPAGED_TEST_SEED."""

import numpy as np
import pytest

import jpaged
from jpaged.sampling_params import SamplingParams
from test_engine import assert_all_blocks_free

LIMITS = dict(max_model_len=96, max_num_seqs=12, max_num_batched_tokens=64, block_size=8, enforce_eager=True)


def _run(llm, requests, use_lane: bool, arrive_every: int = 3) -> tuple[dict, list]:
    """Each request's final (token ids, cumulative logprob, logprobs, finish reason, stop
    reason, cached prompt tokens), and each plan's lane step (None: no lane). Requests come in over the first steps;
    the lane's assumptions are checked after every step."""
    engine = llm.llm_engine
    sched = engine.scheduler
    sched.use_lane, lane_steps, schedule = use_lane, [], sched.schedule

    def recording(*args, **kwargs):
        plan = schedule(*args, **kwargs)
        lane_steps.append(None if plan.lane is None else plan.lane.step)
        return plan

    sched.schedule = recording
    llm.reset_prefix_cache()  # (each run finds what it caches itself)
    results, pending, step = {}, list(enumerate(requests)), 0
    try:
        while pending or engine.has_unfinished_requests():
            while pending and (step % arrive_every == 0 or not engine.has_unfinished_requests()):
                i, (prompt, sp) = pending.pop(0)
                engine.add_request(f"r{i}", prompt, sp)
                if len(pending) % 2:
                    break
            for out in engine.step():
                c = out.outputs[0]
                if out.finished:
                    results[out.request_id] = (list(c.token_ids), c.cumulative_logprob, c.logprobs,
                                               c.finish_reason, c.stop_reason, out.num_cached_tokens)
            if sched.lane is not None:
                sched.lane.check(engine.block_manager)
            step += 1
    finally:
        del sched.schedule
        sched.use_lane = True
    assert_all_blocks_free(llm)
    return results, lane_steps


def _requests(rng: np.random.Generator, reference: dict | None, n: int = 20) -> list:
    requests, shared = [], rng.integers(3, 250, 20).tolist()
    for i in range(n):
        prompt = rng.integers(3, 250, int(rng.integers(2, 30))).tolist()
        if i % 4 == 1:  # a shared prefix: later ones find its blocks in the prefix cache
            prompt = shared + prompt
        kwargs = dict(temperature=0.0, max_tokens=int(rng.integers(1, 48)), ignore_eos=bool(i % 3))
        kind = i % 5
        if kind == 1:
            kwargs.update(temperature=0.9, top_p=0.9, seed=int(rng.integers(1 << 30)))
        elif kind == 2:
            kwargs.update(logprobs=2)
        elif kind == 3 and reference is not None and len(reference[f"r{i}"][0]) > 2:
            tokens = reference[f"r{i}"][0]  # a stop token the request meets midway
            kwargs.update(stop_token_ids=[tokens[int(rng.integers(1, len(tokens)))]])
        elif kind == 4:
            kwargs.update(min_tokens=min(int(rng.integers(0, 8)), kwargs["max_tokens"]))
        requests.append((prompt, SamplingParams(**kwargs)))
    return requests


def _compare(llm, seed: int):
    """Lane on against lane off, the same requests twice (a first run draws the stop tokens)."""
    rng = np.random.default_rng(seed)
    print(f"workload seed {seed}")
    reference, _ = _run(llm, _requests(np.random.default_rng(seed), None), use_lane=False)
    llm.llm_engine.scheduler.stop_checker.eos_token_id = max(  # a frequent token: some requests end on EOS
        {t for toks, *_ in reference.values() for t in toks}, key=lambda t: sum(toks.count(t) for toks, *_ in
                                                                                  reference.values()))
    requests = _requests(rng, reference)
    general, none = _run(llm, requests, use_lane=False)
    lane, steps = _run(llm, requests, use_lane=True)
    assert all(s is None for s in none)
    assert sum(1 for s in steps if s) >= 5, steps  # the lane ran
    assert set(general) == set(lane) == {f"r{i}" for i in range(len(requests))}
    for rid in general:
        assert lane[rid] == general[rid], (rid, lane[rid], general[rid])
    reasons = {r[3] for r in general.values()}
    assert "length" in reasons and "stop" in reasons, reasons
    return steps, general


@pytest.mark.parametrize("async_scheduling,prefix_caching", [(True, False), (False, True), (True, True)])
def test_lane_equals_general_path(async_scheduling, prefix_caching, test_seed):
    llm = jpaged.LLM("tiny", num_gpu_blocks_override=200, async_scheduling=async_scheduling,
                     enable_prefix_caching=prefix_caching, **LIMITS)
    for k in range(2):
        _, general = _compare(llm, test_seed + k)
        if prefix_caching:  # the lane's blocks were found
            assert any(r[5] for r in general.values())


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_lane_under_preemption(preemption_mode, test_seed):
    """A pool too small for every running sequence: lanes break when blocks run out (the general
    path preempts) and form again."""
    llm = jpaged.LLM("tiny", num_gpu_blocks_override=40, preemption_mode=preemption_mode, **LIMITS)
    _compare(llm, test_seed)
    assert llm.stats()["num_preemptions"] > 0


def test_lane_steps_reuse_runner_arrays(test_seed):
    """Once formed, a lane continues step after step (finished requests dropped from it), and
    the runner applies each step as a diff of its arrays."""
    llm = jpaged.LLM("tiny", num_gpu_blocks_override=200, **LIMITS)
    builder, built = llm.llm_engine.runner.step_builder, []
    build_lane = builder._build_lane

    def recording(plan, lane, cache):
        built.append((lane.step, cache.step))
        return build_lane(plan, lane, cache)

    builder._build_lane = recording
    sched, updates = llm.llm_engine.scheduler, []
    update_lane = sched._update_lane

    def recording_update(lane, out):
        updates.append(lane.step)
        return update_lane(lane, out)

    sched._update_lane = recording_update
    steps, _ = _compare(llm, test_seed)
    assert built and all(step == previous + 1 for step, previous in built)
    assert max(s or 0 for s in steps) >= 3
    assert len(updates) >= len(built) // 2  # the lane's steps were read whole (update_from_output's fast path)
