"""OutputProcessor: every change a step's sampled rows make to the sequences, and the outputs.

After the runner's step is read back, this appends each sampled token (forking a fresh prompt
into its best_of sequences), runs the beam search step, detokenizes, checks stops (EOS, stop ids
and strings, max_tokens, max_model_len, the grammar), frees finished sequences' blocks through
the scheduler, and builds RequestOutputs (cumulative, delta or final). At dispatch it counts the
step's tokens as computed. The engine orchestrates; sequence state is written here and in the
scheduler, never in the engine.
"""

import dataclasses
import itertools
import typing

from jpaged.core.detokenizer import Detokenizer, streamable_text
from jpaged.core.scheduler import Scheduler
from jpaged.core.sequence import Sequence, SequenceGroup, SequenceStatus
from jpaged.core.structured_output import StructuredOutputManager
from jpaged.outputs import CompletionOutput, RequestOutput
from jpaged.runner.sampler import SamplingRow, beam_search_candidates
from jpaged.sampling_params import RequestOutputKind, SamplingParams

if typing.TYPE_CHECKING:
    from jpaged.runner.model_runner import SeqInput


@dataclasses.dataclass
class GroupStep:
    """One sequence group's part of a step: built by the engine, updated here from the sampled rows."""

    group: SequenceGroup
    chunk: int  # tokens each running sequence computes
    seq_inputs: "list[SeqInput]" = dataclasses.field(default_factory=list)
    rows: list[SamplingRow] = dataclasses.field(default_factory=list)  # sampling rows, in order
    sampled: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)  # (sequence, rows it samples)
    prompt_rows: int = 0  # prompt-logprob rows, before the sampling rows (a fresh group's one sequence)


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, structured_output: StructuredOutputManager,
                 detokenizer: Detokenizer | None, eos_token_id: int | None, max_model_len: int,
                 seq_ids: itertools.count):
        self.scheduler, self.structured_output, self.detokenizer = scheduler, structured_output, detokenizer
        self.eos_token_id, self.max_model_len, self.seq_ids = eos_token_id, max_model_len, seq_ids

    def on_dispatched(self, step: "GroupStep"):
        """The step is on the device: its tokens count as computed from now on, and each
        sequence's sampled token is pending until it is read."""
        step.group.update_num_computed_tokens(step.chunk)
        if not step.group.sampling_params.use_beam_search:
            for seq, samples in step.sampled:
                if samples == 1:
                    seq.num_pending_tokens += 1

    def process(self, step: "GroupStep", out, row: int):
        """Append each sampled sequence's new token (forking a fresh prompt into its best_of
        sequences), or advance the group's beam search."""
        group, sp = step.group, step.group.sampling_params
        for r in range(row, row + step.prompt_rows):  # rows of a prompt chunk come first
            target = group.prompt_token_ids[len(group.prompt_logprobs)]
            top = {int(t): float(lp) for t, lp in zip(out.top_ids[r, :sp.prompt_logprobs],
                                                      out.top_logprobs[r, :sp.prompt_logprobs])}
            group.prompt_logprobs.append({**top, target: float(out.target_logprobs[r])})
        row += step.prompt_rows
        if group.sampling_params.use_beam_search:
            if step.sampled:
                self._process_beam_search(group, [(seq, row + i) for i, (seq, _) in enumerate(step.sampled)], out)
            return
        for seq, samples in step.sampled:
            if seq.is_finished():  # stopped by its previous token, read after this step was dispatched
                row += samples
                continue
            for s in [seq] + [self._fork(group, seq) for _ in range(samples - 1)]:
                self._append(group, s, out, row)
                row += 1

    def process_multi_step(self, step: "GroupStep", outs: list, row: int):
        """A multi-step decode's K tokens per sequence (one sampling row each, no forks or
        beams): appended in order up to the sequence's stop; the rest are dropped."""
        for seq, _ in step.sampled:
            for i, out in enumerate(outs):
                if i:  # the token appended last was computed by this step
                    seq.num_computed_tokens += 1
                self._append(step.group, seq, out, row)
                if seq.is_finished():
                    break
            row += 1

    def _fork(self, group: SequenceGroup, parent: Sequence) -> Sequence:
        child = parent.fork(next(self.seq_ids))
        group.add(child)
        self.scheduler.fork_seq(parent, child)
        if group.sampling_params.guided:  # before the parent takes its own token
            self.structured_output.fork(parent.seq_id, child.seq_id)
        return child

    def _append(self, group: SequenceGroup, seq: Sequence, out, row: int):
        sp = group.sampling_params
        self._append_token(sp, seq, out.token_ids[row], out.logprobs[row], self._top_logprobs(sp, out, row))
        if seq.is_finished():
            self.scheduler.free_seq(seq)

    @staticmethod
    def _top_logprobs(sp: SamplingParams, out, row: int) -> dict[int, float] | None:
        if sp.logprobs is None:
            return None
        return {int(t): float(lp) for t, lp in zip(out.top_ids[row, :sp.logprobs], out.top_logprobs[row, :sp.logprobs])}

    def _append_token(self, sp: SamplingParams, seq: Sequence, token: int, logprob: float,
                      top: dict[int, float] | None):
        """Append a sampled token (with the top logprobs of its row, when asked for) and check
        whether the sequence stops there. The caller frees a finished sequence's blocks."""
        if top is not None:
            top[token] = logprob
        seq.append_token_id(token, logprob, top)
        if self.detokenizer is not None:
            self.detokenizer.decode_sequence_incrementally(seq)
        grammar = self.structured_output.accept(seq.seq_id, token) if sp.guided else None
        self._check_stop(sp, seq, token, grammar)

    # ------------------------------------------------------------------ beam search
    def _beam_score(self, sp: SamplingParams, seq: Sequence) -> float:
        return seq.get_beam_search_score(sp.length_penalty, eos_token_id=self.eos_token_id)

    def _process_beam_search(self, group: SequenceGroup, beams: list[tuple[Sequence, int]], out):
        """One beam search step (vLLM v0.4's _process_sequence_group_outputs). The 2 * best_of
        best (beam, token) candidates become children of their beams; the best best_of finished
        ones are kept aside and the best best_of live ones continue. A parent continues as its own
        last child; other children fork it (sharing its blocks) and dropped beams free theirs."""
        sp, width = group.sampling_params, group.sampling_params.best_of
        existing_finished = [seq for seq in group.seqs if seq.is_finished()]
        rows = [row for _, row in beams]
        candidates = beam_search_candidates([seq.cumulative_logprob for seq, _ in beams], out.top_ids[rows],
                                            out.top_logprobs[rows], 2 * width)
        children: list[tuple[Sequence, Sequence]] = []  # (child, parent)
        for i, (parent, row) in enumerate(beams):
            tokens = [(token, logprob) for beam, token, logprob in candidates if beam == i]
            if not tokens:  # no candidate: the beam ends here
                parent.status = SequenceStatus.FINISHED_ABORTED
                group.remove(parent)
                self.scheduler.free_seq(parent)
                continue
            top = self._top_logprobs(sp, out, row)  # the row's; each child adds its own token to a copy
            for token, logprob in tokens[:-1]:
                child = parent.fork(next(self.seq_ids))
                self._append_token(sp, child, token, logprob, dict(top) if top is not None else None)
                children.append((child, parent))
            self._append_token(sp, parent, *tokens[-1], top)
            children.append((parent, parent))

        def by_score(pairs):
            return sorted(pairs, key=lambda pair: self._beam_score(sp, pair[0]), reverse=True)

        # The best `width` finished beams so far stay (parent None: finished before this step).
        finished = by_score([(seq, None) for seq in existing_finished]
                            + [(seq, parent) for seq, parent in children if seq.is_finished()])
        selected = [pair for pair in finished[:width] if pair[1] is not None]
        dropped = [pair for pair in finished[width:] if pair[1] is not None]
        for seq, parent in finished[width:]:
            if parent is None:
                group.remove(seq)
        running = by_score([pair for pair in children if not pair[0].is_finished()])
        if not running:
            stop = True
        elif len(finished) < width:
            stop = False
        else:
            stop = self._beam_search_done(sp, running[0][0], finished[width - 1][0])
        selected += [] if stop else running[:width]
        dropped += running if stop else running[width:]

        # Fork the new children before any parent lets go of the blocks they share.
        for seq, parent in selected:
            if seq is not parent:
                group.add(seq)
                if not seq.is_finished():
                    self.scheduler.fork_seq(parent, seq)
        for seq, parent in selected:
            if seq is parent and seq.is_finished():
                self.scheduler.free_seq(seq)
        for seq, parent in dropped:
            if seq is parent:
                group.remove(seq)
                self.scheduler.free_seq(seq)

    def _beam_search_done(self, sp: SamplingParams, best_running: Sequence, worst_finished: Sequence) -> bool:
        """With best_of beams finished: can no live beam beat the worst of them (vLLM v0.4's
        _check_beam_search_early_stopping)?"""
        if sp.early_stopping is True:
            return True
        best = self._beam_score(sp, best_running)
        if sp.early_stopping == "never" and sp.length_penalty > 0:
            # Longer is better: score the best live beam at the longest length it could reach
            # (vLLM takes the larger of prompt + max_tokens and max_model_len).
            longest = max(best_running.get_prompt_len() + sp.max_tokens, self.max_model_len)
            best = best_running.get_beam_search_score(sp.length_penalty, longest, self.eos_token_id)
        return self._beam_score(sp, worst_finished) >= best

    def _check_stop(self, sp: SamplingParams, seq: Sequence, token: int, grammar: str | None = None):
        if grammar == "error":  # the grammar engine failed: its message, and no token it did not vouch for
            if self.detokenizer is not None:
                self.detokenizer.remove_last_delta(seq)
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_ERROR, self.structured_output.error(seq.seq_id)
            return
        if grammar == "stop":  # structured output complete: the grammar allows nothing more
            if token == self.eos_token_id and self.detokenizer is not None:
                self.detokenizer.remove_last_delta(seq)
            seq.status = SequenceStatus.FINISHED_STOPPED
            return
        # Real tokens only: a token of a step still in flight is not the sequence's yet.
        output_len = len(seq.output_token_ids)
        if output_len >= sp.min_tokens:
            if (not sp.ignore_eos and token == self.eos_token_id) or token in sp.stop_token_ids:
                if self.detokenizer is not None:  # the stop token's own text is not output
                    self.detokenizer.remove_last_delta(seq)
                seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
                return
            if sp.stop and self.detokenizer is not None:
                matched = self.detokenizer.check_stop_strings(seq, sp.stop)
                if matched is not None:
                    seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, matched
                    return
        if output_len >= sp.max_tokens or seq.get_prompt_len() + output_len >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED

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
            seqs = sorted(seqs, key=lambda s: self._beam_score(sp, s), reverse=True)[:sp.n]
        elif finished and len(seqs) > sp.n:  # best_of: keep the n most likely
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:sp.n]
        completions = [CompletionOutput(
            index=i, text=s.output_text, token_ids=list(s.output_token_ids), cumulative_logprob=s.cumulative_logprob,
            logprobs=list(s.output_logprobs) if sp.logprobs is not None else None,
            finish_reason=s.status.finish_reason, stop_reason=s.stop_reason)
            for i, s in enumerate(seqs)]
        prompt_logprobs = list(group.prompt_logprobs) if group.prompt_logprobs is not None else None
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, finished,
                             prompt_logprobs)

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
                             prompt_logprobs)
