"""The scheduler's update from a step's output (Scheduler inherits StepUpdate): every change a
step's sampled rows make to the sequences, through the scheduler's own stop checker, block
manager and speculator. See scheduler.py for who calls it and when."""

import numpy as np

from jpaged.core import decode_lane
from jpaged.core.beam_search import beam_search_step, top_logprobs
from jpaged.core.scheduler_output import ScheduledSequenceGroup, SchedulerOutputs
from jpaged.core.sequence import _FINISH_REASONS, Sequence, SequenceGroup, SequenceStatus


def _as_list(values) -> list:
    """Sampled ids or logprobs as Python numbers (the runner's are lists already; a model-free
    step's are numpy arrays)."""
    if isinstance(values, list):
        return values
    return values.tolist() if hasattr(values, "tolist") else list(values)


class StepUpdate:
    def update_from_output(self, results, lane=None) -> dict[str, tuple[SequenceGroup, Exception]]:
        """Every sequence-state change a step's sampled rows make. `results`: for each group
        read, (its ScheduledSequenceGroup, the step's SamplerOutputs: one, or K for a multi-step
        decode, the group's first row in them). Groups that finished or were aborted while the
        step ran drop its tokens. Returns the groups whose update raised, {request_id: (group,
        error)}: the caller aborts them; the others are updated. `lane`: the step's decode lane
        (core/decode_lane.py); when every row of it was read, in one output, `_update_lane`."""
        if decode_lane.whole(lane, results) and results[-1][2] == lane.n - 1 and len(results[0][1]) == 1:
            return self._update_lane(lane, results[0][1][0])
        failed = {}
        # A multi-step decode's outputs, transposed once for all the step's groups (they share the
        # same list, read once): per row, its K tokens and their logprobs.
        columns_of, columns = None, None
        for scheduled, outs, row in results:
            group = scheduled.seq_group
            if group.is_finished():
                continue
            try:
                if group.pooling is not None:
                    self._pooled(group, outs[0][row])
                elif len(outs) == 1:
                    self._process(scheduled, outs[0], row)
                else:
                    if columns_of is not outs:
                        columns_of, columns = outs, (list(zip(*(_as_list(o.token_ids) for o in outs))),
                                                     list(zip(*(_as_list(o.logprobs) for o in outs))))
                    self._process_multi_step(scheduled, outs, row, columns)
            except Exception as e:
                failed[group.request_id] = (group, e)
        self.free_finished_seq_groups()
        return failed

    def _update_lane(self, lane, out) -> dict[str, tuple[SequenceGroup, Exception]]:
        """update_from_output for a decode lane's step read whole: rows whose token may stop them
        (EOS, a stop token id, the length cap; with prefix caching, a block it fills) or that
        need more than an append (a grammar, top logprobs, stop strings: LaneRows.inline) take
        `_process`, in row order; every other row's token is appended inline, the same as
        StopChecker.append_token does (no stop check can fire for it). Nothing else touches a row."""
        rows, n, failed = lane.rows, lane.n, {}
        ids, logprobs = _as_list(out.token_ids), _as_list(out.logprobs)
        tokens = np.asarray(ids[:n])
        # The token's output position + 1: its sequence's output length once it is appended.
        general = ~rows.inline | (lane.start + 2 - rows.prompt_len >= rows.cap)
        eos = self.stop_checker.eos_token_id
        if eos is not None:
            general |= (tokens == eos) & rows.eos
        if rows.stop_ids is not None:
            general |= (rows.stop_ids == tokens[:, None]).any(1)
        bm = self.block_manager
        if bm.enable_caching:  # (_process hashes a block the token fills)
            general |= (lane.start + 2) % bm.block_size == 0
        detokenizer = self.stop_checker.detokenizer
        seqs = rows.seqs
        for i in np.flatnonzero(~general).tolist():
            seq = seqs[i]
            try:
                if seq.num_pending_tokens:
                    seq.num_pending_tokens -= 1
                seq.output_token_ids.append(ids[i])
                seq.cumulative_logprob += logprobs[i]
                if detokenizer is not None and not seq.detokenize_later:
                    detokenizer.decode_sequence_incrementally(seq)
            except Exception as e:
                failed[rows.groups[i].request_id] = (rows.groups[i], e)
        special = np.flatnonzero(general).tolist()
        for i in special:
            try:
                self._process(rows.scheduled[i], out, i)
            except Exception as e:
                failed[rows.groups[i].request_id] = (rows.groups[i], e)
        if special or failed:  # (only these can have finished)
            self.free_finished_seq_groups()
        return failed

    @staticmethod
    def _pooled(group: SequenceGroup, pooled):
        group.pooled = pooled
        for seq in group.seqs:
            seq.status = SequenceStatus.FINISHED_STOPPED

    def _process(self, scheduled: ScheduledSequenceGroup, out, row: int):
        """Prompt logprobs, then append each sampled sequence's new token (forking a fresh prompt
        into its best_of sequences), or advance the group's beam search."""
        group, sp = scheduled.seq_group, scheduled.seq_group.sampling_params
        bm = self.block_manager
        caching = bm.enable_caching
        for r in range(row, row + scheduled.prompt_rows):  # rows of a prompt chunk come first
            target = group.prompt_token_ids[len(group.prompt_logprobs)]
            top = {int(t): float(lp) for t, lp in zip(out.top_ids[r, :sp.prompt_logprobs],
                                                      out.top_logprobs[r, :sp.prompt_logprobs])}
            group.prompt_logprobs.append({**top, target: float(out.target_logprobs[r])})
        row += scheduled.prompt_rows
        if sp.use_beam_search:
            sampled = scheduled.sampled
            if sampled:
                beam_search_step(self, group, [(seq, row + i) for i, (seq, _) in enumerate(sampled)], out)
            return
        for seq, samples in zip(scheduled.seqs, scheduled.samples):
            if not samples:
                continue
            if seq.status in _FINISH_REASONS:  # stopped by its previous token, read after this step was dispatched
                row += samples
                continue
            if scheduled.spec_token_ids:
                self._accept(group, seq, scheduled.spec_token_ids, out, row)
                row += samples
                continue
            if samples == 1:  # (_append inlined: once per sampled token)
                self.stop_checker.append_token(sp, seq, int(out.token_ids[row]), float(out.logprobs[row]),
                                               None if sp.logprobs is None else top_logprobs(sp, out, row))
                if caching and (known := len(seq.prompt_token_ids) + len(seq.output_token_ids)) % bm.block_size == 0 \
                        and seq.num_computed_tokens >= known:
                    # Read after the step computing it was dispatched (overlap): the block this token
                    # fills could not be hashed when that step was scheduled (_add); it can now (its
                    # K/V is written before any later step reads it), also when the sequence ends here.
                    bm.cache_full_blocks(seq, known, group.lora_request)
                if seq.status in _FINISH_REASONS:
                    self.free_seq(seq)
                row += 1
                continue
            for s in [seq] + [self._fork(group, seq) for _ in range(samples - 1)]:
                self._append(group, s, out, row)
                row += 1

    def _process_multi_step(self, scheduled: ScheduledSequenceGroup, outs: list, row: int, rows=None):
        """A multi-step decode's K tokens per sequence (one sampling row each, no forks or
        beams): appended in order up to the sequence's stop; the rest are dropped. `rows`: the
        outputs' (token ids, logprobs) per row, K each (update_from_output's transposition)."""
        group = scheduled.seq_group
        sp = group.sampling_params
        if sp.logprobs is not None:  # (never from the engine: the fast sampler has no top logprobs)
            for seq, _ in scheduled.sampled:
                for i, out in enumerate(outs):
                    if i:  # the token appended last was computed by this step
                        seq.num_computed_tokens += 1
                    self._append(group, seq, out, row)
                    if seq.is_finished():
                        break
                row += 1
            return
        for seq, samples in zip(scheduled.seqs, scheduled.samples):
            if not samples:
                continue
            # K tokens in one call: up to the stop, as one by one (StopChecker.append_tokens).
            if rows is not None:
                num = self.stop_checker.append_tokens(sp, seq, rows[0][row], rows[1][row])
            else:
                num = self.stop_checker.append_tokens(sp, seq, [int(out.token_ids[row]) for out in outs],
                                                      [float(out.logprobs[row]) for out in outs])
            seq.num_computed_tokens += num - 1  # each token appended but the last was computed by this step
            if seq.status in _FINISH_REASONS:
                self.free_seq(seq)
            row += 1

    def _accept(self, group: SequenceGroup, seq: Sequence, drafts: list[int], out, row: int):
        """Verified drafts (spec_decode/__init__.py): row i's token is appended; while it equals
        draft i, that draft's K/V (written by this step) is the sequence's own and the next row
        counts. The first token that differs, or the bonus token after all of them, ends the
        run; so does a stop. Rejected drafts' K/V lie past the computed tokens: never read."""
        accepted = 0
        for i in range(len(drafts) + 1):
            token = int(out.token_ids[row + i])
            self._append(group, seq, out, row + i)
            if seq.is_finished() or i == len(drafts) or token != drafts[i]:
                break
            seq.num_computed_tokens += 1
            accepted += 1
            # A block the accepted drafts filled is cached as a decode step's would be.
            self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens, group.lora_request)
        self.speculator.record(len(drafts), accepted)

    def set_drafts(self, out: SchedulerOutputs, scheduled: ScheduledSequenceGroup, drafts: list[int]):
        """A draft model's drafts for a group the plan reserved them for (DRAFT_PENDING, at most
        as many): they take the reservation's place, cut at the first its grammar rejects (the
        reserved slots stay the sequence's; unused, they are the next step's)."""
        drafts = self.speculator.check_drafts(scheduled.seq_group, drafts[:len(scheduled.spec_token_ids)])
        out.num_batched_tokens -= len(scheduled.spec_token_ids) - len(drafts)
        scheduled.spec_token_ids = drafts
        scheduled.token_chunk_size = 1 + len(drafts)
        scheduled.samples = [1 + len(drafts)]

    def _fork(self, group: SequenceGroup, parent: Sequence) -> Sequence:
        child = parent.fork(self.new_seq_id())
        group.add(child)
        self.fork_seq(parent, child)
        self.stop_checker.fork(group.sampling_params, parent, child)
        return child

    def _append(self, group: SequenceGroup, seq: Sequence, out, row: int):
        sp = group.sampling_params
        self.stop_checker.append_token(sp, seq, int(out.token_ids[row]), float(out.logprobs[row]),
                                       None if sp.logprobs is None else top_logprobs(sp, out, row))
        if seq.status in _FINISH_REASONS:
            self.free_seq(seq)
