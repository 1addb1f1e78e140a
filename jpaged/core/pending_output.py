"""Outputs whose text is made off the engine thread (vLLM v1: the engine core sends new token ids,
the front end's output processor detokenizes them).

With `LLMEngine.detokenize_later` on (the server's AsyncLLMEngine turns it on), a request whose
text decides nothing on the engine thread (`detokenizes_later`: RequestOutputKind.DELTA, one
sequence, no stop strings, no grammar, no prompt logprobs) is never detokenized there: its stop
checks read token ids alone (EOS, stop_token_ids, min_tokens, max_tokens). For it each step gives a
`PendingOutput` instead of a RequestOutput: which of its tokens are new and what the step decided
(finish reason, cumulative logprob), taken on the engine thread in a few attribute reads.
`complete` makes the RequestOutput from it on another thread, detokenizing the new tokens with a
`TextView` kept on the sequence, which only that thread touches.

Thread safety: the other thread reads `seq.output_token_ids[start:end]` and
`seq.output_logprobs[start:end]` (append-only lists for such a sequence: no beams, no forks; a
slice is taken under the GIL) and the pending output's own snapshot; it writes only
`seq.text_view`. The text is the same as on the engine thread: a stop token's own text is not
output (it is simply not detokenized; the engine thread detokenizes it and takes its delta back).
Calls to `complete` for one request must come in step order (one thread, one FIFO queue).
"""

from jpaged.core.sequence import _FINISH_REASONS, Sequence, SequenceGroup
from jpaged.outputs import CompletionOutput, RequestOutput
from jpaged.sampling_params import RequestOutputKind, SamplingParams


def detokenizes_later(sp: SamplingParams) -> bool:
    """Whether a request's text may be made off the engine thread: nothing on that thread reads it."""
    return (sp.output_kind is RequestOutputKind.DELTA and sp.n == 1 and sp.best_of == 1
            and not sp.use_beam_search and not sp.stop and not sp.guided and sp.prompt_logprobs is None)


class PendingOutput:
    """One step's output of a request that detokenizes later (taken on the engine thread)."""

    __slots__ = ("request_id", "finished", "group", "start", "end", "cumulative_logprob", "finish_reason",
                 "stop_reason", "num_cached_tokens")

    def __init__(self, group: SequenceGroup):
        seq = group.seqs[0]
        self.request_id, self.group = group.request_id, group
        self.start = seq.num_sent_tokens
        self.end = seq.num_sent_tokens = len(seq.output_token_ids)
        self.finish_reason = _FINISH_REASONS.get(seq.status)
        self.finished = self.finish_reason is not None
        self.cumulative_logprob, self.stop_reason = seq.cumulative_logprob, seq.stop_reason
        self.num_cached_tokens = group.num_cached_tokens


class TextView:
    """What the detokenizer keeps for a sequence (the fields it reads and writes on a Sequence),
    fed only the tokens of the outputs completed so far."""

    __slots__ = ("prompt_token_ids", "output_token_ids", "output_text", "tokens", "prefix_offset", "read_offset",
                 "decode_stream", "num_sent_chars", "_detok_new_char_count")

    def __init__(self, prompt_token_ids: list[int]):
        self.prompt_token_ids, self.output_token_ids, self.output_text = prompt_token_ids, [], ""
        self.tokens, self.prefix_offset, self.read_offset, self.decode_stream = None, 0, 0, None
        self.num_sent_chars = 0
        self._detok_new_char_count = 0


def complete(pending: PendingOutput, detokenizer) -> RequestOutput:
    """The RequestOutput (DELTA) of a PendingOutput: its new tokens, their text and logprobs."""
    group = pending.group
    seq: Sequence = group.seqs[0]
    token_ids = seq.output_token_ids[pending.start:pending.end]
    logprobs = seq.output_logprobs[pending.start:pending.end] if group.sampling_params.logprobs is not None else None
    text = ""
    if detokenizer is not None:
        view = seq.text_view
        if view is None:
            view = seq.text_view = TextView(seq.prompt_token_ids)
        # A stop token's own text is not output (stop_reason: its id): its ids are fed, not it.
        # (It is the sequence's last: nothing is detokenized after it.)
        dropped = pending.finish_reason == "stop" and isinstance(pending.stop_reason, int) and token_ids
        view.output_token_ids.extend(token_ids[:-1] if dropped else token_ids)
        detokenizer.decode_new_tokens(view)
        text, view.num_sent_chars = view.output_text[view.num_sent_chars:], len(view.output_text)
    return RequestOutput(pending.request_id, group.prompt, group.prompt_token_ids, [CompletionOutput(
        0, text, token_ids, pending.cumulative_logprob, logprobs, pending.finish_reason, pending.stop_reason)],
        pending.finished, None, pending.num_cached_tokens)
