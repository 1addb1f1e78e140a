"""StopChecker: appends a sampled token to a sequence and decides whether it stops there.

It holds what the stop checks need besides the sequence: the EOS id, max_model_len, the
detokenizer (stop strings; a stop token's text is not output) and the structured output manager
(a grammar that is complete, or failed). The scheduler's update_from_output calls it for every
token; it never frees blocks (the scheduler does, for a sequence it finished).
"""

from jpaged.core.detokenizer import Detokenizer
from jpaged.core.sequence import _FINISH_REASONS, Sequence, SequenceStatus
from jpaged.core.structured_output import StructuredOutputManager
from jpaged.sampling_params import SamplingParams


class StopChecker:
    def __init__(self, max_model_len: int, eos_token_id: int | None = None, detokenizer: Detokenizer | None = None,
                 structured_output: StructuredOutputManager | None = None):
        self.max_model_len, self.eos_token_id = max_model_len, eos_token_id
        self.detokenizer, self.structured_output = detokenizer, structured_output

    def append_token(self, sp: SamplingParams, seq: Sequence, token: int, logprob: float,
                     top: dict[int, float] | None):
        """Append a sampled token (with the top logprobs of its row, when asked for) and check
        whether the sequence stops there."""
        if top is not None:
            top[token] = logprob
            seq.output_logprobs.append(top)
        # (Sequence.append_token_id inlined: once per sampled token)
        if seq.num_pending_tokens:
            seq.num_pending_tokens -= 1
        seq.output_token_ids.append(token)
        seq.cumulative_logprob += logprob
        if self.detokenizer is not None and not seq.detokenize_later:
            self.detokenizer.decode_sequence_incrementally(seq)
        grammar = self.structured_output.accept(seq.seq_id, token) if sp.guided else None
        self._check_stop(sp, seq, token, grammar)

    def append_tokens(self, sp: SamplingParams, seq: Sequence, tokens: list[int], logprobs: list[float]) -> int:
        """append_token for each of a multi-step decode's tokens (no top logprobs), in order, up to
        the one the sequence stops at; returns how many were appended. Without stop strings or a
        grammar (the text decides nothing) the stop is found from the ids first, and the tokens
        before it are appended and detokenized in one pass."""
        if sp.guided or (sp.stop and self.detokenizer is not None):
            for i, (token, logprob) in enumerate(zip(tokens, logprobs)):
                self.append_token(sp, seq, token, logprob, None)
                if seq.status in _FINISH_REASONS:
                    return i + 1
            return len(tokens)
        # _check_stop's rules without a grammar or stop strings, on the ids alone: the length cap
        # falls on token `limit` - 1; a stop token counts from the one that makes min_tokens.
        output_len = len(seq.output_token_ids)
        limit = min(sp.max_tokens, self.max_model_len - len(seq.prompt_token_ids)) - output_len
        end = min(len(tokens), max(limit, 1))  # tokens that may be appended
        num, status, stop_reason = end, None, None
        eos = None if sp.ignore_eos else self.eos_token_id
        stop_ids = sp.stop_token_ids
        if eos is not None or stop_ids:
            first = max(sp.min_tokens - output_len - 1, 0)
            window = tokens[first:end]
            if (eos is not None and eos in window) or (stop_ids and not set(stop_ids).isdisjoint(window)):
                for i in range(first, end):  # (rare: only when one is there)
                    token = tokens[i]
                    if token == eos or token in stop_ids:
                        num, status, stop_reason = i + 1, SequenceStatus.FINISHED_STOPPED, token
                        break
        if status is None and limit <= len(tokens):
            status = SequenceStatus.FINISHED_LENGTH_CAPPED
        # What append_token does for each of the `num` tokens.
        seq.num_pending_tokens = max(seq.num_pending_tokens - num, 0)
        cumulative = seq.cumulative_logprob
        for logprob in logprobs[:num]:  # (in order: the same float sum as one by one)
            cumulative += logprob
        seq.cumulative_logprob = cumulative
        output_ids = seq.output_token_ids
        detokenizer = None if seq.detokenize_later else self.detokenizer
        if stop_reason is None:
            output_ids.extend(tokens[:num])
            if detokenizer is not None:
                detokenizer.decode_sequence_incrementally(seq)
        else:  # the stop token's own text is not output: detokenized alone, then dropped
            output_ids.extend(tokens[:num - 1])
            if detokenizer is not None and num > 1:
                detokenizer.decode_sequence_incrementally(seq)
            output_ids.append(stop_reason)
            if detokenizer is not None:
                detokenizer.decode_sequence_incrementally(seq)
            self._drop_text_of_last_token(seq)
        if status is not None:
            seq.status = status
        if stop_reason is not None:
            seq.stop_reason = stop_reason
        return num

    def fork(self, sp: SamplingParams, parent: Sequence, child: Sequence):
        """`child` was forked from `parent` before the parent takes its own token: its grammar too."""
        if sp.guided:
            self.structured_output.fork(parent.seq_id, child.seq_id)

    def beam_score(self, sp: SamplingParams, seq: Sequence, seq_len: int | None = None) -> float:
        return seq.get_beam_search_score(sp.length_penalty, seq_len, self.eos_token_id)

    def _check_stop(self, sp: SamplingParams, seq: Sequence, token: int, grammar: str | None):
        if grammar == "error":  # the grammar engine failed: its message, and no token it did not vouch for
            self._drop_text_of_last_token(seq)
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_ERROR, self.structured_output.error(seq.seq_id)
            return
        if grammar == "stop":  # structured output complete: the grammar allows nothing more
            if token == self.eos_token_id:
                self._drop_text_of_last_token(seq)
            seq.status = SequenceStatus.FINISHED_STOPPED
            return
        # Real tokens only: a token of a step still in flight is not the sequence's yet.
        output_len = len(seq.output_token_ids)
        if output_len >= sp.min_tokens:
            if (not sp.ignore_eos and token == self.eos_token_id) or token in sp.stop_token_ids:
                self._drop_text_of_last_token(seq)  # the stop token's own text is not output
                seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
                return
            if sp.stop and self.detokenizer is not None:
                matched = self.detokenizer.check_stop_strings(seq, sp.stop)
                if matched is not None:
                    seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, matched
                    return
        if output_len >= sp.max_tokens or len(seq.prompt_token_ids) + output_len >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED

    def _drop_text_of_last_token(self, seq: Sequence):
        if self.detokenizer is not None and not seq.detokenize_later:
            self.detokenizer.remove_last_delta(seq)
