"""The runner's own step inputs, built from the scheduler's plan (vLLM v1's SchedulerOutput ->
InputBatch update): which sequences compute which tokens, and the sampling rows they sample.

`StepBuilder.build(plan, lora_slots)` walks the plan once. A sequence entering the batch gets an
InputBatch row with its knobs (written once); each step then records per sequence only what
changes (its tokens, start position, block table) and per sampling row its InputBatch row and
what varies by row: sample_index (the output position), a fork's seq_index, a prompt-logprob
row's target token, a grammar mask. `sampling_metadata` then gathers the sampler's arrays from the
InputBatch by row index (vectorised); `history_inputs` says where each penalised row's tokens lie
in the device's token history, uploading those a row does not hold yet.

Row order in a step: each group's sequences in the plan's order; per sequence its prompt-logprob
rows (reporting the next prompt token, with the model's own distribution: no penalty, bias or
grammar), then its samples: one (a decode), one per fork (a fresh prompt's best_of), or one after
its last token and after each draft (speculative decoding), at consecutive output positions.
"""

import dataclasses
import itertools
import operator

import numpy as np

from jpaged.config import MAX_LOGPROBS
from jpaged.core.sequence import _FINISH_REASONS
from jpaged.runner.buckets import HISTORY_UPLOAD_ROWS, fit
from jpaged.runner.input_batch import MAX_BANNED_TOKENS, InputBatch
from jpaged.runner.sampler import GREEDY_TEMPERATURE, SamplingMetadata
from jpaged.runner.step_functions import HistoryInputs

_status = operator.attrgetter("status")


@dataclasses.dataclass
class StepBatch:
    """One step's inputs (or one group's share), lists kept in step order."""

    # Per sequence: its InputBatch row, tokens to compute from start_pos, and its rows.
    rows: list[int] = dataclasses.field(default_factory=list)
    token_ids: list[list[int]] = dataclasses.field(default_factory=list)
    start_pos: list[int] = dataclasses.field(default_factory=list)
    num_samples: list[int] = dataclasses.field(default_factory=list)
    num_prompt_rows: list[int] = dataclasses.field(default_factory=list)
    num_spec_tokens: list[int] = dataclasses.field(default_factory=list)
    # Per sampling row: its InputBatch row (the neutral one for a prompt-logprob row) and output position.
    src: list[int] = dataclasses.field(default_factory=list)
    sample_index: list[int] = dataclasses.field(default_factory=list)
    # Sparse, by sampling row: a prompt-logprob row's target token, a fork's seq_index, a grammar's
    # mask, a penalised row's history entry (draft index j, row, sequence, the sequence's drafts,
    # whether the sampler appends its token).
    targets: dict[int, int] = dataclasses.field(default_factory=dict)
    seq_index: dict[int, int] = dataclasses.field(default_factory=dict)
    masks: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    history: dict[int, tuple] = dataclasses.field(default_factory=dict)
    # Per group: (its ScheduledSequenceGroup, its first sequence, its first sampling row).
    groups: list[tuple] = dataclasses.field(default_factory=list)
    # A decode lane step (StepBuilder._build_lane): the per-sequence fields are numpy arrays, one
    # token (taken on the device: PENDING_TOKEN) and one sample per sequence, its row's; `lane`:
    # the arrays that depend only on the rows, kept while the lane's rows stay (RunnerLane.arrays).
    lane: dict | None = None
    # By sampling row: a grammar row whose sequence has a token pending (a step in flight), as
    # (its group, its sequence): its mask is made once that token is read and the matcher has
    # taken it; the step's sampling waits for it (runner/deferred_sample.py).
    deferred: dict[int, tuple] = dataclasses.field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return len(self.src)

    def _lengths(self):
        return len(self.rows), len(self.src)

    def _truncate(self, lengths):
        n, r = lengths
        for a in (self.rows, self.token_ids, self.start_pos, self.num_samples, self.num_prompt_rows,
                  self.num_spec_tokens):
            del a[n:]
        for a in (self.src, self.sample_index):
            del a[r:]
        for d in (self.targets, self.seq_index, self.masks, self.history, self.deferred):
            for i in [i for i in d if i >= r]:
                del d[i]

    def group(self, k: int) -> "StepBatch":
        """Group k's share alone, its rows renumbered from 0."""
        scheduled, s0, r0 = self.groups[k]
        s1, r1 = self.groups[k + 1][1:] if k + 1 < len(self.groups) else (len(self.rows), len(self.src))

        def sparse(d):
            return {i - r0: v for i, v in d.items() if r0 <= i < r1}

        return StepBatch(self.rows[s0:s1], self.token_ids[s0:s1], self.start_pos[s0:s1], self.num_samples[s0:s1],
                         self.num_prompt_rows[s0:s1], self.num_spec_tokens[s0:s1], self.src[r0:r1],
                         self.sample_index[r0:r1], sparse(self.targets), sparse(self.seq_index), sparse(self.masks),
                         sparse(self.history), [(scheduled, 0, 0)], deferred=sparse(self.deferred))


