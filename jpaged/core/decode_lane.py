"""The steady decode lane: a step that is the last one's decode again, sent as a diff (vLLM v1's
SchedulerOutput applied by the runner to its persistent InputBatch, gpu_input_batch.py).

When every running group is a lone sequence decoding one token the plain way (the scheduler's
`_decode_one`) and all of them were scheduled, the scheduler keeps them as a `DecodeLane` (its
own: the groups in running order, their sequences, their ScheduledSequenceGroups, their block
tables). While the running queue is that lane again (the same groups in the same order; finished
ones dropped by `drop`), the next step is scheduled from it as arrays: each sequence's position
read at once, a block appended only where the position starts one, the prefix cache told only
where a block fills; the plan's ScheduledSequenceGroups are the lane's, their `start` moved on.
Anything else (an admission, a preemption, a swap, an abort, drafts, lookahead slots) takes the
general path, which forms a new lane when its plan is one.

The plan carries a `LanePlan` for the runner: the lane's version and step (the runner applies a
step's diff only to the arrays of the step before it, else it builds the general way), which of
the last lane plan's rows are still there (`keep`), which rows' tables grew (`grown`) and each
row's position (`start`). The Sequences stay the owner of their state: the lane reads them (and
`check` compares what it assumes with them, in debug mode), it keeps no copy of a counter.

Why a lane sequence's next slot needs no copy-on-write: it lies in the block the previous lane
step wrote (checked when the lane formed) or in a block the lane just allocated; neither can be
shared meanwhile (the prefix cache shares only full blocks, and a block is full only once the
token written into it is known; forks and beams are not in the lane).
"""

import itertools
import operator

import numpy as np

from jpaged.core.scheduler_output import ScheduledSequenceGroup, SchedulerOutputs
from jpaged.core.sequence import SequenceGroup, SequenceStatus

_computed = operator.attrgetter("num_computed_tokens")
_pending = operator.attrgetter("num_pending_tokens")


class LaneRows:
    """The lane's rows as of one plan (replaced, never changed, when rows leave): the groups,
    their sequences, ScheduledSequenceGroups, block tables and LoRA requests, and what each row's
    update needs of its SamplingParams as arrays: whether its token may be appended inline
    (`inline`: no grammar, top logprobs or stop strings to check), its length cap (max_tokens or
    max_model_len, as output tokens), whether EOS stops it, its stop_token_ids (-1 padded)."""

    __slots__ = ("groups", "seqs", "scheduled", "tables", "loras", "prompt_len", "inline", "cap", "eos",
                 "stop_ids", "host_tokens")

    def __init__(self, groups, seqs, scheduled, tables, loras, prompt_len, inline, cap, eos, stop_ids, host_tokens):
        self.groups, self.seqs, self.scheduled, self.tables, self.loras = groups, seqs, scheduled, tables, loras
        self.prompt_len, self.inline, self.cap, self.eos, self.stop_ids = prompt_len, inline, cap, eos, stop_ids
        self.host_tokens = host_tokens  # bool[n]: the row's next step needs its token on the host (no overlap)

    @classmethod
    def of(cls, groups: list[SequenceGroup], scheduled: list[ScheduledSequenceGroup], block_manager, stop_checker):
        n, texts, gpu_tables = len(groups), stop_checker.detokenizer is not None, block_manager.gpu_tables
        seqs, tables, loras, columns, stops = [], [], [], [], []
        for g in groups:  # (one pass: a lane forms after every step that changed the batch)
            seq, sp = g.seqs[0], g.sampling_params
            seqs.append(seq)
            tables.append(gpu_tables[seq.seq_id])
            loras.append(g.lora_request)
            columns.append((len(seq.prompt_token_ids), sp.max_tokens, not (sp.guided or sp.logprobs is not None
                                                                          or (sp.stop and texts)),
                            not sp.ignore_eos, g.needs.host_tokens))
            stops.append(sp.stop_token_ids)
        prompt_len, max_tokens, inline, eos, host = (np.array(c, dtype) for c, dtype in zip(
            zip(*columns), (np.int64, np.int64, np.bool_, np.bool_, np.bool_))) if n else \
            (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.bool_), np.zeros(0, np.bool_),
             np.zeros(0, np.bool_))
        width = max(map(len, stops), default=0)
        stop_ids = None
        if width:
            stop_ids = np.full((n, width), -1, np.int64)
            for i, ids in enumerate(stops):
                stop_ids[i, :len(ids)] = ids
        return cls(groups, seqs, scheduled, tables, loras, prompt_len, inline,
                   np.minimum(max_tokens, stop_checker.max_model_len - prompt_len), eos, stop_ids, host)

    def kept(self, keep: list[bool]) -> "LaneRows":
        mask = np.asarray(keep, np.bool_)
        lists = (list(itertools.compress(a, keep)) for a in (self.groups, self.seqs, self.scheduled, self.tables,
                                                               self.loras))
        return LaneRows(*lists, self.prompt_len[mask], self.inline[mask], self.cap[mask], self.eos[mask],
                        None if self.stop_ids is None else self.stop_ids[mask], self.host_tokens[mask])


