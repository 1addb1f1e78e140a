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


class LanePlan:
    """What a plan tells the runner about its lane part (the plan's first `n` groups)."""

    __slots__ = ("version", "step", "n", "keep", "grown", "start")

    def __init__(self, version: int, step: int, n: int, keep, grown, start):
        self.version, self.step, self.n = version, step, n
        self.keep = keep  # bool[rows of the lane's previous plan]: still in it (None: all)
        self.grown = grown  # lane rows whose block table grew this step (int array; None: step 0)
        self.start = start  # int64[n]: each row's position (tokens computed before the step)


class DecodeLane:
    """The scheduler's steady decode lane (module docstring)."""

    _versions = itertools.count(1)

    def __init__(self, groups: list[SequenceGroup], scheduled: list[ScheduledSequenceGroup], block_manager):
        self.version, self.step = next(self._versions), 0
        self.groups = groups
        self.seqs = [g.seqs[0] for g in groups]
        self.scheduled = scheduled
        self.tables = [block_manager.gpu_tables[s.seq_id] for s in self.seqs]
        self.loras = [g.lora_request for g in groups]
        self.keep = None  # rows kept since the last lane plan (None: all)

    def __len__(self) -> int:
        return len(self.groups)

    def matches(self, running) -> bool:
        """The running queue is the lane: the same groups in the same order."""
        return len(running) == len(self.groups) and all(map(operator.is_, running, self.groups))

    def first_plan(self) -> LanePlan:
        """The plan that formed the lane (scheduled the general way) is its step 0."""
        return LanePlan(self.version, 0, len(self.groups), None, None,
                        np.fromiter(map(_computed, self.seqs), np.int64, len(self.seqs)))

    def schedule(self, out: SchedulerOutputs, block_manager) -> bool:
        """The lane's next decode step into `out` (False, nothing done: blocks are short)."""
        bm, seqs, n = block_manager, self.seqs, len(self.seqs)
        size = bm.block_size
        start = np.fromiter(map(_computed, seqs), np.int64, n)  # each sequence's one token's position
        table_len = np.fromiter(map(len, self.tables), np.int64, n)
        index = start // size
        grown = np.flatnonzero(index >= table_len)
        pool = bm.gpu_pool
        if len(grown) > pool.get_num_free_blocks() or (index[grown] > table_len[grown]).any():
            return False  # the general path decides (preemption)
        tables = self.tables
        for i in grown.tolist():
            tables[i].append(pool.allocate())
        if bm.enable_caching:  # (_decode_one's cache_full_blocks, where a block fills)
            end = start + 1 - np.fromiter(map(_pending, seqs), np.int64, n)
            loras = self.loras
            for i in np.flatnonzero(end % size == 0).tolist():
                bm.cache_full_blocks(seqs[i], int(end[i]), loras[i])
        for scheduled, s in zip(self.scheduled, start.tolist()):
            scheduled.start = s
        out.scheduled_seq_groups = list(self.scheduled)
        out.num_batched_tokens += n
        self.step += 1
        out.lane = LanePlan(self.version, self.step, n, self.keep, grown, start)
        self.keep = None
        return True

    def drop(self, keep: list[bool]):
        """Finished groups leave the lane (their rows: `keep` False); the runner is told with
        the next lane plan."""
        self.groups, self.seqs, self.scheduled, self.tables, self.loras = (
            list(itertools.compress(a, keep)) for a in (self.groups, self.seqs, self.scheduled, self.tables,
                                                         self.loras))
        keep = np.asarray(keep, np.bool_)
        if self.keep is not None:  # (a second drop before the next plan: relative to the first's rows)
            full = self.keep.copy()
            full[full] = keep
            keep = full
        self.keep = keep

    def check(self, block_manager):
        """Debug mode: what the lane assumes of its sequences holds."""
        for group, seq, table in zip(self.groups, self.seqs, self.tables):
            assert len(group.seqs) == 1 and group.seqs[0] is seq, group
            assert block_manager.gpu_tables.get(seq.seq_id) is table, seq
            if seq.status is SequenceStatus.RUNNING:  # (one token to compute: the next step's)
                assert seq.get_len() - seq.num_computed_tokens == 1, seq
