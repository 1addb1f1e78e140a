"""Structured output under async scheduling (runner/deferred_sample.py): a grammar request no
longer stops the overlap. With a step in flight, the next step's forward is dispatched at once;
the engine reads the step in flight, the matchers take its tokens, and only then are the grammar
rows' masks made and the next step's sampler dispatched. Outputs (greedy) must be those of the
synchronous engine, a grammar that ends (or must end) with the token just read drops the extra
token computed for it, and failures and aborts in between fail their request alone."""

import json
import re

import numpy as np
import pytest

import jpaged
from jpaged.engine.llm_engine import StepFailedError
from jpaged.runner.deferred_sample import DeferredSample
from test_engine import assert_all_blocks_free

LIMITS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, block_size=16, enforce_eager=True)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                                           "ok": {"type": "boolean"}}, "required": ["name", "ok"]}
REGEX = r"[0-9]{3}-[a-z]{2,4}"


def seeded_rng():
    seed = int(np.random.default_rng().integers(2**32))  # (conftest's test_seed: the same each run, printed)
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def mixed_batch(rng, n: int = 8):
    """Greedy json_schema / regex / choice requests beside plain ones (and a sampled, seeded one)."""
    kinds = [lambda: dict(guided_json=SCHEMA, max_tokens=80),
             lambda: dict(max_tokens=int(rng.integers(10, 40)), ignore_eos=True, logprobs=1),
             lambda: dict(guided_choice=["yes", "no", "not sure"], max_tokens=20),
             lambda: dict(guided_regex=REGEX, max_tokens=30),
             lambda: dict(guided_json={"type": "object"}, max_tokens=int(rng.integers(4, 12))),  # ends at max_tokens
             lambda: dict(max_tokens=30, presence_penalty=0.5),
             lambda: dict(guided_regex=REGEX, max_tokens=30, temperature=1.0, seed=int(rng.integers(2**31))),
             lambda: dict(guided_json=SCHEMA, max_tokens=60, repetition_penalty=1.3, logprobs=2),
             lambda: dict(guided_choice=["yes", "no", "not sure"], max_tokens=20, n=2, temperature=1.0,
                          seed=int(rng.integers(2**31)))]  # forks: the child's matcher copied from its parent's
    prompts = [rng.integers(0, 256, size=int(rng.integers(3, 40))).tolist() for _ in range(n)]
    params = [jpaged.SamplingParams(**{"temperature": 0, **kinds[i % len(kinds)]()}) for i in range(n)]
    return prompts, params


def run(llm, prompts, params, on_step=None):
    """Step by hand: the final outputs, how many calls left a step in flight, the failures."""
    engine = llm.llm_engine
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, sp)
    finals, overlapped, failed, calls = {}, 0, {}, 0
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except StepFailedError as e:
            outs = e.outputs
            failed.update(dict.fromkeys(e.request_ids, e))
        for out in outs:
            if out.finished:
                finals[out.request_id] = out
        overlapped += engine._in_flight is not None
        calls += 1
        if on_step is not None:
            on_step(engine, calls)
    assert engine._in_flight is None  # nothing left behind
    return finals, overlapped, failed


def count_deferred(monkeypatch, runner):
    """Counts the steps whose sampling waited for grammar masks, and the deferred rows whose
    sequence had already ended (its grammar complete, max_tokens) when the masks were made."""
    counts = {"deferred": 0, "ended": 0}
    sample_deferred = runner.sample_deferred

    def counting(step):
        for handle in step.handles:
            if type(handle) is DeferredSample:
                counts["deferred"] += 1
                counts["ended"] += sum(seq.is_finished() for _, seq in handle.rows.values())
        return sample_deferred(step)

    monkeypatch.setattr(runner, "sample_deferred", counting)
    return counts


def check_same(reference: dict, finals: dict, params):
    assert sorted(finals) == sorted(reference)
    for key, ref in reference.items():
        assert len(finals[key].outputs) == len(ref.outputs)
        for a, b in zip(ref.outputs, finals[key].outputs):
            assert b.token_ids == a.token_ids, (key, params[int(key)])
            assert (b.text, b.finish_reason, b.stop_reason) == (a.text, a.finish_reason, a.stop_reason)


def check_grammars(finals: dict, params):
    for key, out in finals.items():
        sp, c = params[int(key)], out.outputs[0]
        if sp.guided_json == SCHEMA and c.finish_reason == "stop":
            value = json.loads(c.text)
            assert {"name", "ok"} <= set(value) <= {"name", "tags", "ok"}
        if sp.guided_regex is not None and c.finish_reason == "stop":
            assert re.fullmatch(REGEX, c.text), c.text
        if sp.guided_choice is not None:
            assert all(c.text in sp.guided_choice and c.finish_reason == "stop" for c in out.outputs)


