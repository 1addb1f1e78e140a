"""Text made off the engine thread (jpaged/core/pending_output.py): a streamed request whose text
decides nothing on the engine thread gets PendingOutputs, completed on another thread while the
engine steps on. What a client receives must be what the engine thread's own detokenizing gives:
the same deltas of text, tokens, logprobs and reasons, a stop token's text left out; requests that
need their text on the engine thread (stop strings, n > 1, prompt logprobs) are unchanged.
Seeded: conftest's seed (printed), or JPAGED_TEST_SEED."""

import queue
import random
import threading

import numpy as np
import pytest

from jpaged.core.detokenizer import Detokenizer
from jpaged.core.pending_output import PendingOutput, complete, detokenizes_later
from jpaged.core.sequence import Sequence, SequenceGroup, SequenceStatus
from jpaged.outputs import RequestOutput
from jpaged.sampling_params import RequestOutputKind, SamplingParams
from test_async_scheduling import LIMITS
from test_detokenizer import any_tok, byte_bpe, llama_bpe, tiny, unigram  # noqa: F401 (fixtures)
from test_engine import assert_all_blocks_free

DELTA = RequestOutputKind.DELTA


def _run(llm, requests, later: bool) -> dict:
    """Each request's DELTA outputs merged (RequestOutput.add), and how many were PendingOutputs.
    With `later`, PendingOutputs are completed on another thread in step order, as the server's
    output thread does, while the engine steps on."""
    engine = llm.llm_engine
    engine.detokenize_later = later
    handed, merged, counts = queue.SimpleQueue(), {}, {"pending": 0}

    def outputs_thread():
        while (outputs := handed.get()) is not None:
            for out in outputs:
                if type(out) is PendingOutput:
                    counts["pending"] += 1
                    out = complete(out, engine.detokenizer)
                assert isinstance(out, RequestOutput)
                if out.request_id in merged:
                    merged[out.request_id].add(out)
                else:
                    merged[out.request_id] = out

    thread = threading.Thread(target=outputs_thread)
    thread.start()
    try:
        for i, (prompt, sp) in enumerate(requests):
            engine.add_request(f"r{i}", prompt, sp)
        while engine.has_unfinished_requests():
            handed.put(engine.step())
    finally:
        handed.put(None)
        thread.join()
        engine.detokenize_later = False
    assert_all_blocks_free(llm)
    return merged, counts["pending"]


def _requests(rng: np.random.Generator, reference_tokens: dict | None = None) -> list:
    """Streamed requests of every kind: plain (later), with logprobs (later), stop strings, n = 2,
    prompt logprobs (all three on the engine thread); stop_token_ids drawn from what the plain
    request generated (so that it stops midway: its stop token's text is left out)."""
    requests = []
    for i in range(12):
        prompt = rng.integers(3, 250, int(rng.integers(3, 40))).tolist()
        kind = i % 6
        kwargs = dict(temperature=0.0, max_tokens=int(rng.integers(1, 40)), output_kind=DELTA, ignore_eos=True)
        if kind == 1:
            kwargs["logprobs"] = 2
        elif kind == 2 and reference_tokens is not None and len(reference_tokens[f"r{i}"]) > 2:
            tokens = reference_tokens[f"r{i}"]
            kwargs["stop_token_ids"] = [tokens[int(rng.integers(1, len(tokens)))]]
        elif kind == 3:
            kwargs["stop"] = ["\x00\x01", "zz"]
        elif kind == 4:
            kwargs.update(n=2, temperature=1.0, seed=int(rng.integers(1 << 30)))
        elif kind == 5:
            kwargs["prompt_logprobs"] = 1
        requests.append((prompt, SamplingParams(**kwargs)))
    return requests


@pytest.mark.parametrize("options", [{}, {"async_scheduling": False}, {"num_scheduler_steps": 4}],
                         ids=["overlap", "sync", "multi-step"])
def test_text_made_off_the_engine_thread_equals_the_engine_threads(options, shared_llm):
    llm = shared_llm("tiny", num_gpu_blocks_override=80, **LIMITS, **options)
    seed = 20261128  # fixed: the stop_token_ids drawn must hit a request's tokens midway
    print("requests seed", seed)
    first, _ = _run(llm, _requests(np.random.default_rng(seed)), later=False)
    requests = _requests(np.random.default_rng(seed), {k: o.outputs[0].token_ids for k, o in first.items()})
    expected, pending = _run(llm, requests, later=False)
    assert pending == 0
    got, pending = _run(llm, requests, later=True)
    assert pending > 0
    later = {f"r{i}" for i, (_, sp) in enumerate(requests) if detokenizes_later(sp)}
    assert later and len(later) < len(requests)
    stopped = 0
    for request_id, want in expected.items():
        have = got[request_id]
        assert have.outputs == want.outputs, request_id
        assert (have.finished, have.prompt_logprobs, have.num_cached_tokens) == \
               (want.finished, want.prompt_logprobs, want.num_cached_tokens)
        stopped += request_id in later and isinstance(want.outputs[0].stop_reason, int)
    assert stopped, "no request stopped on a stop token: the test's stop_token_ids missed"


def test_requests_that_need_their_text_are_detokenized_on_the_engine_thread():
    base = dict(output_kind=DELTA)
    assert detokenizes_later(SamplingParams(**base))
    assert detokenizes_later(SamplingParams(**base, logprobs=3, stop_token_ids=[5], min_tokens=2))
    for kwargs in ({"stop": "x"}, {"n": 2}, {"prompt_logprobs": 0}, {"guided_regex": "a+"}):  # (DELTA: no beams)
        assert not detokenizes_later(SamplingParams(**base, **kwargs)), kwargs
    assert not detokenizes_later(SamplingParams())  # CUMULATIVE
    assert not detokenizes_later(SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY))


@pytest.mark.parametrize("stop_token", [False, True])
def test_completed_text_equals_incremental_detokenizing_for_each_tokenizer(any_tok, stop_token):  # noqa: F811
    """Random ids in random chunks (several tokens per step, as multi-step and drafts give):
    the completed deltas add up to the engine thread's text, a final stop token's text left out."""
    rng = random.Random(f"pending-{stop_token}-{len(any_tok)}")
    detok = Detokenizer(any_tok)
    for trial in range(20):
        prompt = [rng.randrange(len(any_tok)) for _ in range(rng.randrange(1, 12))]
        output = [rng.randrange(len(any_tok)) for _ in range(rng.randrange(1, 30))]
        reference = Sequence(0, prompt)
        for token in output:
            reference.append_token_id(token, 0.0)
            detok.decode_sequence_incrementally(reference)
        if stop_token:
            detok.remove_last_delta(reference)
        seq = Sequence(1, prompt)
        seq.detokenize_later = True
        group = SequenceGroup("r", [seq], SamplingParams(output_kind=DELTA), 0.0)
        text, done = "", 0
        while done < len(output):
            k = rng.choice([1, 1, 2, 3, 5])
            new = output[done:done + k]
            for token in new:
                seq.append_token_id(token, -0.5)
            done += len(new)
            if done >= len(output):
                seq.status = SequenceStatus.FINISHED_STOPPED if stop_token else SequenceStatus.FINISHED_LENGTH_CAPPED
                seq.stop_reason = output[-1] if stop_token else None
            out = complete(PendingOutput(group), detok)
            assert out.outputs[0].token_ids == new
            text += out.outputs[0].text
        assert out.finished and out.outputs[0].finish_reason == ("stop" if stop_token else "length")
        assert text == reference.output_text, (trial, prompt, output)
