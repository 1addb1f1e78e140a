"""The KV block manager (paper §4.2-4.5): block tables, reference counts, copy-on-write, swapping.

Each sequence holding KV state has a block table: the physical blocks holding its tokens, in
order (token i is in slot i % block_size of block table[i // block_size]). A table lives on
the device while its sequence runs and in host memory while it is swapped out. Blocks are
reference counted so sequences can share them (the forks of a request share its prompt); a
shared block is copied before a sharer writes into it.

Growth is on demand: a sequence gets a new block only when its last one is full. Admission
(allocate) covers every token the sequence has, so a prompt prefilled in chunks needs no more
blocks until it decodes; append_slots covers the token sampled in the last step.
"""

import collections
import enum
import math

from jpaged.core.sequence import Sequence, SequenceGroup, SequenceStatus


class NoFreeBlocksError(RuntimeError):
    """A pool ran out of blocks: the caller skipped the matching can_* check."""


class AllocStatus(enum.Enum):
    OK = enum.auto()  # fits now
    LATER = enum.auto()  # fits once other sequences release blocks
    NEVER = enum.auto()  # larger than the pool (less its watermark): can never fit


class Block:
    __slots__ = ("block_id", "ref_cnt")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0


class BlockPool:
    """Physical blocks 0..num_blocks-1 with reference counts and a queue of the free ones.

    The free queue hands out the least recently freed block first and can drop any block in
    O(1). That is what automatic prefix caching needs: freed blocks that hold a cached prefix
    stay in the queue (evicted in LRU order) and are pulled out of it again on a cache hit.
    """

    def __init__(self, num_blocks: int):
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: collections.OrderedDict[int, Block] = collections.OrderedDict(
            (block.block_id, block) for block in self.blocks)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def get_num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self) -> int:
        if not self.free_queue:
            raise NoFreeBlocksError(f"all {self.num_blocks} blocks are in use")
        _, block = self.free_queue.popitem(last=False)
        block.ref_cnt = 1
        return block.block_id

    def share(self, block_id: int):
        block = self._get(block_id)
        if block.ref_cnt == 0:
            raise ValueError(f"block {block_id} is free: it cannot be shared")
        block.ref_cnt += 1

    def free(self, block_id: int):
        """Drop one reference; the block returns to the free queue with its last one."""
        block = self._get(block_id)
        if block.ref_cnt == 0:
            raise ValueError(f"double free of block {block_id}")
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.free_queue[block_id] = block

    def ref_cnt(self, block_id: int) -> int:
        return self._get(block_id).ref_cnt

    def _get(self, block_id: int) -> Block:
        if not 0 <= block_id < len(self.blocks):
            raise ValueError(f"unknown block {block_id} (the pool has {len(self.blocks)})")
        return self.blocks[block_id]


