"""The block pool: a device's (or the host's) physical KV blocks and nothing else about them.

Its one job is the state of each block: reference count, membership of the free queue, and the
prefix-cache map from a full block's hash to the block holding it. Which sequence holds which
block (block tables, copy-on-write, swapping) is the block manager's (block_manager.py), as vLLM
v1 keeps block_pool.py apart from its KV cache manager.
"""

import collections

from jpaged.kv_events.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, external_block_hash


class NoFreeBlocksError(RuntimeError):
    """A pool ran out of blocks: the caller skipped the matching can_* check."""


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set while the block is in the prefix cache


class BlockPool:
    """Physical blocks 0..num_blocks-1 with reference counts and a queue of the free ones.

    The free queue hands out the least recently freed block first and can drop any block in
    O(1). That is what automatic prefix caching needs: freed blocks that hold a cached prefix
    stay in the queue (evicted in LRU order) and are pulled out of it again on a cache hit.
    Blocks never handed out yet come before all freed ones and exist only as a count, so a host
    pool of millions of small blocks (swap_space over a small model's blocks) costs nothing until
    it is used.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.blocks: list[Block] = []  # those handed out at least once: ids 0..len-1, in order
        self.free_queue: collections.OrderedDict[int, Block] = collections.OrderedDict()  # freed since
        self.cached_blocks: dict[bytes, Block] = {}  # prefix hash -> the block holding it
        self.num_cached_free = 0  # free-queue blocks that keep a cached prefix (kept as it changes)
        # KV events (jpaged/kv_events), when on: the prefix cache's changes not taken yet, in order.
        # The block manager adds the stores (it knows their tokens); evictions and clears are here.
        self.events: list | None = None

    def get_num_free_blocks(self) -> int:
        return self.num_blocks - len(self.blocks) + len(self.free_queue)

    def allocate(self) -> int:
        if len(self.blocks) < self.num_blocks:  # a block never used yet
            block = Block(len(self.blocks))
            self.blocks.append(block)
        elif self.free_queue:
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:  # evict the least recently used cached prefix
                if self.events is not None:
                    self.events.append(BlockRemoved([external_block_hash(block.block_hash)], MEDIUM_GPU))
                del self.cached_blocks[block.block_hash]
                block.block_hash = None
                self.num_cached_free -= 1
        else:
            raise NoFreeBlocksError(f"all {self.num_blocks} blocks are in use")
        block.ref_cnt = 1
        return block.block_id

    def get_cached_block(self, block_hash: bytes) -> int | None:
        block = self.cached_blocks.get(block_hash)
        return None if block is None else block.block_id

    def touch(self, block_id: int):
        """A prefix cache hit: one more reference, taking the block out of the free queue if nobody
        held it."""
        block = self._get(block_id)
        if block.block_hash is None:
            raise ValueError(f"block {block_id} is not cached")
        if block.ref_cnt == 0:
            del self.free_queue[block_id]
            self.num_cached_free -= 1
        block.ref_cnt += 1

    def cache(self, block_id: int, block_hash: bytes) -> bool:
        """Make a full, computed block findable by its prefix hash. The first block to hold a prefix
        stays its only cached copy; a later duplicate is an ordinary block. Whether it was cached now."""
        block = self._get(block_id)
        if block.block_hash is None and block_hash not in self.cached_blocks:
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block
            return True
        return False

    def reset_cache(self):
        """Forget every cached prefix (new weights make the cached K/V wrong); the blocks stay free."""
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        self.num_cached_free = 0
        if self.events is not None:
            self.events.append(AllBlocksCleared())

    def get_num_cached_blocks(self) -> int:
        """Blocks nobody holds that keep a cached prefix (counted as free: evicted when needed)."""
        return self.num_cached_free

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
            self.num_cached_free += block.block_hash is not None

    def ref_cnt(self, block_id: int) -> int:
        return self._get(block_id).ref_cnt

    def is_cached(self, block_id: int) -> bool:
        """Whether the block keeps a prefix the cache can find."""
        return self._get(block_id).block_hash is not None

    def _get(self, block_id: int) -> Block:
        if 0 <= block_id < len(self.blocks):  # checked first: every block a table holds
            return self.blocks[block_id]
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"unknown block {block_id} (the pool has {self.num_blocks})")
        return Block(block_id)  # never handed out: free and uncached (a stand-in, never stored)

    def check_invariants(self, holders: collections.Counter):
        """Raise AssertionError unless every block's reference count equals `holders[block_id]`
        (the block tables holding it), exactly the blocks nobody holds are in the free queue, the
        prefix cache maps each hash to the one block carrying it, and free + cached + in use = total."""
        if any(block_id >= len(self.blocks) for block_id in holders):
            raise AssertionError("a block table holds a block the pool never handed out")
        counts = collections.Counter(free=self.num_blocks - len(self.blocks))  # never handed out
        for block in self.blocks:
            if block.ref_cnt != holders[block.block_id]:
                raise AssertionError(f"block {block.block_id}: ref_cnt {block.ref_cnt}, "
                                     f"held by {holders[block.block_id]} tables")
            if (block.ref_cnt == 0) != (block.block_id in self.free_queue):
                raise AssertionError(f"block {block.block_id}: ref_cnt {block.ref_cnt} but "
                                     f"{'' if block.block_id in self.free_queue else 'not '}in the free queue")
            if block.block_hash is not None and self.cached_blocks.get(block.block_hash) is not block:
                raise AssertionError(f"block {block.block_id} has a hash the prefix cache does not map to it")
            counts["in use" if block.ref_cnt else "cached" if block.block_hash is not None else "free"] += 1
        if any(block.block_hash != block_hash for block_hash, block in self.cached_blocks.items()):
            raise AssertionError("the prefix cache maps a hash to a block that lost it")
        # What stats report: free + cached (the free queue) + in use = total.
        if self.num_cached_free != counts["cached"]:
            raise AssertionError(f"{self.num_cached_free} cached free blocks counted, {counts['cached']} found")
        num_free = self.get_num_free_blocks()
        if num_free != counts["free"] + counts["cached"] or self.num_blocks - num_free != counts["in use"]:
            raise AssertionError(f"{num_free} free blocks counted, but {dict(counts)}")
