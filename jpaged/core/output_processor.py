"""OutputProcessor: a request's RequestOutput after a step (cumulative, delta or final).

Reads the sequences the scheduler's update_from_output updated; it writes only what was sent
(RequestOutputKind.DELTA's counters).
"""

from jpaged.core.detokenizer import streamable_text
from jpaged.core.pending_output import PendingOutput
from jpaged.core.sequence import _FINISH_REASONS, Sequence, SequenceGroup
from jpaged.core.stop_checker import StopChecker
from jpaged.outputs import CompletionOutput, RequestOutput
from jpaged.sampling_params import RequestOutputKind


class OutputProcessor:
    def __init__(self, stop_checker: StopChecker):
        self.stop_checker = stop_checker  # beams are ranked by its length-penalized score

    def request_output(self, group: SequenceGroup) -> RequestOutput | PendingOutput | None:
        """The group's output after a step, as its output_kind asks (None: nothing to send; a
        PendingOutput for a request whose text is made later, on another thread)."""
        sp = group.sampling_params
        seqs = group.seqs  # (read only: not copied)
        if seqs[0].detokenize_later:  # its text is made on another thread (pending_output.py)
            return PendingOutput(group)
        finished = group.is_finished()
        kind = sp.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if kind is RequestOutputKind.DELTA:
            return self._delta_output(group, seqs, finished)
        if sp.use_beam_search:  # the n best beams (all finished ones once the search is over)
            seqs = sorted(seqs, key=lambda s: self.stop_checker.beam_score(sp, s), reverse=True)[:sp.n]
        elif finished and len(seqs) > sp.n:  # best_of: keep the n most likely
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:sp.n]
        logprobs = sp.logprobs is not None
        # (positional CompletionOutput fields, the status's finish_reason looked up directly: every
        # request, every step)
        completions = [CompletionOutput(i, s.output_text, list(s.output_token_ids), s.cumulative_logprob,
                                        list(s.output_logprobs) if logprobs else None,
                                        _FINISH_REASONS.get(s.status), s.stop_reason)
                       for i, s in enumerate(seqs)]
        prompt_logprobs = list(group.prompt_logprobs) if group.prompt_logprobs is not None else None
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, finished,
                             prompt_logprobs, group.num_cached_tokens)

    @staticmethod
    def _delta_output(group: SequenceGroup, seqs: list[Sequence], finished: bool) -> RequestOutput:
        """What is new since the group's last output: tokens, their logprobs, and the text that can
        no longer turn into a stop string (all of it once the sequence is finished)."""
        sp = group.sampling_params
        stop, logprobs = sp.stop, sp.logprobs is not None
        completions = []
        for i, s in enumerate(seqs):
            finish_reason = _FINISH_REASONS.get(s.status)
            # streamable_text: all of it once finished or without stop strings
            text = s.output_text if finish_reason is not None or not stop else streamable_text(s, stop)
            sent = s.num_sent_tokens
            completions.append(CompletionOutput(
                i, text[s.num_sent_chars:], s.output_token_ids[sent:], s.cumulative_logprob,
                s.output_logprobs[sent:] if logprobs else None, finish_reason, s.stop_reason))
            s.num_sent_tokens, s.num_sent_chars = len(s.output_token_ids), len(text)
        prompt_logprobs = None
        if group.prompt_logprobs is not None:
            prompt_logprobs = group.prompt_logprobs[group.num_sent_prompt_logprobs:]
            group.num_sent_prompt_logprobs = len(group.prompt_logprobs)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, finished,
                             prompt_logprobs, group.num_cached_tokens)
