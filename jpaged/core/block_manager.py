"""The KV block manager (paper §4.2-4.5): block tables, reference counts, copy-on-write, swapping.

Each sequence holding KV state has a block table: the physical blocks holding its tokens, in
order (token i is in slot i % block_size of block table[i // block_size]). A table lives on
the device while its sequence runs and in host memory while it is swapped out. Blocks are
reference counted so sequences can share them (the forks of a request share its prompt); a
shared block is copied before a sharer writes into it.

Growth is on demand: a sequence gets a new block only when its last one is full. Admission
(allocate) covers every token the sequence has, so a prompt prefilled in chunks needs no more
blocks until it decodes; append_slots covers the token sampled in the last step (and, for
multi-step decode, the lookahead slots of the tokens the next steps sample on the device).

Automatic prefix caching (enable_caching, vLLM v1's design): a full, computed block is found by
a hash chained over the previous block's hash and its own token ids, so equal hashes mean equal
prefixes. Admission maps a sequence's leading full blocks onto cached ones, and only the rest is
computed. A block whose last holder lets go keeps its hash and sits in the free queue; it is
evicted (its hash forgotten) only when the pool hands it out again, least recently freed first.
A sequence frees its blocks tail first, so of blocks freed together the longest prefix goes first.
Full blocks are never written again, which is what makes them safe to share this way.

For benchmarks, kv_allocation picks one of the paper's baselines instead of on-demand growth
(a KVAllocation strategy from kv_allocation.py, chosen at construction): admission then takes the
request's whole reservation at once.

The physical blocks themselves (reference counts, free queue, prefix-cache map) are the
BlockPool's (block_pool.py); this module keeps the tables and decides what the pools do.

Sliding window (sliding_window set: every layer of the model is windowed): a sequence's blocks
that hold only keys before the window of the next token it computes go back to the pool, as in
vLLM; their table entries become FREED_BLOCK, which the kernels never read.
"""

import array
import collections
import enum
import hashlib

from jpaged.core.block_pool import BlockPool, NoFreeBlocksError
from jpaged.core.kv_allocation import kv_allocation_policy
from jpaged.core.sequence import Sequence, SequenceGroup, SequenceStatus
from jpaged.kv_events.events import MEDIUM_GPU, BlockStored, external_block_hash


FREED_BLOCK = -1  # a table entry whose block fell out of the sliding window and was freed


def held(table: list[int]) -> list[int]:
    """The blocks a table holds (without the entries freed out of the window)."""
    return [block_id for block_id in table if block_id != FREED_BLOCK]


class AllocStatus(enum.Enum):
    OK = enum.auto()  # fits now
    LATER = enum.auto()  # fits once other sequences release blocks
    NEVER = enum.auto()  # larger than the pool (less its watermark): can never fit


def hash_block_tokens(parent_hash: bytes | None, token_ids: list[int], extra_keys: tuple = ()) -> bytes:
    """A full block's prefix-cache key: sha256 over the previous block's hash and this block's
    tokens (a digest this wide never collides in practice, so a hit is never a wrong prefix), and
    its `extra_keys` (vLLM's: the content hashes of the images whose tokens it holds)."""
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array.array("q", token_ids).tobytes())
    for key in extra_keys:
        digest.update(b"\0" + str(key).encode())
    return digest.digest()


def block_extra_keys(seq: Sequence, start: int, end: int) -> tuple:
    """The mm_hashes of the images whose placeholder tokens lie in positions [start, end) of `seq`
    (`seq.mm_ranges`: (offset, length, mm_hash) per image, set by multimodal/runner.py)."""
    return tuple(h for offset, length, h in getattr(seq, "mm_ranges", ()) if offset < end and start < offset + length)