@dataclasses.dataclass
class DispatchedStep:
    """A step on its way through the device (ModelRunner.execute); the host has not read its
    sampled ids yet."""

    plan: object  # the SchedulerOutputs
    handles: list  # StepHandles: one, or one per group when the batch was re-run group by group
    results: list  # (ScheduledSequenceGroup, index into handles, the group's first row there), plan order
    failed: dict  # request_id -> (group, exception): groups left out (inputs or dispatch failed)

    def read_whole(self, collect) -> list:
        """A decode lane's step (core/decode_lane.py) dispatched whole, none of its sequences
        finished or aborted meanwhile: each group's (ScheduledSequenceGroup, outputs, row), the
        one output read at once by `collect`. [] otherwise (or if the read fails): the caller
        reads group by group."""
        lane = self.plan.lane
        if lane is None or self.failed or len(self.handles) != 1 or len(self.results) != lane.n or not lane.n \
                or self.results[-1][0] is not lane.rows.scheduled[-1] \
                or any(map(_FINISH_REASONS.__contains__, map(_status, lane.rows.seqs))):
            return []
        try:
            outs = collect(self.handles[0])
        except Exception:
            return []
        return list(zip(lane.rows.scheduled, itertools.repeat(outs), range(lane.n)))


class RunnerLane:
    """The runner's arrays of the scheduler's decode lane (core/decode_lane.py) as of lane step
    `step`: each lane sequence's InputBatch row, and its position minus its output position
    (constant while it decodes). The next lane step is applied to them as a diff."""

    __slots__ = ("version", "step", "rows", "offset", "arrays")

    def __init__(self, version: int, step: int, rows: np.ndarray, offset: np.ndarray, arrays: dict | None = None):
        self.version, self.step, self.rows, self.offset = version, step, rows, offset
        # Step arrays that depend only on the rows (the padded inputs' row-indexed parts, the
        # sampler's knobs), by shape: reused while no row leaves (prepare_lane, sampling_metadata).
        self.arrays = {} if arrays is None else arrays


_PENDING = [-1]  # (prepare_inputs.PENDING_TOKEN: a lane step's tokens are on the device)