class BlockManager:
    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int, watermark: float = 0.01):
        if block_size < 1 or num_gpu_blocks < 1 or num_cpu_blocks < 0 or not 0 <= watermark < 1:
            raise ValueError(f"bad block manager sizes: block_size={block_size}, num_gpu_blocks={num_gpu_blocks}, "
                             f"num_cpu_blocks={num_cpu_blocks}, watermark={watermark}")
        self.block_size = block_size
        self.gpu_pool = BlockPool(num_gpu_blocks)
        self.cpu_pool = BlockPool(num_cpu_blocks)
        # Admissions leave this many device blocks free, so the sequences already running can
        # grow for a while without preempting the newcomers at once.
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.gpu_tables: dict[int, list[int]] = {}  # seq_id -> device block ids
        self.cpu_tables: dict[int, list[int]] = {}  # seq_id -> host block ids (swapped out)

    @property
    def num_gpu_blocks(self) -> int:
        return self.gpu_pool.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu_pool.num_blocks

    def get_num_free_gpu_blocks(self) -> int:
        return self.gpu_pool.get_num_free_blocks()

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu_pool.get_num_free_blocks()

    def get_block_table(self, seq: Sequence) -> list[int]:
        """The sequence's device blocks (the manager's own list: read it, don't change it)."""
        if seq.seq_id not in self.gpu_tables:
            raise ValueError(f"{seq} has no blocks on the device")
        return self.gpu_tables[seq.seq_id]

    def _num_blocks(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    # Admission.

    def _allocation_plan(self, seq_group: SequenceGroup) -> tuple[list[Sequence], int]:
        """The waiting sequences, and how many leading blocks they can all share.

        A fresh request has one sequence. A group preempted by recompute after forking has
        several that share their prompt and maybe more: the full blocks of their common prefix
        are shared again (the prefill of each sequence writes the same K/V there). The block
        holding a sequence's last token is never shared, so a shared block is only ever
        written by a sequence after copy-on-write.
        """
        seqs = seq_group.get_seqs(SequenceStatus.WAITING)
        if not seqs:
            raise ValueError(f"{seq_group} has no waiting sequences to allocate")
        token_ids = [seq.get_token_ids() for seq in seqs]
        common = min(len(ids) for ids in token_ids) - 1
        for ids in token_ids[1:]:
            common = next((i for i in range(common) if ids[i] != token_ids[0][i]), common)
        return seqs, common // self.block_size

    def _num_required_blocks(self, seqs: list[Sequence], num_shared: int) -> int:
        return num_shared + sum(self._num_blocks(seq.get_len()) - num_shared for seq in seqs)

    def _fit(self, num_required: int, num_free: int) -> AllocStatus:
        if self.num_gpu_blocks - num_required < self.watermark_blocks:
            return AllocStatus.NEVER
        if num_free - num_required >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def can_allocate(self, seq_group: SequenceGroup) -> AllocStatus:
        seqs, num_shared = self._allocation_plan(seq_group)
        return self._fit(self._num_required_blocks(seqs, num_shared), self.get_num_free_gpu_blocks())

    def allocate(self, seq_group: SequenceGroup):
        """Device blocks for every token of the group's waiting sequences."""
        seqs, num_shared = self._allocation_plan(seq_group)
        for seq in seqs:
            if seq.seq_id in self.gpu_tables or seq.seq_id in self.cpu_tables:
                raise ValueError(f"{seq} already has blocks")
        num_required = self._num_required_blocks(seqs, num_shared)
        if num_required > self.get_num_free_gpu_blocks():
            raise NoFreeBlocksError(f"{seq_group} needs {num_required} blocks, "
                                    f"{self.get_num_free_gpu_blocks()} are free")
        shared = [self.gpu_pool.allocate() for _ in range(num_shared)]
        for i, seq in enumerate(seqs):
            if i > 0:
                for block_id in shared:
                    self.gpu_pool.share(block_id)
            own = [self.gpu_pool.allocate() for _ in range(self._num_blocks(seq.get_len()) - num_shared)]
            self.gpu_tables[seq.seq_id] = shared + own

    # Decoding.

    def _num_blocks_to_append(self, seqs: list[Sequence], tables: dict[int, list[int]], pool: BlockPool) -> int:
        """Exactly how many new blocks append_slots takes for these sequences (wherever their
        tables are now: swapping keeps the sharing)."""
        num_required = 0
        sharers = collections.Counter()  # shared last block -> how many of these sequences write into it
        for seq in seqs:
            table = tables[seq.seq_id]
            missing = self._num_blocks(seq.get_len()) - len(table)
            if missing:
                num_required += missing
            elif pool.ref_cnt(table[-1]) > 1:
                sharers[table[-1]] += 1
        # The last sharer of a block to write keeps it, unless someone else holds it too.
        return num_required + sum(min(k, pool.ref_cnt(b) - 1) for b, k in sharers.items())

    def can_append_slots(self, seq_group: SequenceGroup) -> bool:
        """Whether append_slots can run for every running sequence of the group."""
        seqs = seq_group.get_seqs(SequenceStatus.RUNNING)
        return self._num_blocks_to_append(seqs, self.gpu_tables, self.gpu_pool) <= self.get_num_free_gpu_blocks()

    def append_slots(self, seq: Sequence) -> list[tuple[int, int]]:
        """Make room for the sequence's tokens after it grew (normally by the token sampled last
        step). Returns the (src, dst) block copies to make first: a shared block is copied
        before this sequence writes into it (copy-on-write)."""
        table = self.gpu_tables[seq.seq_id]
        missing = self._num_blocks(seq.get_len()) - len(table)
        if missing:
            if missing > self.get_num_free_gpu_blocks():
                raise NoFreeBlocksError(f"{seq} needs {missing} blocks, {self.get_num_free_gpu_blocks()} are free")
            table.extend(self.gpu_pool.allocate() for _ in range(missing))
            return []
        # Only the last block can be shared and still be written (see _allocation_plan).
        last = table[-1]
        if self.gpu_pool.ref_cnt(last) == 1:
            return []
        table[-1] = self.gpu_pool.allocate()
        self.gpu_pool.free(last)
        return [(last, table[-1])]

    def fork(self, parent: Sequence, child: Sequence):
        """The child shares all of the parent's blocks."""
        if child.seq_id in self.gpu_tables or child.seq_id in self.cpu_tables:
            raise ValueError(f"{child} already has blocks")
        table = self.get_block_table(parent)
        for block_id in table:
            self.gpu_pool.share(block_id)
        self.gpu_tables[child.seq_id] = list(table)

    def free(self, seq: Sequence):
        """Release the sequence's blocks, on the device or in host memory."""
        if seq.seq_id in self.gpu_tables:
            pool, table = self.gpu_pool, self.gpu_tables.pop(seq.seq_id)
        elif seq.seq_id in self.cpu_tables:
            pool, table = self.cpu_pool, self.cpu_tables.pop(seq.seq_id)
        else:
            raise ValueError(f"{seq} has no blocks to free (freed twice?)")
        for block_id in table:
            pool.free(block_id)

    # Swapping. A block shared by several sequences of the group moves once and keeps its
    # reference count.

    def _distinct_blocks(self, tables: dict[int, list[int]], seqs: list[Sequence]) -> set[int]:
        return {block_id for seq in seqs for block_id in tables[seq.seq_id]}

    def can_swap_out(self, seq_group: SequenceGroup) -> bool:
        blocks = self._distinct_blocks(self.gpu_tables, seq_group.get_seqs(SequenceStatus.RUNNING))
        return len(blocks) <= self.get_num_free_cpu_blocks()

    def swap_out(self, seq_group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the running sequences' blocks to host memory; returns the (gpu, cpu) copies."""
        return self._move(seq_group.get_seqs(SequenceStatus.RUNNING), self.gpu_tables, self.gpu_pool,
                          self.cpu_tables, self.cpu_pool)

    def can_swap_in(self, seq_group: SequenceGroup) -> AllocStatus:
        seqs = seq_group.get_seqs(SequenceStatus.SWAPPED)
        # Its blocks, and those it takes at once for the token it was about to compute.
        num_required = (len(self._distinct_blocks(self.cpu_tables, seqs))
                        + self._num_blocks_to_append(seqs, self.cpu_tables, self.cpu_pool))
        return self._fit(num_required, self.get_num_free_gpu_blocks())

    def swap_in(self, seq_group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the swapped sequences' blocks back to the device; returns the (cpu, gpu) copies."""
        return self._move(seq_group.get_seqs(SequenceStatus.SWAPPED), self.cpu_tables, self.cpu_pool,
                          self.gpu_tables, self.gpu_pool)

    def _move(self, seqs, src_tables, src_pool, dst_tables, dst_pool) -> list[tuple[int, int]]:
        num_required = len(self._distinct_blocks(src_tables, seqs))
        if num_required > dst_pool.get_num_free_blocks():
            raise NoFreeBlocksError(f"moving {num_required} blocks, {dst_pool.get_num_free_blocks()} are free")
        mapping: dict[int, int] = {}  # src block -> dst block
        for seq in seqs:
            for block_id in src_tables[seq.seq_id]:
                if block_id in mapping:
                    dst_pool.share(mapping[block_id])
                else:
                    mapping[block_id] = dst_pool.allocate()
                src_pool.free(block_id)
            dst_tables[seq.seq_id] = [mapping[block_id] for block_id in src_tables.pop(seq.seq_id)]
        return list(mapping.items())

    def check_invariants(self):
        """Raise AssertionError unless every block's reference count equals the number of block
        tables holding it, and exactly the blocks nobody holds are free."""
        for pool, tables in ((self.gpu_pool, self.gpu_tables), (self.cpu_pool, self.cpu_tables)):
            holders = collections.Counter(block_id for table in tables.values() for block_id in table)
            for block in pool.blocks:
                if block.ref_cnt != holders[block.block_id]:
                    raise AssertionError(f"block {block.block_id}: ref_cnt {block.ref_cnt}, "
                                         f"held by {holders[block.block_id]} tables")
                if (block.ref_cnt == 0) != (block.block_id in pool.free_queue):
                    raise AssertionError(f"block {block.block_id}: ref_cnt {block.ref_cnt} but "
                                         f"{'' if block.block_id in pool.free_queue else 'not '}in the free queue")
