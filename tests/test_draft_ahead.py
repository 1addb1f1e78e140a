"""The draft model drafts right after the target step that sampled (spec_decode/draft_ahead.py,
vLLM v1's order): a speculative step's schedule and dispatch read nothing from the device before
its target step launches, the drafts a step verifies are those computed after the step before,
each the draft model's own continuation of the sequence as it stands, and the outputs are those
without speculation, greedy and sampled, through preemption, aborts, max_model_len and failures."""

import numpy as np
import pytest

import hf_reference
import jpaged
from test_eagle_ahead import break_ahead_calls, generate, instrument
from test_spec_decode_draft import write_tiny

LIMITS = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks_override=128)


def seeded_rng():
    seed = int(np.random.default_rng().integers(2**32))  # (conftest's test_seed: the same each run, printed)
    print(f"seed {seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="module")
def short_draft(tmp_path_factory):
    """The tiny model cut to its first 2 layers: agrees with the whole model often, not always."""
    return write_tiny(tmp_path_factory.mktemp("draft_ahead") / "tiny-2-layers", num_layers=2)


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    """A random 2-layer Llama written by transformers' save_pretrained, and a 1-layer one."""
    root = tmp_path_factory.mktemp("draft_ahead_llama")
    return (hf_reference.save_random_llama(root / "two", 20261129, num_hidden_layers=2),
            hf_reference.save_random_llama(root / "one", 20261130, num_hidden_layers=1))


def spec(model, k=3, **extra):
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, **extra}


def random_batch(rng, n=5, sampled=False):
    prompts = [rng.integers(0, 256, int(m)).tolist() for m in rng.integers(2, 30, n)]
    params = [jpaged.SamplingParams(temperature=float(rng.uniform(0.5, 1.2)) if sampled else 0,
                                    top_p=float(rng.uniform(0.7, 1.0)) if sampled else 1.0,
                                    seed=int(rng.integers(2**31)) if sampled else None,
                                    max_tokens=int(rng.integers(5, 28)), ignore_eos=True) for _ in range(n)]
    return prompts, params


def record_drafts(llm) -> list:
    """From now on: each plan's drafts with the sequence's tokens then (tokens, drafts)."""
    scheduler, given = llm.llm_engine.scheduler, []
    set_drafts = scheduler.set_drafts

    def recording(plan, scheduled, tokens):
        given.append((list(scheduled.seqs[0].get_token_ids()), list(tokens)))
        return set_drafts(plan, scheduled, tokens)

    scheduler.set_drafts = recording
    return given


def reads_before_speculative_launches(events) -> tuple[int, list[int]]:
    """Steps that verified drafts, and each one's device reads between its schedule and its launch."""
    reads, found = None, []
    for event in events:
        if event[0] == "schedule":
            reads = 0
        elif event[0] == "read_device" and reads is not None:
            reads += 1
        elif event[0] == "launch":
            if event[1]:
                found.append(reads)
            reads = None
    return len(found), found


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_speculative_steps_launch_without_device_reads(short_draft, async_scheduling, shared_llm):
    rng = seeded_rng()
    prompts, params = random_batch(rng, 6)
    expected = generate(shared_llm("tiny", enforce_eager=True, **LIMITS), prompts, params)
    llm = jpaged.LLM("tiny", speculative_config=spec(short_draft), enforce_eager=True,
                     async_scheduling=async_scheduling, **LIMITS)
    events = instrument(llm)
    assert generate(llm, prompts, params) == expected
    stats = llm.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    speculative, reads = reads_before_speculative_launches(events)
    assert speculative > 10 and reads == [0] * speculative, reads
    # Each drafts run a plan takes is the one read with the step before it, computed after that
    # step's launch and before the next schedule.
    used = 0
    for i, event in enumerate(events):
        if event[0] != "drafts" or not event[2]:
            continue
        before = [e for e in events[:i] if e[0] in ("launch", "ahead", "ready", "schedule")]
        last_launch = max(j for j, e in enumerate(before) if e[0] == "launch")
        assert any(e[0] == "ahead" for e in before[last_launch:]), "no drafts dispatched after the last step"
        ready = next(e[1] for e in reversed(before) if e[0] == "ready")
        assert event[2] == ready[event[1]][1][:len(event[2])]
        used += 1
    assert used > 10