class BlockManager:
    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int, watermark: float = 0.01,
                 enable_caching: bool = False, kv_allocation: str = "paged", max_model_len: int | None = None,
                 sliding_window: int | None = None):
        if block_size < 1 or num_gpu_blocks < 1 or num_cpu_blocks < 0 or not 0 <= watermark < 1:
            raise ValueError(f"bad block manager sizes: block_size={block_size}, num_gpu_blocks={num_gpu_blocks}, "
                             f"num_cpu_blocks={num_cpu_blocks}, watermark={watermark}")
        self.allocation = kv_allocation_policy(kv_allocation, max_model_len, enable_caching)
        self.kv_allocation = kv_allocation  # the policy's name: the scheduler batches per request for "static"
        self.block_size = block_size
        self.gpu_pool = BlockPool(num_gpu_blocks)
        self.cpu_pool = BlockPool(num_cpu_blocks)
        # Admissions leave this many device blocks free, so the sequences already running can
        # grow for a while without preempting the newcomers at once.
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.gpu_tables: dict[int, list[int]] = {}  # seq_id -> device block ids
        self.cpu_tables: dict[int, list[int]] = {}  # seq_id -> host block ids (swapped out)
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self._num_hashed_blocks: dict[int, int] = {}  # seq_id -> leading device blocks already cached
        # Prefix cache lookups in TOKENS, as vLLM v1 counts them: each admitted sequence queries
        # all its tokens and hits the leading ones found in the cache.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

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

    def get_num_gpu_blocks_in_use(self) -> int:
        return self.num_gpu_blocks - self.get_num_free_gpu_blocks()

    def get_num_gpu_blocks_without_sharing(self) -> int:
        """Device blocks in use if nothing were shared: one per block table entry (the server asks
        after every step: without a sliding window no entry is ever freed, so the tables' lengths
        alone, not a pass over every entry)."""
        if self.sliding_window is None:
            return sum(map(len, self.gpu_tables.values()))
        return sum(len(held(table)) for table in self.gpu_tables.values())

    def reset_prefix_cache(self):
        """Drop every cached prefix; only between requests (no table holds a block)."""
        if self.gpu_tables or self.cpu_tables:
            raise ValueError("the prefix cache can be reset only when no request is running or swapped out")
        self.gpu_pool.reset_cache()

    def enable_kv_events(self):
        """Record the prefix cache's stores, evictions and clears for `take_events` (KV events)."""
        self.gpu_pool.events = []

    def take_events(self) -> list:
        """The KV events since the last call, oldest first (none when events are off)."""
        events = self.gpu_pool.events
        if not events:
            return []
        self.gpu_pool.events = []
        return events

    def get_num_cached_gpu_blocks(self) -> int:
        return self.gpu_pool.get_num_cached_blocks()

    @property
    def max_blocks_per_group(self) -> int:
        """The most blocks one sequence group can ever hold: admission leaves the watermark free."""
        return self.num_gpu_blocks - self.watermark_blocks

    def max_blocks_needed(self, prompt_len: int, max_len: int, num_seqs: int) -> int:
        """Blocks a group of `num_seqs` sequences needs at worst once each is `max_len` tokens long:
        they share only their prompt's full blocks (what they share again after a recompute)."""
        shared = prompt_len // self.block_size if num_seqs > 1 else 0
        return shared + num_seqs * (self._num_blocks(self.allocation.held_len(max_len)) - shared)

    def get_block_table(self, seq: Sequence) -> list[int]:
        """The sequence's device blocks (the manager's own list: read it, don't change it)."""
        if seq.seq_id not in self.gpu_tables:
            raise ValueError(f"{seq} has no blocks on the device")
        return self.gpu_tables[seq.seq_id]

    def _num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil in integers

    def _admission_blocks(self, seq_group: SequenceGroup, seq: Sequence) -> int:
        """Blocks the sequence holds once admitted: for its tokens, or its whole reservation."""
        return self._num_blocks(self.allocation.admission_len(seq, seq_group.sampling_params.max_tokens))

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

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The prefix hashes of the sequence's first `num_blocks` (full) blocks; each is computed
        once and kept on the sequence, whose tokens never change."""
        hashes, size = seq.block_hashes, self.block_size
        if len(hashes) < num_blocks:
            token_ids = seq.get_token_ids()
            for i in range(len(hashes), num_blocks):
                hashes.append(hash_block_tokens(hashes[-1] if hashes else seq.cache_salt,
                                                token_ids[i * size:(i + 1) * size],
                                                block_extra_keys(seq, i * size, (i + 1) * size)))
        return hashes[:num_blocks]

    def _cached_prefix(self, seq_group: SequenceGroup, seqs: list[Sequence]) -> list[list[int]]:
        """Per sequence, the cached blocks holding its leading tokens; as many for each, since a
        group computes in lockstep. The block of a sequence's last token is never taken from the
        cache: that token must be computed for the logits of the next (vLLM v1 does the same), and
        the block holding it is the one it will write into."""
        # Prompt logprobs come from computing the prompt: a request that asks for them takes no hits.
        if not self.enable_caching or seq_group.sampling_params.prompt_logprobs is not None:
            return [[] for _ in seqs]
        hits = []
        for seq in seqs:
            blocks = []
            for block_hash in self._block_hashes(seq, (seq.get_len() - 1) // self.block_size):
                block_id = self.gpu_pool.get_cached_block(block_hash)
                if block_id is None:
                    break
                blocks.append(block_id)
            hits.append(blocks)
        num_cached = min(len(blocks) for blocks in hits)
        return [blocks[:num_cached] for blocks in hits]

    def _admission(self, seq_group: SequenceGroup):
        """What allocate would do: (sequences, leading blocks they share, cached blocks per
        sequence, new blocks to take from the free queue, free blocks left for them once the hits
        are taken out, all blocks the group will hold)."""
        seqs, num_shared = self._allocation_plan(seq_group)
        cached = self._cached_prefix(seq_group, seqs)
        num_cached = len(cached[0])
        first_own = max(num_shared, num_cached)
        num_new = first_own - num_cached + sum(self._admission_blocks(seq_group, seq) - first_own for seq in seqs)
        # Hits on blocks nobody holds take them out of the free queue.
        hit_blocks = {block_id for blocks in cached for block_id in blocks}
        num_free = self.get_num_free_gpu_blocks() - sum(1 for b in hit_blocks if self.gpu_pool.ref_cnt(b) == 0)
        return seqs, num_shared, cached, num_new, num_free, num_new + len(hit_blocks)

    def _fit(self, num_required: int, num_free: int, num_total: int | None = None) -> AllocStatus:
        """`num_total`: every block the request holds, new or not (default: `num_required`)."""
        if self.num_gpu_blocks - (num_required if num_total is None else num_total) < self.watermark_blocks:
            return AllocStatus.NEVER
        if num_free - num_required >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def can_allocate(self, seq_group: SequenceGroup) -> AllocStatus:
        _, _, _, num_new, num_free, num_total = self._admission(seq_group)
        return self._fit(num_new, num_free, num_total)

    def allocate(self, seq_group: SequenceGroup) -> int:
        """Device blocks for every token of the group's waiting sequences, cached ones for their
        leading tokens when prefix caching finds them. Returns how many leading tokens of each
        sequence are cached: their K/V need no computing."""
        seqs, num_shared, cached, num_new, num_free, _ = self._admission(seq_group)
        for seq in seqs:
            if seq.seq_id in self.gpu_tables or seq.seq_id in self.cpu_tables:
                raise ValueError(f"{seq} already has blocks")
        if num_new > num_free:
            raise NoFreeBlocksError(f"{seq_group} needs {num_new} blocks, {num_free} are free")
        # Take the hits before allocating, which could evict them.
        for blocks in cached:
            for block_id in blocks:
                self.gpu_pool.touch(block_id)
        num_cached = len(cached[0])
        first_own = max(num_shared, num_cached)
        shared = [self.gpu_pool.allocate() for _ in range(first_own - num_cached)]
        for i, (seq, hits) in enumerate(zip(seqs, cached)):
            if i > 0:
                for block_id in shared:
                    self.gpu_pool.share(block_id)
            own = [self.gpu_pool.allocate() for _ in range(self._admission_blocks(seq_group, seq) - first_own)]
            self.gpu_tables[seq.seq_id] = hits + shared + own
            self._num_hashed_blocks[seq.seq_id] = num_cached
            if self.enable_caching:
                self.prefix_cache_queries += seq.get_len()
                self.prefix_cache_hits += num_cached * self.block_size
        return num_cached * self.block_size

    def cache_full_blocks(self, seq: Sequence, num_computed_tokens: int, lora=None):
        """Prefix caching: the sequence's first `num_computed_tokens` tokens are computed (or will
        be by the end of this step); make the full blocks among them findable by hash. `lora`: the
        sequence's LoRARequest, named in KV events."""
        if not self.enable_caching:
            return
        num_full = num_computed_tokens // self.block_size
        start = self._num_hashed_blocks[seq.seq_id]
        if num_full <= start:
            return
        table, hashes = self.gpu_tables[seq.seq_id], self._block_hashes(seq, num_full)
        stored = [i for i in range(start, num_full)  # (a FREED_BLOCK: swapped back in after its window moved on)
                  if table[i] != FREED_BLOCK and self.gpu_pool.cache(table[i], hashes[i])]
        self._num_hashed_blocks[seq.seq_id] = num_full
        if stored and self.gpu_pool.events is not None:
            self._stored_events(seq, hashes, stored, lora)

    def _stored_events(self, seq: Sequence, hashes: list[bytes], stored: list[int], lora):
        """One BlockStored per run of consecutive blocks cached now, chained to the block before it."""
        size, token_ids, runs = self.block_size, seq.get_token_ids(), []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            self.gpu_pool.events.append(BlockStored(
                [external_block_hash(hashes[i]) for i in run],
                external_block_hash(hashes[run[0] - 1]) if run[0] else None,
                token_ids[run[0] * size:(run[-1] + 1) * size], size,
                lora.lora_int_id if lora is not None else None, MEDIUM_GPU,
                lora.lora_name if lora is not None else None,
                [block_extra_keys(seq, i * size, (i + 1) * size) or None for i in run]
                if getattr(seq, "mm_ranges", None) else None))

    # Decoding.

    def _write_span(self, seq: Sequence, num_lookahead_slots: int) -> tuple[int, int]:
        """Table indices [first, end) of the blocks the sequence's next computed token and the
        lookahead slots after it (multi-step decode) write into; the table may not reach `end` yet.
        Computed once per call: this runs for every running sequence every step."""
        seq_len, size = seq.get_len(), self.block_size
        return (seq_len - 1) // size, -(-(seq_len + num_lookahead_slots) // size)

    def _num_blocks_to_append(self, seqs: list[Sequence], tables: dict[int, list[int]], pool: BlockPool,
                              num_lookahead_slots: int = 0) -> int:
        """Exactly how many new blocks append_slots takes for these sequences (wherever their
        tables are now: swapping keeps the sharing)."""
        num_required = 0
        # Shared block to write -> how many of these sequences write into it (a dict, not a
        # Counter: one is made per running group every step).
        sharers: dict[int, int] = {}
        # (_write_span and ref_cnt inlined: every running group, every step)
        blocks, size = pool.blocks, self.block_size
        for seq in seqs:
            table = tables[seq.seq_id]
            seq_len = len(seq.prompt_token_ids) + len(seq.output_token_ids) + seq.num_pending_tokens
            first, end = (seq_len - 1) // size, -(-(seq_len + num_lookahead_slots) // size)
            num_held = len(table)
            if end > num_held:
                num_required += end - num_held
                end = num_held  # (< 0: slots reserved ahead)
            for i in range(first, end):  # the written blocks: never out of the window, so held
                if blocks[table[i]].ref_cnt > 1:
                    sharers[table[i]] = sharers.get(table[i], 0) + 1
        if not sharers:
            return num_required
        # The last sharer of a block to write keeps it, unless someone else holds it too.
        return num_required + sum(min(k, pool.ref_cnt(b) - 1) for b, k in sharers.items())

    def num_blocks_to_append(self, seqs: list[Sequence], num_lookahead_slots: int = 0) -> int:
        """New device blocks append_slots takes for these running sequences."""
        return self._num_blocks_to_append(seqs, self.gpu_tables, self.gpu_pool, num_lookahead_slots)

    def can_append_slots(self, seq_group: SequenceGroup, num_lookahead_slots: int = 0) -> bool:
        """Whether append_slots can run for every running sequence of the group."""
        seqs = seq_group.get_seqs(SequenceStatus.RUNNING)
        return self.num_blocks_to_append(seqs, num_lookahead_slots) <= self.get_num_free_gpu_blocks()

    def append_slots(self, seq: Sequence, num_lookahead_slots: int = 0) -> list[tuple[int, int]]:
        """Make room for the sequence's tokens after it grew (normally by the token sampled last
        step), and for `num_lookahead_slots` more tokens after them (multi-step decode writes
        them before the host has seen them). Returns the (src, dst) block copies to make first:
        a shared block is copied before this sequence writes into it (copy-on-write)."""
        table = self.gpu_tables[seq.seq_id]
        first, end = self._write_span(seq, num_lookahead_slots)
        copies = []
        blocks = self.gpu_pool.blocks
        for i in range(first, min(len(table), end)):
            shared = table[i]
            if blocks[shared].ref_cnt > 1:  # (ref_cnt inlined: a written block is held, so handed out)
                if not self.get_num_free_gpu_blocks():
                    raise NoFreeBlocksError(f"{seq} needs a block to copy block {shared} into; none is free")
                table[i] = self.gpu_pool.allocate()
                self.gpu_pool.free(shared)
                copies.append((shared, table[i]))
        missing = end - len(table)
        if missing > 0:
            if missing > self.get_num_free_gpu_blocks():
                raise NoFreeBlocksError(f"{seq} needs {missing} blocks, {self.get_num_free_gpu_blocks()} are free")
            table.extend(self.gpu_pool.allocate() for _ in range(missing))
        return copies

    def fork(self, parent: Sequence, child: Sequence):
        """The child shares all of the parent's blocks."""
        if child.seq_id in self.gpu_tables or child.seq_id in self.cpu_tables:
            raise ValueError(f"{child} already has blocks")
        table = self.get_block_table(parent)
        for block_id in held(table):
            self.gpu_pool.share(block_id)
        self.gpu_tables[child.seq_id] = list(table)
        self._num_hashed_blocks[child.seq_id] = self._num_hashed_blocks[parent.seq_id]

    def free(self, seq: Sequence):
        """Release the sequence's blocks, on the device or in host memory."""
        if seq.seq_id in self.gpu_tables:
            pool, table = self.gpu_pool, self.gpu_tables.pop(seq.seq_id)
        elif seq.seq_id in self.cpu_tables:
            pool, table = self.cpu_pool, self.cpu_tables.pop(seq.seq_id)
        else:
            raise ValueError(f"{seq} has no blocks to free (freed twice?)")
        for block_id in reversed(held(table)):  # tail first: evicted before the prefix it extends
            pool.free(block_id)
        self._num_hashed_blocks.pop(seq.seq_id, None)

    def free_out_of_window(self, seq: Sequence):
        """Sliding window: free the sequence's blocks that hold only keys no token from
        seq.num_computed_tokens on will see (before its window). The last block always stays."""
        if self.sliding_window is None:
            return
        table = self.gpu_tables[seq.seq_id]
        first_key = seq.num_computed_tokens - self.sliding_window + 1
        i = min(max(first_key, 0) // self.block_size, len(table) - 1) - 1
        while i >= 0 and table[i] != FREED_BLOCK:  # the freed entries are a prefix of the table
            self.gpu_pool.free(table[i])
            table[i] = FREED_BLOCK
            i -= 1

    # Swapping. A block shared by several sequences of the group moves once and keeps its
    # reference count.

    def _distinct_blocks(self, tables: dict[int, list[int]], seqs: list[Sequence]) -> set[int]:
        return {block_id for seq in seqs for block_id in held(tables[seq.seq_id])}

    def can_swap_out(self, seq_group: SequenceGroup) -> bool:
        blocks = self._distinct_blocks(self.gpu_tables, seq_group.get_seqs(SequenceStatus.RUNNING))
        return len(blocks) <= self.get_num_free_cpu_blocks()

    def swap_out(self, seq_group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the running sequences' blocks to host memory; returns the (gpu, cpu) copies. The
        device blocks left behind stay in the prefix cache until evicted."""
        seqs = seq_group.get_seqs(SequenceStatus.RUNNING)
        for seq in seqs:
            del self._num_hashed_blocks[seq.seq_id]
        return self._move(seqs, self.gpu_tables, self.gpu_pool, self.cpu_tables, self.cpu_pool)

    def can_swap_in(self, seq_group: SequenceGroup) -> AllocStatus:
        seqs = seq_group.get_seqs(SequenceStatus.SWAPPED)
        # Its blocks, and those it takes at once for the token it was about to compute.
        num_required = (len(self._distinct_blocks(self.cpu_tables, seqs))
                        + self._num_blocks_to_append(seqs, self.cpu_tables, self.cpu_pool))
        return self._fit(num_required, self.get_num_free_gpu_blocks())

    def swap_in(self, seq_group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the swapped sequences' blocks back to the device; returns the (cpu, gpu) copies.
        They are fresh blocks: cache_full_blocks hashes them again when the group is scheduled."""
        seqs = seq_group.get_seqs(SequenceStatus.SWAPPED)
        copies = self._move(seqs, self.cpu_tables, self.cpu_pool, self.gpu_tables, self.gpu_pool)
        for seq in seqs:
            self._num_hashed_blocks[seq.seq_id] = 0
        return copies

    def _move(self, seqs, src_tables, src_pool, dst_tables, dst_pool) -> list[tuple[int, int]]:
        num_required = len(self._distinct_blocks(src_tables, seqs))
        if num_required > dst_pool.get_num_free_blocks():
            raise NoFreeBlocksError(f"moving {num_required} blocks, {dst_pool.get_num_free_blocks()} are free")
        mapping: dict[int, int] = {}  # src block -> dst block
        for seq in seqs:
            table = src_tables.pop(seq.seq_id)
            for block_id in held(table):
                if block_id in mapping:
                    dst_pool.share(mapping[block_id])
                else:
                    mapping[block_id] = dst_pool.allocate()
            for block_id in reversed(held(table)):  # device blocks left behind stay cached, tail first
                src_pool.free(block_id)
            dst_tables[seq.seq_id] = [mapping.get(block_id, FREED_BLOCK) for block_id in table]
        return list(mapping.items())

    def check_invariants(self):
        """Raise AssertionError unless each pool agrees with the block tables holding its blocks
        (BlockPool.check_invariants lists what is checked)."""
        for pool, tables in ((self.gpu_pool, self.gpu_tables), (self.cpu_pool, self.cpu_tables)):
            pool.check_invariants(collections.Counter(block_id for table in tables.values() for block_id in held(table)))