@pytest.fixture(scope="module")
def engines():
    return (jpaged.LLM("tiny", num_gpu_blocks_override=80, async_scheduling=False, **LIMITS),
            jpaged.LLM("tiny", num_gpu_blocks_override=80, **LIMITS))  # (on by default)


def test_grammar_requests_overlap_and_match_the_synchronous_engine(engines, monkeypatch):
    sync, overlap = engines
    rng = seeded_rng()
    prompts, params = mixed_batch(rng, 14)
    reference, sync_overlapped, _ = run(sync, prompts, params)
    counts = count_deferred(monkeypatch, overlap.llm_engine.runner)
    finals, overlapped, failed = run(overlap, prompts, params)
    assert sync_overlapped == 0 and not failed
    check_same(reference, finals, params)
    check_grammars(finals, params)
    assert overlapped > 20 and counts["deferred"] > 20  # grammar steps overlapped, their sampling deferred
    assert counts["ended"] > 0  # a grammar ended (or hit max_tokens) with the token read: its extra one dropped
    assert overlap.llm_engine.structured_output._matchers == {}  # no matcher made again for an ended sequence
    assert overlap.llm_engine.runner._kept_logits == {}
    assert_all_blocks_free(overlap)


def test_forward_is_launched_before_the_step_in_flight_is_read(engines, monkeypatch):
    """The order that makes the overlap: step N+1's forward is dispatched before N's tokens are
    read; its sampler only after the matchers took N's tokens and N+1's masks were made. Steps
    without a grammar row keep the fused run_step."""
    _, overlap = engines
    engine = overlap.llm_engine
    runner, so = engine.runner, engine.structured_output
    log = []

    def logged(obj, name, event):
        fn = getattr(obj, name)

        def wrapper(*args, **kwargs):
            log.append(event if isinstance(event, str) else event(*args))
            return fn(*args, **kwargs)

        monkeypatch.setattr(obj, name, wrapper)

    logged(runner, "_run_op", lambda op, args: op)
    logged(runner, "collect", "read")
    logged(so, "accept", "accept")
    logged(so, "bitmask", "mask")
    rng = seeded_rng()
    prompts = [rng.integers(0, 256, size=10).tolist() for _ in range(3)]
    params = [jpaged.SamplingParams(temperature=0, max_tokens=60, guided_json=SCHEMA),
              jpaged.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] + \
        [jpaged.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    finals, overlapped, _ = run(overlap, prompts[:2], params[:2])
    forwards = [i for i, e in enumerate(log) if e == "run_forward"]
    assert len(forwards) > 5
    masked = 0
    for i in forwards:
        j = log.index("run_sample", i)
        between = [e for e in log[i + 1:j] if e in ("read", "accept", "mask", "run_step", "run_forward")]
        # N+1's forward, then N read and its tokens taken by the matcher, then N+1's mask, then its
        # sampler (no mask: the grammar ended with N's token; N+1's is dropped).
        assert between[:2] == ["read", "accept"] and set(between[2:]) <= {"accept", "mask"}, log[i:j + 1]
        assert "mask" not in between or between[-1] == "mask"
        masked += "mask" in between
    assert masked >= len(forwards) - 1
    assert_all_blocks_free(overlap)
    log.clear()
    run(overlap, prompts[2:], params[2:])  # no grammar: the fused step, as before
    assert "run_step" in log and "run_forward" not in log and "run_sample" not in log


def test_grammar_overlap_on_a_llama_checkpoint(tmp_path_factory, monkeypatch):
    """The same on a save_pretrained Llama with its tokenizer: tokens and texts equal the
    synchronous engine's."""
    from hf_reference import save_random_llama

    rng = seeded_rng()
    path = save_random_llama(tmp_path_factory.mktemp("llama"), seed=int(rng.integers(2**31)))
    prompts, params = mixed_batch(rng, 10)
    outputs = []
    for async_scheduling in (False, True):
        llm = jpaged.LLM(path, num_gpu_blocks_override=80, async_scheduling=async_scheduling, **LIMITS)
        counts = count_deferred(monkeypatch, llm.llm_engine.runner)
        finals, overlapped, failed = run(llm, prompts, params)
        assert not failed
        outputs.append(finals)
        if async_scheduling:
            assert overlapped > 10 and counts["deferred"] > 10
            assert llm.llm_engine.structured_output._matchers == {}
            assert_all_blocks_free(llm)
        else:
            assert overlapped == 0 and counts["deferred"] == 0
    check_same(outputs[0], outputs[1], params)
    check_grammars(outputs[1], params)


def test_abort_of_a_grammar_request_while_in_flight(engines):
    _, overlap = engines
    engine = overlap.llm_engine
    rng = seeded_rng()
    prompts, params = mixed_batch(rng, 6)
    params[0] = jpaged.SamplingParams(temperature=0, max_tokens=80, guided_json=SCHEMA)
    aborted = []

    def abort_once(engine, calls):
        group = engine._groups.get("0")
        if not aborted and engine._in_flight is not None and group is not None and group.seqs[0].get_output_len() >= 3:
            engine.abort_request("0")
            aborted.append(calls)

    finals, overlapped, failed = run(overlap, prompts, params, on_step=abort_once)
    assert aborted and "0" not in finals and not failed and len(finals) == 5
    check_grammars(finals, params)
    assert engine.structured_output._matchers == {} and engine.runner._kept_logits == {}
    assert_all_blocks_free(overlap)


def test_failures_between_the_forward_and_the_sampling_fail_their_request_alone(engines, monkeypatch):
    """Between step N+1's forward and its sampling: request A's update of step N raises (it is
    aborted while its N+1 row waits for a mask), and request B's N+1 mask raises. Each fails
    alone, named; the others' outputs equal the synchronous engine's; nothing leaks."""
    sync, overlap = engines
    rng = seeded_rng()
    prompts, params = mixed_batch(rng, 7)
    params[0] = jpaged.SamplingParams(temperature=0, max_tokens=60, guided_json=SCHEMA)  # A
    params[3] = jpaged.SamplingParams(temperature=0, max_tokens=60, guided_json=SCHEMA)  # B
    reference, _, _ = run(sync, prompts, params)
    engine = overlap.llm_engine
    so, accept, bitmask = engine.structured_output, engine.structured_output.accept, engine.structured_output.bitmask
    seq_of = lambda key: engine._groups[key].seqs[0].seq_id if key in engine._groups else None  # noqa: E731
    deferred_masks = {"B": 0}

    def poisoned_accept(seq_id, token):
        if seq_id == seq_of("0") and engine._groups["0"].seqs[0].get_output_len() == 5:
            raise ZeroDivisionError("poisoned accept")
        return accept(seq_id, token)

    def poisoned_bitmask(seq_id, sp):
        group = engine._groups.get("3")
        if group is not None and seq_id == group.seqs[0].seq_id and group.seqs[0].num_pending_tokens:
            deferred_masks["B"] += 1
            if deferred_masks["B"] == 4:
                raise ZeroDivisionError("poisoned mask")
        return bitmask(seq_id, sp)

    monkeypatch.setattr(so, "accept", poisoned_accept)
    monkeypatch.setattr(so, "bitmask", poisoned_bitmask)
    counts = count_deferred(monkeypatch, engine.runner)
    finals, overlapped, failed = run(overlap, prompts, params)
    assert sorted(failed) == ["0", "3"], failed
    assert "poisoned accept" in str(failed["0"]) and "poisoned mask" in str(failed["3"])
    assert counts["deferred"] > 5 and overlapped > 10
    check_same({k: v for k, v in reference.items() if k not in failed}, finals, params)
    assert so._matchers == {} and so._errors == {} and engine.runner._kept_logits == {}
    assert_all_blocks_free(overlap)


def test_beam_search_still_refuses_the_overlap(engines):
    _, overlap = engines
    params = [jpaged.SamplingParams(use_beam_search=True, best_of=2, temperature=0, max_tokens=8, ignore_eos=True)]
    _, overlapped, failed = run(overlap, [[1, 2, 3, 4]], params)
    assert overlapped == 0 and not failed
    assert_all_blocks_free(overlap)


def test_nothing_compiles_when_grammar_steps_overlap(monkeypatch):
    """The deferred sampling runs the executables a fused step runs (the same keys): after the
    warm-up, a mix of grammar and plain requests overlapped compiles nothing."""
    from test_compilation import CompileRecorder

    llm = jpaged.LLM("tiny", num_gpu_blocks_override=80, background_warmup=False,
                     **{**LIMITS, "enforce_eager": False})
    compiled = llm.stats()["num_compilations"]
    prompts, params = mixed_batch(seeded_rng(), 8)
    counts = count_deferred(monkeypatch, llm.llm_engine.runner)
    with CompileRecorder() as recorder:
        finals, overlapped, failed = run(llm, prompts, params)
    assert not failed and overlapped > 10 and counts["deferred"] > 10
    assert recorder.events == [], f"compiled after warm-up: {recorder.events}"
    assert llm.stats()["num_compilations"] == compiled