def test_drafts_are_the_draft_models_greedy_continuation(llamas, shared_llm):
    """A 1-layer Llama drafting for a 2-layer one (save_pretrained checkpoints), greedy: the
    outputs are the target's without speculation, and every drafts run is what the draft
    model itself continues the sequence with (a plain engine on the draft's checkpoint), the
    first decode after each prefill included."""
    target, draft = llamas
    rng = seeded_rng()
    prompts, params = random_batch(rng, 6)
    limits = dict(LIMITS, num_gpu_blocks_override=None)
    expected = generate(shared_llm(target, enforce_eager=True, **limits), prompts, params)
    llm = jpaged.LLM(target, speculative_config=spec(draft, k=4), enforce_eager=True, **limits)
    given = record_drafts(llm)
    assert generate(llm, prompts, params) == expected
    runs = [(tokens, drafts) for tokens, drafts in given if drafts]
    assert len(runs) > 10
    assert all(any(t[:len(p)] == p and len(t) == len(p) + 1 for t, _ in runs) for p in prompts)  # after the prefill
    assert len(runs) == len(given)  # every sequence the plan reserved drafts for took them
    reference = generate(shared_llm(draft, enforce_eager=True, **limits), [t for t, _ in runs],
                         [jpaged.SamplingParams(temperature=0, max_tokens=len(d), ignore_eos=True) for _, d in runs])
    assert [d for _, d in runs] == reference


@pytest.mark.parametrize("model", ["tiny", "llama"])
def test_a_model_as_its_own_draft_has_every_draft_accepted(model, llamas, shared_llm):
    """The target as its own draft, greedy and seeded top-p sampling: each draft row samples
    with the target row's key at the same output position (worked out on the device from the
    accepted count), so every draft is the target's own draw and is accepted."""
    path = llamas[0] if model == "llama" else "tiny"
    rng = seeded_rng()
    limits = dict(LIMITS, num_gpu_blocks_override=None)
    llm = jpaged.LLM(path, speculative_config=spec(path), enforce_eager=True, **limits)
    for sampled in (False, True):
        prompts, params = random_batch(rng, 6, sampled=sampled)
        expected = generate(shared_llm(path, enforce_eager=True, **limits), prompts, params)
        before = llm.stats()
        assert generate(llm, prompts, params) == expected, sampled
        after = llm.stats()
        drafted, accepted = (after[k] - before[k] for k in ("spec_decode_num_draft_tokens",
                                                            "spec_decode_num_accepted_tokens"))
        print(model, sampled, drafted, accepted)
        assert drafted > 30 and accepted == drafted


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_preemption(preemption_mode, shared_llm):
    """Few blocks: sequences are preempted and come back (swapped in, or prefilled again); the
    tiny model as its own draft: drafts are accepted all the same (their K/V in the draft's
    pages follow the blocks), and no speculative step reads the device before its launch."""
    rng = seeded_rng()
    shared = rng.integers(0, 256, 40).tolist()
    prompts = [shared + rng.integers(0, 256, int(n)).tolist() for n in rng.integers(2, 20, 6)]
    params = [jpaged.SamplingParams(temperature=0 if i % 2 else 1.0, seed=i, max_tokens=30, ignore_eos=True)
              for i in range(len(prompts))]
    limits = dict(LIMITS, num_gpu_blocks_override=14, block_size=8)
    expected = generate(shared_llm("tiny", enforce_eager=True, **dict(LIMITS, block_size=8)), prompts, params)
    llm = jpaged.LLM("tiny", speculative_config=spec("tiny"), enforce_eager=True, enable_prefix_caching=True,
                     preemption_mode=preemption_mode, **limits)
    events = instrument(llm)
    assert generate(llm, prompts, params) == expected
    stats = llm.stats()
    print(stats["num_preemptions"], {k: v for k, v in stats.items() if k.startswith("spec")})
    assert stats["num_preemptions"] > 0
    assert stats["spec_decode_num_draft_tokens"] > 50
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    speculative, reads = reads_before_speculative_launches(events)
    assert speculative > 10 and reads == [0] * speculative


def test_max_model_len_and_max_tokens(short_draft, shared_llm):
    """Sequences that run up to max_model_len (the drafts' last positions past the block table,
    scratch blocks crossing block boundaries: blocks of 8, k = 5) and ones stopped by
    max_tokens from 1 to k + 2: the outputs without speculation."""
    limits = dict(max_model_len=40, max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks_override=64,
                  block_size=8)
    rng = seeded_rng()
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in (7, 13, 3, 5, 9, 2, 4)]
    params = [jpaged.SamplingParams(temperature=0, max_tokens=40 - len(p), ignore_eos=True) for p in prompts[:2]]
    params += [jpaged.SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
               for i, n in enumerate((1, 2, 5, 6, 7))]
    expected = generate(shared_llm("tiny", enforce_eager=True, **limits), prompts, params)
    for draft in ("tiny", short_draft):
        llm = jpaged.LLM("tiny", speculative_config=spec(draft, k=5), enforce_eager=True, **limits)
        assert generate(llm, prompts, params) == expected, draft
        assert [len(e) for e in expected] == [p.max_tokens for p in params]
        stats = llm.stats()
        assert stats["spec_decode_num_draft_tokens"] > 0
        if draft == "tiny":
            assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]