class StepBuilder:
    """Builds a plan's StepBatch over `input_batch`. What it reads of the engine is handed over
    once, read only: the BlockManager (block tables), the StructuredOutputManager (grammar
    masks), the StopChecker (EOS, which min_tokens bans; tests move it), and the engine seed
    (unseeded requests' keys). A plan whose decode lane continues the last one it built is
    applied as a diff (`_build_lane`); `use_lane` False (the runner's multimodal models): never."""

    def __init__(self, input_batch: InputBatch, block_manager=None, structured_output=None, stop_checker=None,
                 seed: int = 0):
        self.input_batch, self.block_manager = input_batch, block_manager
        self.structured_output, self.stop_checker, self.seed = structured_output, stop_checker, seed
        self.use_lane, self.lane = True, None

    @property
    def eos_token_id(self) -> int | None:
        return None if self.stop_checker is None else self.stop_checker.eos_token_id

    def seed_of(self, sp, seq) -> int:
        """Unseeded requests draw from the engine seed and the sequence id; seeded ones only from
        their own seed, so the same seed gives the same output whatever else runs."""
        return sp.seed if sp.seed is not None else hash((self.seed, seq.seq_id)) & 0x7FFFFFFF

    def build(self, plan, lora_slots: dict[int, int]) -> tuple[StepBatch, dict]:
        """The plan's StepBatch, and the groups whose inputs could not be built: {request_id:
        (group, error)} (the others go on). Rows of sequences not in the plan are freed."""
        lane, cache, self.lane = plan.lane, self.lane, None
        if lane is None or not self.use_lane:
            return self._build(plan, lora_slots)[:2]
        if (cache is not None and lane.version == cache.version and lane.step == cache.step + 1
                and lane.n == len(plan.scheduled_seq_groups)):
            return self._build_lane(plan, lane, cache), {}
        batch, failed, inline = self._build(plan, lora_slots)
        if not failed and inline == lane.n == len(plan.scheduled_seq_groups):  # every group inline: keep the lane
            self.lane = RunnerLane(lane.version, lane.step, np.array(batch.rows, np.int32),
                                   lane.start - np.array(batch.sample_index, np.int64))
        return batch, failed

    def _build_lane(self, plan, lane, cache: RunnerLane) -> StepBatch:
        """The lane step's StepBatch from the last one's arrays: rows of sequences that left
        freed, tables updated where a block was appended, positions from the plan."""
        ib = self.input_batch
        ib.step += 1
        rows, offset, arrays = cache.rows, cache.offset, cache.arrays
        if lane.keep is not None:
            for row in rows[~lane.keep].tolist():
                ib.free(ib.seq_ids[row])
            rows, offset, arrays = rows[lane.keep], offset[lane.keep], {}
        scheduled = plan.scheduled_seq_groups
        if len(lane.grown):
            get_block_table = self.block_manager.get_block_table
            for i in lane.grown.tolist():
                ib.set_table(int(rows[i]), get_block_table(scheduled[i].seqs[0]))
        self.lane = RunnerLane(lane.version, lane.step, rows, offset, arrays)
        n = len(rows)
        positions = range(n)
        ones, zeros = np.ones(n, np.int32), np.zeros(n, np.int32)
        return StepBatch(rows, [_PENDING] * n, lane.start, ones, zeros, zeros, rows,
                         (lane.start - offset).astype(np.int32), groups=list(zip(scheduled, positions, positions)),
                         lane=arrays)

    def _build(self, plan, lora_slots: dict[int, int]) -> tuple[StepBatch, dict, int]:
        """build's general way; also how many groups took the inline decode."""
        ib, batch, failed, inline = self.input_batch, StepBatch(), {}, 0
        ib.step += 1
        step, stamps, row_of, plain, lora, index_of = ib.step, ib.stamps, ib.row_of, ib.plain, ib.lora_slot_of, \
            ib.seq_index_of
        tables, lengths, lasts, set_table = ib.tables, ib.lengths, ib.lasts, ib.set_table
        get_block_table = self.block_manager.get_block_table
        rows, token_ids, start_pos, src, sample_index = batch.rows, batch.token_ids, batch.start_pos, batch.src, \
            batch.sample_index
        num_samples, num_prompt_rows, num_spec = batch.num_samples, batch.num_prompt_rows, batch.num_spec_tokens
        for scheduled in plan.scheduled_seq_groups:
            group, seqs, first = scheduled.seq_group, scheduled.seqs, None
            try:
                # The common case inline: a lone sequence decoding one token with plain sampling.
                if (scheduled.token_chunk_size == 1 and len(seqs) == 1 and len(group.seqs) == 1
                        and not scheduled.prompt_rows and not scheduled.spec_token_ids
                        and group.lora_request is None and scheduled.samples[0] == 1):
                    seq = seqs[0]
                    row = row_of.get(seq.seq_id)
                    if row is not None and plain[row] and lora[row] == -1 and not index_of[row]:
                        stamps[row] = step
                        table = get_block_table(seq)
                        if tables[row] is not table or lengths[row] != len(table) or table[-1] != lasts[row]:
                            set_table(row, table)
                        batch.groups.append((scheduled, len(rows), len(src)))
                        rows.append(row)
                        token_ids.append([seq.get_last_token_id()])
                        start_pos.append(scheduled.start)
                        num_samples.append(1)
                        num_prompt_rows.append(0)
                        num_spec.append(0)
                        src.append(row)
                        sample_index.append(len(seq.output_token_ids) + seq.num_pending_tokens)
                        inline += 1
                        continue
                first = batch._lengths()
                self._add_group(batch, scheduled, lora_slots, plan)
            except Exception as e:
                if first is not None:  # (the inline case appends nothing before it can raise)
                    batch._truncate(first)
                failed[group.request_id] = (group, e)
                continue
            batch.groups.append((scheduled,) + first)
        if len(row_of) > len(rows):  # rows of sequences that left: finished, aborted, preempted, not scheduled
            for seq_id, row in [(i, r) for i, r in row_of.items() if stamps[r] != step]:
                ib.free(seq_id)
        return batch, failed, inline

    def _add_group(self, batch: StepBatch, scheduled, lora_slots, plan):
        ib, group, get_block_table = self.input_batch, scheduled.seq_group, self.block_manager.get_block_table
        sp, start, chunk, drafts = group.sampling_params, scheduled.start, scheduled.token_chunk_size, \
            scheduled.spec_token_ids
        lora_slot = lora_slots[group.lora_request.lora_int_id] if group.lora_request is not None else -1
        lone = len(group.seqs) == 1
        for seq, samples in zip(scheduled.seqs, scheduled.samples):
            index = 0 if lone else group.seqs.index(seq)
            row = ib.row_of.get(seq.seq_id)
            if row is None:
                if not ib.num_free:  # rows of sequences that left are freed after the step's walk: some now
                    ib.free_absent({seq.seq_id for s in plan.scheduled_seq_groups for seq in s.seqs})
                row = ib.add(seq.seq_id, sp, self.seed_of(sp, seq), index, lora_slot)
            else:
                if ib.seq_index_of[row] != index:  # a beam group dropped a sequence
                    ib.seq_index[row] = ib.seq_index_of[row] = index
                if ib.lora_slot_of[row] != lora_slot:
                    ib.lora_slot[row] = ib.lora_slot_of[row] = lora_slot
            ib.stamps[row] = ib.step
            ib.set_table(row, get_block_table(seq))
            if scheduled.prompt_rows:  # a row per prompt position, reporting the next prompt token
                batch.src.extend([ib.neutral] * scheduled.prompt_rows)
                batch.sample_index.extend([0] * scheduled.prompt_rows)
                for i, target in enumerate(seq.prompt_token_ids[start + 1:start + 1 + scheduled.prompt_rows]):
                    batch.targets[len(batch.src) - scheduled.prompt_rows + i] = target
            output_len = seq.get_output_len()
            if drafts:  # a row after the last token and after each draft, at consecutive output positions
                token_ids = [seq.get_last_token_id(), *drafts]
                if sp.guided:
                    masks = self.structured_output.draft_bitmasks(seq.seq_id, sp, drafts)
                    for i in range(samples):
                        batch.masks[len(batch.src) + i] = masks[i]
                batch.sample_index.extend(range(output_len, output_len + samples))
            else:
                token_ids = [seq.get_last_token_id()] if chunk == 1 and samples \
                    else seq.get_token_ids()[start:start + chunk]
                if samples:
                    # A token pending (a decode behind a step in flight): the mask once it is read.
                    defer = sp.guided and seq.num_pending_tokens
                    mask = self.structured_output.bitmask(seq.seq_id, sp) if sp.guided and not defer else None
                    for i in range(samples):
                        if samples > 1:  # a fresh prompt's forks: one row each, seq_index = its place
                            batch.seq_index[len(batch.src) + i] = i
                        if mask is not None:
                            batch.masks[len(batch.src) + i] = mask
                        elif defer:
                            batch.deferred[len(batch.src) + i] = (group, seq)
                    batch.sample_index.extend([output_len] * samples)
            if samples:
                if ib.penalised[row]:
                    entry = (row, seq, drafts, samples == 1 and not sp.use_beam_search)
                    for j in range(samples):
                        batch.history[len(batch.src) + j] = (j,) + entry
                batch.src.extend([row] * samples)
            batch.rows.append(row)
            batch.token_ids.append(token_ids)
            batch.start_pos.append(start)
            batch.num_samples.append(samples)
            batch.num_prompt_rows.append(scheduled.prompt_rows)
            batch.num_spec_tokens.append(len(drafts))


