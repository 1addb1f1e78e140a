"""The EAGLE head drafts right after the target step that sampled (spec_decode/eagle_ahead.py,
vLLM v1's order): a speculative step's schedule and dispatch read nothing from the device
before its target step launches, the drafts a step verifies are those the chain dispatched with
the step before computed, and the outputs are those without speculation."""

import numpy as np
import pytest
import jax

import jpaged
from jpaged.models import tiny
from eagle3_head import write_head

LIMITS = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks_override=128)
SEED = 20261128


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return write_head(tmp_path_factory.mktemp("eagle_ahead") / "head", tiny.tiny_config())


def instrument(llm) -> list:
    """From now on, in order: `events` ("schedule", "read_device" (a step's output collected, or
    a device operation's result read to the host), "launch" (a target step's device call, with
    whether its plan verifies drafts), "ahead" (the head's chain dispatched), "drafts" (a plan
    given drafts: seq_id, tokens), "ready" (the drafts read with a step: seq_id -> (position,
    drafts)))."""
    engine = llm.llm_engine
    runner, scheduler, proposer = engine.runner, engine.scheduler, engine.runner.proposer
    events, current = [], {}

    class Counted:  # a device operation's result: reading it to the host is counted
        def __init__(self, value):
            self.value = value

        def __array__(self, dtype=None, copy=None):
            events.append(("read_device",))
            return np.asarray(self.value, dtype=dtype)

        def __getattr__(self, name):
            return getattr(self.value, name)

    dispatch_op, collect = runner.dispatch_op, runner.collect

    def dispatching(op, *args):
        out = dispatch_op(op, *args)
        return Counted(out) if isinstance(out, jax.Array) else out

    def collecting(handle):
        events.append(("read_device",))
        return collect(handle)

    runner.dispatch_op, runner.collect = dispatching, collecting
    schedule, execute, run_step = scheduler.schedule, runner.execute, runner._run_step
    set_drafts = scheduler.set_drafts
    run_ahead, read_ahead = getattr(proposer.runner, "run_ahead", None), getattr(proposer, "read_ahead", None)

    def scheduling(*args):
        events.append(("schedule",))
        return schedule(*args)

    def executing(plan, *args):
        current["drafts"] = any(s.spec_token_ids for s in plan.scheduled_seq_groups)
        return execute(plan, *args)

    def launching(*args):
        events.append(("launch", current["drafts"]))
        return run_step(*args)

    def drafting(plan, scheduled, tokens):
        events.append(("drafts", scheduled.seqs[0].seq_id, list(tokens)))
        return set_drafts(plan, scheduled, tokens)

    def chaining(*args):
        events.append(("ahead",))
        return run_ahead(*args)

    def reading(*args):
        read_ahead(*args)
        events.append(("ready", dict(proposer.ready)))

    scheduler.schedule, runner.execute, runner._run_step, scheduler.set_drafts = \
        scheduling, executing, launching, drafting
    if run_ahead is not None:
        proposer.runner.run_ahead, proposer.read_ahead = chaining, reading
    return events