def test_abort_mid_run(short_draft, shared_llm):
    """Requests aborted while the others speculate (their drafts computed after the last step
    are dropped): the others' outputs are those without speculation."""
    rng = seeded_rng()
    prompts, params = random_batch(rng, 6)
    params = [jpaged.SamplingParams(temperature=0, max_tokens=30, ignore_eos=True) for _ in prompts]
    expected = generate(shared_llm("tiny", enforce_eager=True, **LIMITS), prompts, params)
    llm = jpaged.LLM("tiny", speculative_config=spec(short_draft), enforce_eager=True, **LIMITS)
    engine = llm.llm_engine
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, sp)
    done, steps, aborted = {}, 0, {"1", "4"}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 5:
            for request_id in aborted:
                engine.abort_request(request_id)
    assert set(done) == {str(i) for i in range(len(prompts))} - aborted
    assert all(done[str(i)] == expected[i] for i in range(len(prompts)) if str(i) not in aborted)
    assert llm.stats()["spec_decode_num_draft_tokens"] > 0


def test_disable_by_batch_size(short_draft, shared_llm):
    """Steps of more sequences than disable_by_batch_size skip the draft's K/V forward and its
    drafts after them; once the batch thins out, drafting resumes (from the step after the
    first one back under the limit): the outputs without speculation."""
    rng = seeded_rng()
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(3, 20, 8)]
    params = [jpaged.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 6, 8, 10, 12, 24, 28, 32)]
    expected = generate(shared_llm("tiny", enforce_eager=True, **LIMITS), prompts, params)
    llm = jpaged.LLM("tiny", speculative_config=spec(short_draft, disable_by_batch_size=3), enforce_eager=True,
                     **LIMITS)
    events = instrument(llm)
    assert generate(llm, prompts, params) == expected
    assert llm.stats()["spec_decode_num_draft_tokens"] > 0
    speculative, reads = reads_before_speculative_launches(events)
    assert speculative > 5 and reads == [0] * speculative


def test_a_failing_call_leaves_the_next_step_without_drafts(shared_llm):
    """The drafts' device call fails to dispatch once, then its output fails to read once: each
    time the next step verifies no drafts (a warning), the outputs are those without speculation."""
    prompts = [[5, 6, 7, 8, 9], [100, 3, 4, 17]]
    sp = jpaged.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = generate(shared_llm("tiny", enforce_eager=True, **LIMITS), prompts, sp)
    llm = jpaged.LLM("tiny", speculative_config=spec("tiny"), enforce_eager=True, **LIMITS)
    given = break_ahead_calls(llm)
    assert generate(llm, prompts, sp) == expected
    after_failures = [tokens for n, tokens in given if n in (3, 5)]
    assert len(after_failures) >= 2 and not any(after_failures)  # after the failures: none
    assert all(tokens for n, tokens in given if n not in (3, 5))
    assert llm.stats()["spec_decode_num_accepted_tokens"] == llm.stats()["spec_decode_num_draft_tokens"] > 0


def test_scratch_blocks_and_executables(short_draft):
    """The draft's pool holds max_num_seqs * blocks_per_seq scratch blocks past the target's
    (scratch_bytes_per_device counts them), its warm-up keys hold the drafts' executables per
    decode bucket and no more the synchronous proposal loop, and its device operation is one
    the target's runner dispatches (multi-host: the followers run it)."""
    llm = jpaged.LLM("tiny", speculative_config=spec(short_draft, k=10), enforce_eager=True,
                     **dict(LIMITS, block_size=8))
    engine = llm.llm_engine
    proposer, target = engine.proposer, engine.runner
    draft = proposer.runner
    assert draft.blocks_per_seq == 3  # 10 positions from the end of a block of 8: 3 blocks
    assert proposer.scratch_blocks == 8 * 3 == draft.num_gpu_blocks - target.num_gpu_blocks
    assert draft.kv_cache.k_pages.shape[1] == draft.num_layers * (target.num_gpu_blocks + 24)
    assert proposer.scratch_bytes_per_device() == 24 * draft.kv_cache_spec.bytes_per_block
    from jpaged.spec_decode.draft_model import draft_keys
    keys = list(draft_keys(draft))
    assert [k for k in keys if k[0] == "draft_ahead"] == [("draft_ahead", s) for s in draft.buckets.decode_tokens]
    assert not [k for k in keys if k[0] in ("multi_step", "write_block_table")]
    assert {k[2] for k in keys if k[0] == "ahead_tokens"} == set(target.buckets.rows)
    assert "draft_ahead" in target.proposer.device_ops()
    ops = []
    dispatch_op = target.dispatch_op
    target.dispatch_op = lambda op, *args: ops.append(op) or dispatch_op(op, *args)
    generate(llm, [[1, 2, 3]], jpaged.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert ops.count("draft_ahead") > 2
