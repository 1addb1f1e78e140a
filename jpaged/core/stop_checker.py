"""StopChecker: appends a sampled token to a sequence and decides whether it stops there.

It holds what the stop checks need besides the sequence: the EOS id, max_model_len, the
detokenizer (stop strings; a stop token's text is not output) and the structured output manager
(a grammar that is complete, or failed). The scheduler's update_from_output calls it for every
token; it never frees blocks (the scheduler does, for a sequence it finished).
"""

from jpaged.core.detokenizer import Detokenizer
from jpaged.core.sequence import Sequence, SequenceStatus
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
        if self.detokenizer is not None:
            self.detokenizer.decode_sequence_incrementally(seq)
        grammar = self.structured_output.accept(seq.seq_id, token) if sp.guided else None
        self._check_stop(sp, seq, token, grammar)

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
        if self.detokenizer is not None:
            self.detokenizer.remove_last_delta(seq)