def generate(llm, prompts, sp):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_speculative_steps_launch_without_device_reads_and_verify_the_last_steps_chain(
        head, async_scheduling, shared_llm):
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in (3, 9, 17, 30, 5)]
    params = [jpaged.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 12, 24, 7, 16)]
    expected = [generate(shared_llm("tiny", enforce_eager=True, **LIMITS), [p], sp)[0]
                for p, sp in zip(prompts, params)]
    llm = jpaged.LLM("tiny", speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3},
                     enforce_eager=True, async_scheduling=async_scheduling, **LIMITS)
    events = instrument(llm)
    assert generate(llm, prompts, params) == expected
    stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 30 and stats["spec_decode_num_accepted_tokens"] >= 0

    # Between each schedule and its target step's launch: no device read when the step verifies drafts.
    speculative, reads = 0, None
    for event in events:
        if event[0] == "schedule":
            reads = 0
        elif event[0] == "read_device" and reads is not None:
            reads += 1
        elif event[0] == "launch":
            if event[1]:
                speculative += 1
                assert reads == 0, f"a speculative step read the device {reads} times before its launch"
            reads = None
    assert speculative > 10

    # Each draft run a plan takes is the one read with the step before it, which its chain computed
    # (dispatched after that step's launch, before the next schedule).
    used = 0
    for i, event in enumerate(events):
        if event[0] != "drafts" or not event[2]:
            continue
        before = [e for e in events[:i] if e[0] in ("launch", "ahead", "ready", "schedule")]
        last_launch = max(j for j, e in enumerate(before) if e[0] == "launch")
        assert any(e[0] == "ahead" for e in before[last_launch:]), "no chain dispatched after the last step"
        ready = next(e[1] for e in reversed(before) if e[0] == "ready")
        assert event[2] == ready[event[1]][1][:len(event[2])]
        used += 1
    assert used > 10


def break_ahead_calls(llm, dispatch_fails: int = 3, read_fails: int = 5) -> list:
    """The proposer's device call after a step (run_ahead) fails to dispatch at its
    `dispatch_fails`-th call, and its output fails to read at its `read_fails`-th. Returns the
    drafts the scheduler is given from now on: (how many calls were made by then, the drafts)."""
    proposer, scheduler = llm.llm_engine.runner.proposer, llm.llm_engine.scheduler
    run_ahead, set_drafts, calls, given = proposer.runner.run_ahead, scheduler.set_drafts, [], []

    class Unreadable:
        def __array__(self, dtype=None, copy=None):
            raise RuntimeError("the drafts are lost")

    def failing(*args):
        calls.append(len(calls))
        if len(calls) == dispatch_fails:
            raise RuntimeError("the drafts failed to dispatch")
        out = run_ahead(*args)
        return Unreadable() if len(calls) == read_fails else out

    def recording(plan, scheduled, tokens):
        given.append((len(calls), list(tokens)))
        return set_drafts(plan, scheduled, tokens)

    proposer.runner.run_ahead, scheduler.set_drafts = failing, recording
    return given


def test_a_failing_chain_leaves_the_next_step_without_drafts(head, shared_llm):
    """The head's chain fails to dispatch once, then its output fails to read once: each time the
    next step verifies no drafts (a warning), the outputs are those without speculation."""
    prompts = [[5, 6, 7, 8, 9], [100, 3, 4, 17]]
    sp = jpaged.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = generate(shared_llm("tiny", enforce_eager=True, **LIMITS), prompts, sp)
    llm = jpaged.LLM("tiny", speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3},
                     enforce_eager=True, **LIMITS)
    given = break_ahead_calls(llm)
    assert generate(llm, prompts, sp) == expected
    assert all(not tokens for n, tokens in given if n in (3, 5))  # after the failures: none
    assert any(tokens for n, tokens in given if n not in (3, 5))
    assert llm.stats()["spec_decode_num_draft_tokens"] > 0


def test_drafts_up_to_max_model_len(head, shared_llm):
    """Sequences that run up to max_model_len (the chain's last positions past the block table,
    its scratch blocks crossing block boundaries: blocks of 8): the outputs without speculation."""
    limits = dict(max_model_len=40, max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks_override=64,
                  block_size=8)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [100, 3, 4, 17, 29, 31, 2, 2, 9, 44, 45, 46, 47]]
    sp = [jpaged.SamplingParams(temperature=0, max_tokens=40 - len(p), ignore_eos=True) for p in prompts]
    expected = generate(shared_llm("tiny", enforce_eager=True, **limits), prompts, sp)
    llm = jpaged.LLM("tiny", speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 4},
                     enforce_eager=True, **limits)
    assert generate(llm, prompts, sp) == expected
    assert [len(e) for e in expected] == [40 - len(p) for p in prompts]
    assert llm.stats()["spec_decode_num_draft_tokens"] > 0