class LanePlan:
    """What a plan tells the runner (and the scheduler's update) about its lane part: the plan's
    first `n` groups, `rows`."""

    __slots__ = ("version", "step", "n", "keep", "grown", "start", "rows")

    def __init__(self, version: int, step: int, rows: LaneRows, keep, grown, start):
        self.version, self.step, self.rows, self.n = version, step, rows, len(rows.groups)
        self.keep = keep  # bool[rows of the lane's previous plan]: still in it (None: all)
        self.grown = grown  # lane rows whose block table grew this step (int array; None: step 0)
        self.start = start  # int64[n]: each row's position (tokens computed before the step)


class DecodeLane:
    """The scheduler's steady decode lane (module docstring)."""

    _versions = itertools.count(1)

    def __init__(self, groups: list[SequenceGroup], scheduled: list[ScheduledSequenceGroup], block_manager,
                 stop_checker):
        self.version, self.step = next(self._versions), 0
        self.rows = LaneRows.of(groups, scheduled, block_manager, stop_checker)
        self.keep = None  # rows kept since the last lane plan (None: all)

    def __len__(self) -> int:
        return len(self.rows.groups)

    def matches(self, running) -> bool:
        """The running queue is the lane: the same groups in the same order."""
        groups = self.rows.groups
        return len(running) == len(groups) and all(map(operator.is_, running, groups))

    def first_plan(self) -> LanePlan:
        """The plan that formed the lane (scheduled the general way) is its step 0."""
        seqs = self.rows.seqs
        return LanePlan(self.version, 0, self.rows, None, None, np.fromiter(map(_computed, seqs), np.int64, len(seqs)))

    def schedule(self, out: SchedulerOutputs, block_manager) -> bool:
        """The lane's next decode step into `out` (False, nothing done: blocks are short)."""
        bm, rows = block_manager, self.rows
        seqs, n, size = rows.seqs, len(rows.seqs), bm.block_size
        start = np.fromiter(map(_computed, seqs), np.int64, n)  # each sequence's one token's position
        table_len = np.fromiter(map(len, rows.tables), np.int64, n)
        index = start // size
        grown = np.flatnonzero(index >= table_len)
        pool = bm.gpu_pool
        if len(grown) > pool.get_num_free_blocks() or (index[grown] > table_len[grown]).any():
            return False  # the general path decides (preemption)
        tables = rows.tables
        for i in grown.tolist():
            tables[i].append(pool.allocate())
        if bm.enable_caching:  # (_decode_one's cache_full_blocks, where a block fills)
            end = start + 1 - np.fromiter(map(_pending, seqs), np.int64, n)
            loras = rows.loras
            for i in np.flatnonzero(end % size == 0).tolist():
                bm.cache_full_blocks(seqs[i], int(end[i]), loras[i])
        for scheduled, s in zip(rows.scheduled, start.tolist()):
            scheduled.start = s
        out.scheduled_seq_groups = list(rows.scheduled)
        out.num_batched_tokens += n
        self.step += 1
        out.lane = LanePlan(self.version, self.step, rows, self.keep, grown, start)
        self.keep = None
        return True

    def drop(self, keep: list[bool]):
        """Finished groups leave the lane (their rows: `keep` False); the runner is told with
        the next lane plan."""
        self.rows = self.rows.kept(keep)
        keep = np.asarray(keep, np.bool_)
        if self.keep is not None:  # (a second drop before the next plan: relative to the first's rows)
            full = self.keep.copy()
            full[full] = keep
            keep = full
        self.keep = keep

    def check(self, block_manager):
        """Debug mode: what the lane assumes of its sequences holds."""
        rows = self.rows
        for group, seq, table in zip(rows.groups, rows.seqs, rows.tables):
            assert len(group.seqs) == 1 and group.seqs[0] is seq, group
            assert block_manager.gpu_tables.get(seq.seq_id) is table, seq
            if seq.status is SequenceStatus.RUNNING:  # (one token to compute: the next step's)
                assert seq.get_len() - seq.num_computed_tokens == 1, seq


def whole(lane: LanePlan | None, results) -> bool:
    """`results` ((ScheduledSequenceGroup, ...) each, in plan order: a subsequence of the plan's
    groups) are the lane plan's rows, all of them and nothing else."""
    return lane is not None and lane.n > 0 and len(results) == lane.n and results[-1][0] is lane.rows.scheduled[-1]


def dispatched(lane: LanePlan, results) -> bool:
    """The lane plan's step was dispatched whole: its tokens count as computed (on_dispatched for
    each row: one token, one pending sample). False: the caller goes group by group."""
    if not whole(lane, results):
        return False
    for seq in lane.rows.seqs:
        seq.num_computed_tokens += 1
        seq.num_pending_tokens += 1
    return True