def needs_full_sampler(ib: InputBatch, batch: StepBatch) -> bool:
    """The full sampler (penalties, grammars, logprobs) when any row needs it: a request that
    asks (InputBatch.full_sampler, set when its row was added) or a prompt-logprob row."""
    return bool(batch.targets) or bool(ib.full_sampler[batch.src].any())


def sampling_metadata(ib: InputBatch, batch: StepBatch | None, num_rows: int, full: bool, vocab_size: int,
                      eos_token_id: int | None = None, batch_invariant: bool = False,
                      all_greedy: bool = False) -> SamplingMetadata:
    """The step's sampler arrays, gathered from the InputBatch by row (rows past the batch's:
    greedy padding). Fixed widths and logprob count, so the sampler has two variants: the fast
    one (no penalties, grammars or logprobs) and `full`. The penalties' tokens are not sent: the
    full sampler reads them from the token history (`history_inputs`). `batch` None: the
    padding alone (a warm-up's shapes). `all_greedy`: the caller found every row greedy
    (`is_all_greedy`): the sampler's executable without a random path."""
    n = 0 if batch is None else batch.num_rows
    if batch is not None and batch.lane is not None:
        return _lane_sampling_metadata(ib, batch, num_rows, full, vocab_size, eos_token_id, batch_invariant,
                                       all_greedy)
    src = np.full(num_rows, ib.neutral, np.intp)
    seq_index = np.zeros(num_rows, np.int32)
    sample_index = np.zeros(num_rows, np.int32)
    targets = np.full(num_rows, -1, np.int32)
    banned = np.full((num_rows, MAX_BANNED_TOKENS), -1, np.int32)
    allowed = np.full((num_rows, -(-vocab_size // 32) if full else 0), -1, np.int32)
    if n:
        src[:n] = batch.src
        seq_index[:n] = ib.seq_index[src[:n]]
        for i, index in batch.seq_index.items():
            seq_index[i] = index
        sample_index[:n] = batch.sample_index
        for i, target in batch.targets.items():
            targets[i] = target
        # min_tokens: EOS and stop_token_ids banned while the row's output position is below it.
        ban = np.flatnonzero(sample_index[:n] < ib.min_tokens[src[:n]])
        if len(ban):
            banning = src[ban]
            banned[ban] = ib.stop_ids[banning]
            if eos_token_id is not None:
                banned[ban, ib.num_stop[banning]] = eos_token_id
        if full:
            for i, mask in batch.masks.items():
                allowed[i] = mask
    empty = np.full((num_rows, 0), -1, np.int32)
    return SamplingMetadata(
        temperature=ib.temperature[src], top_k=ib.top_k[src], top_p=ib.top_p[src], min_p=ib.min_p[src],
        presence_penalty=ib.presence_penalty[src], frequency_penalty=ib.frequency_penalty[src],
        repetition_penalty=ib.repetition_penalty[src], seeds=ib.seeds[src], seq_index=seq_index,
        sample_index=sample_index, prompt_token_ids=empty, output_token_ids=empty, banned_token_ids=banned,
        logit_bias_ids=ib.logit_bias_ids[src], logit_bias_values=ib.logit_bias_values[src], allowed_bitmask=allowed,
        target_token_ids=targets, do_penalties=full, num_logprobs=min(MAX_LOGPROBS, vocab_size) if full else 0,
        do_guided=full, batch_invariant=batch_invariant, all_greedy=all_greedy)


def _lane_sampling_metadata(ib: InputBatch, batch: StepBatch, num_rows: int, full: bool, vocab_size: int,
                           eos_token_id: int | None, batch_invariant: bool, all_greedy: bool) -> SamplingMetadata:
    """sampling_metadata for a decode lane step: the rows' knobs gathered once while the lane's
    rows stay (batch.lane); each step only its output positions and the min_tokens bans."""
    n, key = batch.num_rows, ("sampler", num_rows, full)
    knobs = batch.lane.get(key)
    if knobs is None:
        src = np.full(num_rows, ib.neutral, np.intp)
        src[:n] = batch.src
        seq_index = np.zeros(num_rows, np.int32)
        seq_index[:n] = ib.seq_index[src[:n]]
        knobs = batch.lane[key] = dict(
            src=src, temperature=ib.temperature[src], top_k=ib.top_k[src], top_p=ib.top_p[src], min_p=ib.min_p[src],
            presence_penalty=ib.presence_penalty[src], frequency_penalty=ib.frequency_penalty[src],
            repetition_penalty=ib.repetition_penalty[src], seeds=ib.seeds[src], seq_index=seq_index,
            prompt_token_ids=np.full((num_rows, 0), -1, np.int32), logit_bias_ids=ib.logit_bias_ids[src],
            logit_bias_values=ib.logit_bias_values[src],
            allowed_bitmask=np.full((num_rows, -(-vocab_size // 32) if full else 0), -1, np.int32),
            target_token_ids=np.full(num_rows, -1, np.int32), min_tokens=ib.min_tokens[src[:n]],
            no_bans=np.full((num_rows, MAX_BANNED_TOKENS), -1, np.int32))
    src = knobs["src"]
    sample_index = np.zeros(num_rows, np.int32)
    sample_index[:n] = batch.sample_index
    banned = knobs["no_bans"]
    ban = np.flatnonzero(sample_index[:n] < knobs["min_tokens"])
    if len(ban):  # (as sampling_metadata)
        banned = banned.copy()
        banning = src[ban]
        banned[ban] = ib.stop_ids[banning]
        if eos_token_id is not None:
            banned[ban, ib.num_stop[banning]] = eos_token_id
    return SamplingMetadata(
        temperature=knobs["temperature"], top_k=knobs["top_k"], top_p=knobs["top_p"], min_p=knobs["min_p"],
        presence_penalty=knobs["presence_penalty"], frequency_penalty=knobs["frequency_penalty"],
        repetition_penalty=knobs["repetition_penalty"], seeds=knobs["seeds"], seq_index=knobs["seq_index"],
        sample_index=sample_index, prompt_token_ids=knobs["prompt_token_ids"],
        output_token_ids=knobs["prompt_token_ids"], banned_token_ids=banned, logit_bias_ids=knobs["logit_bias_ids"],
        logit_bias_values=knobs["logit_bias_values"], allowed_bitmask=knobs["allowed_bitmask"],
        target_token_ids=knobs["target_token_ids"], do_penalties=full,
        num_logprobs=min(MAX_LOGPROBS, vocab_size) if full else 0, do_guided=full, batch_invariant=batch_invariant,
        all_greedy=all_greedy)


def is_all_greedy(ib: InputBatch, batch: StepBatch) -> bool:
    """Every sampling row of the step is greedy (padding is)."""
    return bool((ib.temperature[batch.src] < GREEDY_TEMPERATURE).all())


def history_inputs(ib: InputBatch, batch: StepBatch, num_rows: int, widths, upload) -> HistoryInputs:
    """The full sampler's history rows; first uploads (`upload(rows, tokens)`, a device
    operation) the tokens of penalised sequences whose row does not hold them (a new row, or
    tokens the sampler did not append: forks, beams, drafts). Each upload is as wide as the
    smallest of `widths` (Buckets.history) its longest sequence fits: the sampler reads a row
    only up to its sequence's length, so what lies beyond is never read."""
    history = HistoryInputs(*(np.full(num_rows, fill, np.int32) for fill in (-1, 0, 0, -1)))
    uploads = {}
    for i, (j, row, seq, drafts, appends) in batch.history.items():
        # A pending token (overlap) is on the device only: the row holds it, appended by the
        # step that sampled it; a row to upload never has one (a new or recomputed sequence).
        prompt_len, length = seq.get_prompt_len(), seq.get_len()
        if drafts:  # row j counts the outputs and the first j drafts
            if j == 0:  # the row holds the drafts past the sequence's tokens: sent again next step
                uploads[row] = seq.get_token_ids() + list(drafts)
                ib.history[row] = None
            history.rows[i], history.prompt_lens[i], history.lens[i] = row, prompt_len, length + j
            continue
        if ib.history[row] != (seq.seq_id, length):
            if seq.num_pending_tokens:
                raise RuntimeError(f"{seq}: its token-history row lacks its pending token")
            uploads[row] = seq.get_token_ids()
        history.rows[i], history.prompt_lens[i], history.lens[i] = row, prompt_len, length
        # The sampler appends a lone sample's token (a beam may take another token).
        if appends:
            history.dst_rows[i] = row
            ib.history[row] = (seq.seq_id, length + 1)
        else:
            ib.history[row] = None
    items = list(uploads.items())
    for start in range(0, len(items), HISTORY_UPLOAD_ROWS):
        chunk = items[start:start + HISTORY_UPLOAD_ROWS]
        upload_rows = np.full(HISTORY_UPLOAD_ROWS, -1, np.int32)
        tokens = np.full((HISTORY_UPLOAD_ROWS, fit(list(widths), max(len(ids) for _, ids in chunk))), -1, np.int32)
        for k, (row, ids) in enumerate(chunk):
            upload_rows[k] = row
            tokens[k, :len(ids)] = ids
        upload(upload_rows, tokens)
    return history
