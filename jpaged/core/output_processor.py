"""OutputProcessor: a request's RequestOutput after a step (cumulative, delta or final).

Reads the sequences the scheduler's update_from_output updated; it writes only what was sent
(RequestOutputKind.DELTA's counters).
"""

from jpaged.core.detokenizer import streamable_text
from jpaged.core.sequence import Sequence, SequenceGroup
from jpaged.core.stop_checker import StopChecker
from jpaged.outputs import CompletionOutput, RequestOutput
from jpaged.sampling_params import RequestOutputKind


class OutputProcessor:
    def __init__(self, stop_checker: StopChecker):
        self.stop_checker = stop_checker  # beams are ranked by its length-penalized score

    def request_output(self, group: SequenceGroup) -> RequestOutput | None:
        """The group's output after a step, as its output_kind asks (None: nothing to send)."""
        sp = group.sampling_params
        seqs = group.get_seqs()
        finished = group.is_finished()
        if sp.output_kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if sp.output_kind is RequestOutputKind.DELTA:
            return self._delta_output(group, seqs, finished)
        if sp.use_beam_search:  # the n best beams (all finished ones once the search is over)
            seqs = sorted(seqs, key=lambda s: self.stop_checker.beam_score(sp, s), reverse=True)[:sp.n]
        elif finished and len(seqs) > sp.n:  # best_of: keep the n most likely
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:sp.n]
        completions = [CompletionOutput(
            index=i, text=s.output_text, token_ids=list(s.output_token_ids), cumulative_logprob=s.cumulative_logprob,
            logprobs=list(s.output_logprobs) if sp.logprobs is not None else None,
            finish_reason=s.status.finish_reason, stop_reason=s.stop_reason)
            for i, s in enumerate(seqs)]
        prompt_logprobs = list(group.prompt_logprobs) if group.prompt_logprobs is not None else None
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, finished,
                             prompt_logprobs, group.num_cached_tokens)

    @staticmethod
    def _delta_output(group: SequenceGroup, seqs: list[Sequence], finished: bool) -> RequestOutput:
        """What is new since the group's last output: tokens, their logprobs, and the text that can
        no longer turn into a stop string (all of it once the sequence is finished)."""
        sp = group.sampling_params
        completions = []
        for i, s in enumerate(seqs):
            text = s.output_text if s.is_finished() else streamable_text(s, sp.stop)
            completions.append(CompletionOutput(
                index=i, text=text[s.num_sent_chars:], token_ids=s.output_token_ids[s.num_sent_tokens:],
                cumulative_logprob=s.cumulative_logprob,
                logprobs=s.output_logprobs[s.num_sent_tokens:] if sp.logprobs is not None else None,
                finish_reason=s.status.finish_reason, stop_reason=s.stop_reason))
            s.num_sent_tokens, s.num_sent_chars = len(s.output_token_ids), len(text)
        prompt_logprobs = None
        if group.prompt_logprobs is not None:
            prompt_logprobs = group.prompt_logprobs[group.num_sent_prompt_logprobs:]
            group.num_sent_prompt_logprobs = len(group.prompt_logprobs)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, finished,
                             prompt_logprobs, group.num_cached_tokens)
