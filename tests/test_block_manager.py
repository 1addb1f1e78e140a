import itertools
import math
import random

import pytest

from jpaged.core.block_manager import AllocStatus, BlockManager, NoFreeBlocksError
from jpaged.core.block_pool import BlockPool
from jpaged.core.sequence import Sequence, SequenceGroup, SequenceStatus
from jpaged.sampling_params import SamplingParams

_ids = itertools.count()


def make_group(prompt_len: int, best_of: int = 1) -> SequenceGroup:
    seq = Sequence(next(_ids), list(range(100, 100 + prompt_len)))
    return SequenceGroup(f"r{seq.seq_id}", [seq], SamplingParams(n=best_of), arrival_time=0.0)


def admit(bm: BlockManager, group: SequenceGroup):
    """Allocate, and pretend the whole prompt has been computed."""
    bm.allocate(group)
    for seq in group.get_seqs():
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = seq.get_len()


def decode(bm: BlockManager, seq: Sequence, token: int) -> list[tuple[int, int]]:
    """One step of the engine for one sequence: a token is sampled, then it gets its slot."""
    seq.append_token_id(token, 0.0)
    copies = bm.append_slots(seq)
    seq.num_computed_tokens += 1
    return copies


def fork(bm: BlockManager, group: SequenceGroup, parent: Sequence) -> Sequence:
    child = parent.fork(next(_ids))
    group.add(child)
    bm.fork(parent, child)
    return child


def assert_all_free(bm: BlockManager):
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == bm.num_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == bm.num_cpu_blocks


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_allocation_on_demand(block_size):
    bm = BlockManager(block_size, num_gpu_blocks=64, num_cpu_blocks=0, watermark=0)
    for prompt_len in (block_size - 1, block_size, block_size + 1):
        if prompt_len == 0:
            continue
        group = make_group(prompt_len)
        admit(bm, group)
        seq = group.seqs[0]
        assert len(bm.get_block_table(seq)) == math.ceil(prompt_len / block_size)
        for _ in range(2 * block_size + 1):
            num_blocks = len(bm.get_block_table(seq))
            decode(bm, seq, 7)
            # A new block exactly when the last one was full.
            assert len(bm.get_block_table(seq)) == num_blocks + ((seq.get_len() - 1) % block_size == 0)
            assert len(bm.get_block_table(seq)) == math.ceil(seq.get_len() / block_size)
        bm.check_invariants()
        bm.free(seq)
    assert_all_free(bm)


def test_block_ids_are_distinct_and_in_range():
    bm = BlockManager(4, num_gpu_blocks=10, num_cpu_blocks=0, watermark=0)
    groups = [make_group(8) for _ in range(5)]
    for group in groups:
        admit(bm, group)
    ids = [b for group in groups for b in bm.get_block_table(group.seqs[0])]
    assert sorted(ids) == list(range(10))
    assert bm.get_num_free_gpu_blocks() == 0


def test_fork_shares_blocks_and_copy_on_write_of_the_partial_last_block():
    bm = BlockManager(4, num_gpu_blocks=16, num_cpu_blocks=0, watermark=0)
    group = make_group(6)  # blocks: [full, 2 of 4]
    admit(bm, group)
    parent = group.seqs[0]
    children = [fork(bm, group, parent) for _ in range(2)]
    table = list(bm.get_block_table(parent))
    assert all(bm.get_block_table(c) == table for c in children)
    assert [bm.gpu_pool.ref_cnt(b) for b in table] == [3, 3]
    assert bm.get_num_free_gpu_blocks() == 14  # forking takes no block
    bm.check_invariants()

    assert bm.can_append_slots(group)
    # The first two writers copy the shared partial block; the last one keeps it.
    copies = [decode(bm, seq, 50 + i) for i, seq in enumerate([parent] + children)]
    assert [len(c) for c in copies] == [1, 1, 0]
    assert all(src == table[1] for (src, _), in copies[:2])
    assert copies[0][0][1] != copies[1][0][1]
    last_blocks = {bm.get_block_table(seq)[-1] for seq in group.seqs}
    assert len(last_blocks) == 3 and table[1] in last_blocks
    assert bm.gpu_pool.ref_cnt(table[0]) == 3  # the full block stays shared
    assert all(bm.gpu_pool.ref_cnt(b) == 1 for b in last_blocks)
    bm.check_invariants()

    # After copy-on-write each sequence writes its own block: no more copies.
    for seq in group.seqs:
        assert decode(bm, seq, 60) == []
    for seq in group.seqs:
        bm.free(seq)
    assert_all_free(bm)


def test_no_copy_when_the_shared_last_block_is_full():
    bm = BlockManager(4, num_gpu_blocks=16, num_cpu_blocks=0, watermark=0)
    group = make_group(8)  # two full blocks
    admit(bm, group)
    parent = group.seqs[0]
    child = fork(bm, group, parent)
    for seq in (parent, child):
        assert decode(bm, seq, 1) == []  # the new token goes to a fresh block
    assert bm.get_block_table(parent)[:2] == bm.get_block_table(child)[:2]
    assert bm.get_block_table(parent)[2] != bm.get_block_table(child)[2]
    bm.check_invariants()
    for seq in group.seqs:
        bm.free(seq)
    assert_all_free(bm)


def test_can_append_slots_counts_exactly():
    bm = BlockManager(4, num_gpu_blocks=4, num_cpu_blocks=0, watermark=0)
    group = make_group(6)
    admit(bm, group)  # 2 blocks used, 2 free
    parent = group.seqs[0]
    fork(bm, group, parent)
    fork(bm, group, parent)
    for seq in group.seqs:
        seq.append_token_id(1, 0.0)
    assert bm.can_append_slots(group)  # three sharers of the last block need two copies
    filler = make_group(1)
    admit(bm, filler)  # 1 free
    assert not bm.can_append_slots(group)
    with pytest.raises(NoFreeBlocksError):
        for seq in group.seqs:
            bm.append_slots(seq)


def test_swap_out_and_in_moves_shared_blocks_once():
    bm = BlockManager(4, num_gpu_blocks=16, num_cpu_blocks=8, watermark=0)
    group = make_group(10)  # 3 blocks
    admit(bm, group)
    parent = group.seqs[0]
    fork(bm, group, parent)
    fork(bm, group, parent)
    for seq in group.seqs:
        decode(bm, seq, seq.seq_id)  # the partial last block gets copied for two of them
    distinct = {b for seq in group.seqs for b in bm.get_block_table(seq)}
    assert len(distinct) == 5  # 2 shared full blocks + 3 last blocks
    tables_before = {seq.seq_id: list(bm.get_block_table(seq)) for seq in group.seqs}
    refs_before = {b: bm.gpu_pool.ref_cnt(b) for b in distinct}

    assert bm.can_swap_out(group)
    swap_out = bm.swap_out(group)
    for seq in group.seqs:
        seq.status = SequenceStatus.SWAPPED
    assert len(swap_out) == 5 and {g for g, _ in swap_out} == distinct
    gpu_to_cpu = dict(swap_out)
    assert len(set(gpu_to_cpu.values())) == 5
    for seq in group.seqs:
        assert bm.cpu_tables[seq.seq_id] == [gpu_to_cpu[b] for b in tables_before[seq.seq_id]]
    assert all(bm.cpu_pool.ref_cnt(gpu_to_cpu[b]) == r for b, r in refs_before.items())
    assert bm.get_num_free_gpu_blocks() == 16 and bm.get_num_free_cpu_blocks() == 3
    with pytest.raises(ValueError, match="no blocks on the device"):
        bm.get_block_table(parent)
    bm.check_invariants()

    assert bm.can_swap_in(group) is AllocStatus.OK
    swap_in = bm.swap_in(group)
    for seq in group.seqs:
        seq.status = SequenceStatus.RUNNING
    assert len(swap_in) == 5 and {c for c, _ in swap_in} == set(gpu_to_cpu.values())
    cpu_to_gpu = dict(swap_in)
    for seq in group.seqs:
        expected = [cpu_to_gpu[gpu_to_cpu[b]] for b in tables_before[seq.seq_id]]
        assert bm.get_block_table(seq) == expected
    assert all(bm.gpu_pool.ref_cnt(cpu_to_gpu[gpu_to_cpu[b]]) == r for b, r in refs_before.items())
    assert bm.get_num_free_gpu_blocks() == 11 and bm.get_num_free_cpu_blocks() == 8
    bm.check_invariants()
    for seq in group.seqs:
        bm.free(seq)
    assert_all_free(bm)


def test_swap_limits():
    bm = BlockManager(4, num_gpu_blocks=8, num_cpu_blocks=2, watermark=0)
    group = make_group(12)  # 3 blocks
    admit(bm, group)
    assert not bm.can_swap_out(group)
    with pytest.raises(NoFreeBlocksError):
        bm.swap_out(group)
    bm.check_invariants()

    bm = BlockManager(4, num_gpu_blocks=4, num_cpu_blocks=8, watermark=0)
    group = make_group(12)
    admit(bm, group)
    group.seqs[0].append_token_id(1, 0.0)  # sampled; its slot needs a 4th block
    bm.swap_out(group)
    group.seqs[0].status = SequenceStatus.SWAPPED
    other = make_group(4)
    admit(bm, other)
    assert bm.can_swap_in(group) is AllocStatus.LATER  # 3 blocks + 1 for the new token, 3 free
    bm.free(other.seqs[0])
    assert bm.can_swap_in(group) is AllocStatus.OK
    bm.swap_in(group)
    bm.free(group.seqs[0])
    big = make_group(16)
    admit(bm, big)
    bm.swap_out(big)
    big.seqs[0].status = SequenceStatus.SWAPPED
    assert bm.can_swap_in(big) is AllocStatus.OK  # exactly the pool: nothing more to write
    big.seqs[0].append_token_id(1, 0.0)
    assert bm.can_swap_in(big) is AllocStatus.NEVER  # 4 blocks + 1 for the new token


def test_watermark():
    bm = BlockManager(1, num_gpu_blocks=100, num_cpu_blocks=0, watermark=0.05)
    assert bm.watermark_blocks == 5
    assert bm.can_allocate(make_group(95)) is AllocStatus.OK
    assert bm.can_allocate(make_group(96)) is AllocStatus.NEVER  # would leave less than the watermark
    admit(bm, make_group(10))
    assert bm.can_allocate(make_group(85)) is AllocStatus.OK
    assert bm.can_allocate(make_group(86)) is AllocStatus.LATER
    # Running sequences may grow into the watermark.
    group = make_group(85)
    admit(bm, group)
    for _ in range(5):
        decode(bm, group.seqs[0], 1)
    assert bm.get_num_free_gpu_blocks() == 0
    bm.check_invariants()


def test_recomputed_group_shares_only_its_common_full_blocks():
    bm = BlockManager(4, num_gpu_blocks=32, num_cpu_blocks=0, watermark=0)
    group = make_group(9)  # prompt: 2 full blocks + 1 token
    seq_a = group.seqs[0]
    seq_b, seq_c = seq_a.fork(next(_ids)), seq_a.fork(next(_ids))
    group.add(seq_b)
    group.add(seq_c)
    for tokens, seq in zip(([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 9, 9, 9]), group.seqs):
        for t in tokens:
            seq.append_token_id(t, 0.0)  # 14 tokens each: blocks 0, 1 (prompt), 2 (diverges at 11), 3
    assert bm.can_allocate(group) is AllocStatus.OK
    bm.allocate(group)
    tables = [bm.get_block_table(seq) for seq in group.seqs]
    assert all(len(t) == 4 for t in tables)
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({b for t in tables for b in t[2:]}) == 6
    assert bm.get_num_free_gpu_blocks() == 32 - 2 - 6
    bm.check_invariants()

    # Identical sequences share every full block except the one holding their last token.
    bm2 = BlockManager(4, num_gpu_blocks=32, num_cpu_blocks=0, watermark=0)
    group2 = make_group(8)
    group2.add(group2.seqs[0].fork(next(_ids)))
    bm2.allocate(group2)
    t0, t1 = (bm2.get_block_table(seq) for seq in group2.seqs)
    assert t0[0] == t1[0] and t0[1] != t1[1]
    bm2.check_invariants()


def test_can_allocate_never_and_out_of_blocks():
    bm = BlockManager(4, num_gpu_blocks=4, num_cpu_blocks=0, watermark=0)
    assert bm.can_allocate(make_group(16)) is AllocStatus.OK
    assert bm.can_allocate(make_group(17)) is AllocStatus.NEVER
    admit(bm, make_group(12))
    group = make_group(8)
    assert bm.can_allocate(group) is AllocStatus.LATER
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(group)  # the caller didn't check
    bm.check_invariants()  # nothing was half allocated
    assert bm.get_num_free_gpu_blocks() == 1


def test_misuse_raises():
    bm = BlockManager(4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0)
    group = make_group(5)
    admit(bm, group)
    seq = group.seqs[0]
    with pytest.raises(ValueError, match="already has blocks"):
        bm.fork(seq, seq)
    bm.free(seq)
    with pytest.raises(ValueError, match="freed twice"):
        bm.free(seq)
    with pytest.raises(ValueError, match="no blocks on the device"):
        bm.get_block_table(seq)
    pool = BlockPool(2)
    block = pool.allocate()
    pool.free(block)
    with pytest.raises(ValueError, match="double free"):
        pool.free(block)
    with pytest.raises(ValueError, match="unknown block"):
        pool.free(2)
    with pytest.raises(ValueError, match="is free"):
        pool.share(block)
    pool.allocate(), pool.allocate()
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()


def test_free_queue_hands_out_least_recently_freed_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    pool.free(b)
    pool.free(a)
    pool.free(c)
    assert [pool.allocate() for _ in range(3)] == [b, a, c]


def test_blocks_never_used_come_first_and_cost_nothing():
    """A host pool of 10^8 blocks (swap_space over a small model's blocks) exists only as a count:
    blocks never handed out come before the freed ones, in id order, free and uncached."""
    n = 10**8
    pool = BlockPool(n)
    a, b = pool.allocate(), pool.allocate()
    pool.free(a)
    assert pool.get_num_free_blocks() == n - 1
    assert [pool.allocate(), pool.allocate()] == [2, 3]
    assert pool.ref_cnt(n - 1) == 0 and not pool.is_cached(n - 1) and pool.ref_cnt(b) == 1
    with pytest.raises(ValueError, match="unknown block"):
        pool.ref_cnt(n)
    with pytest.raises(ValueError, match="double free"):
        pool.free(n - 1)
    with pytest.raises(ValueError, match="is free"):
        pool.share(n - 1)


def test_random_operations_keep_contents_and_invariants():
    """Random admit/fork/decode/swap/free on a small pool, with fake KV pages: every sequence must
    read back exactly its own tokens through its block table."""
    rng = random.Random(1234)
    bs = 4
    bm = BlockManager(bs, num_gpu_blocks=24, num_cpu_blocks=12, watermark=0)
    gpu = [[None] * bs for _ in range(24)]
    cpu = [[None] * bs for _ in range(12)]

    def write(seq, start):
        table = bm.get_block_table(seq)
        tokens = seq.get_token_ids()
        for pos in range(start, seq.get_len()):
            gpu[table[pos // bs]][pos % bs] = tokens[pos]

    def read(seq):
        table = bm.get_block_table(seq)
        return [gpu[table[pos // bs]][pos % bs] for pos in range(seq.get_len())]

    running, swapped = [], []
    for _ in range(600):
        op = rng.random()
        if op < 0.15:
            group = make_group(rng.randint(1, 12))
            if bm.can_allocate(group) is AllocStatus.OK:
                admit(bm, group)
                write(group.seqs[0], 0)
                running.append(group)
        elif op < 0.25 and running:
            group = rng.choice(running)
            if len(group.seqs) < 4:
                fork(bm, group, rng.choice(group.seqs))
        elif op < 0.7 and running:
            # A decode step; with lookahead slots, a multi-step decode: the device computes the
            # sampled token and the `lookahead` tokens it samples next, into slots taken now.
            group = rng.choice(running)
            lookahead = rng.choice([0, 0, 1, 2, 5])
            for seq in group.seqs:
                seq.append_token_id(rng.randrange(1000), 0.0)
            if not bm.can_append_slots(group, lookahead):
                for seq in group.seqs:
                    seq.output_token_ids.pop()
                continue
            free = bm.get_num_free_gpu_blocks()
            needed = bm.num_blocks_to_append(group.seqs, lookahead)
            for seq in group.seqs:
                for src, dst in bm.append_slots(seq, lookahead):
                    gpu[dst] = list(gpu[src])
                write(seq, seq.get_len() - 1)
            assert free - bm.get_num_free_gpu_blocks() == needed
            for _ in range(lookahead):  # each step writes what the one before sampled
                for seq in group.seqs:
                    seq.append_token_id(rng.randrange(1000), 0.0)
                    write(seq, seq.get_len() - 1)
        elif op < 0.8 and running:
            group = running.pop(rng.randrange(len(running)))
            if bm.can_swap_out(group):
                for g, c in bm.swap_out(group):
                    cpu[c] = list(gpu[g])
                for seq in group.seqs:
                    seq.status = SequenceStatus.SWAPPED
                swapped.append(group)
            else:
                running.append(group)
        elif op < 0.9 and swapped:
            group = swapped.pop(0)
            if bm.can_swap_in(group) is AllocStatus.OK:
                for c, g in bm.swap_in(group):
                    gpu[g] = list(cpu[c])
                for seq in group.seqs:
                    seq.status = SequenceStatus.RUNNING
                running.append(group)
            else:
                swapped.insert(0, group)
        elif running:
            group = running.pop(rng.randrange(len(running)))
            for seq in group.seqs:
                bm.free(seq)
        bm.check_invariants()
        for group in running:
            for seq in group.seqs:
                assert read(seq) == seq.get_token_ids()
    for group in running + swapped:
        for seq in group.seqs:
            bm.free(seq)
    assert_all_free(bm)


# Prefix caching.

def make_request(token_ids: list[int]) -> SequenceGroup:
    seq = Sequence(next(_ids), token_ids)
    return SequenceGroup(f"r{seq.seq_id}", [seq], SamplingParams(), arrival_time=0.0)


def admit_cached(bm: BlockManager, group: SequenceGroup) -> int:
    """Allocate, compute the uncached rest of the prompt and cache its full blocks; returns the
    cached tokens."""
    num_cached = bm.allocate(group)
    for seq in group.get_seqs():
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = seq.get_len()
        bm.cache_full_blocks(seq, seq.get_len())
    return num_cached


def test_prefix_cache_hits_whole_blocks_but_never_the_last_token():
    bm = BlockManager(4, num_gpu_blocks=32, num_cpu_blocks=0, watermark=0, enable_caching=True)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    a = make_request(prompt)
    assert admit_cached(bm, a) == 0
    table_a = list(bm.get_block_table(a.seqs[0]))
    b = make_request(prompt)
    assert admit_cached(bm, b) == 8  # the partial block is not cached
    table_b = bm.get_block_table(b.seqs[0])
    assert table_b[:2] == table_a[:2] and table_b[2] != table_a[2]
    assert [bm.gpu_pool.ref_cnt(block) for block in table_a] == [2, 2, 1]
    assert admit_cached(bm, make_request(prompt[:8])) == 4  # exactly 2 blocks: the 2nd holds the last token
    assert admit_cached(bm, make_request(prompt[:7] + [99, 100])) == 4  # diverges inside block 2
    assert admit_cached(bm, make_request([99] + prompt[1:])) == 0  # the chain breaks at block 1
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10 + 10 + 8 + 9 + 10, 8 + 4 + 4)
    assert bm.get_num_gpu_blocks_without_sharing() == 3 + 3 + 2 + 3 + 3
    assert bm.get_num_gpu_blocks_in_use() == 3 + 1 + 1 + 2 + 3
    bm.check_invariants()


def test_freed_blocks_stay_cached_and_are_evicted_lru_longest_prefix_first():
    bm = BlockManager(4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0, enable_caching=True)
    prompt = list(range(13))  # 3 full blocks + 1 token
    a = make_request(prompt)
    admit_cached(bm, a)
    bm.free(a.seqs[0])
    assert bm.get_num_free_gpu_blocks() == 8 and bm.get_num_cached_gpu_blocks() == 3
    bm.check_invariants()
    # The 4 never used blocks go first, then a's partial block, then its longest prefix block.
    other = make_request([50] * 21)
    admit_cached(bm, other)
    assert bm.get_num_cached_gpu_blocks() == 2
    bm.free(other.seqs[0])
    again = make_request(prompt)
    assert admit_cached(bm, again) == 8  # blocks 0 and 1 are still there
    bm.free(again.seqs[0])
    bm.check_invariants()


def test_admission_counts_cached_blocks_taken_from_the_free_queue():
    bm = BlockManager(4, num_gpu_blocks=4, num_cpu_blocks=0, watermark=0, enable_caching=True)
    prompt = list(range(9))  # 2 full blocks + 1 token: 3 blocks
    a = make_request(prompt)
    admit_cached(bm, a)
    bm.free(a.seqs[0])
    admit_cached(bm, make_request([50] * 8))  # the unused block and a's partial one
    assert bm.get_num_free_gpu_blocks() == 2 and bm.get_num_cached_gpu_blocks() == 2
    # The same prompt hits both cached blocks but needs a third, and nothing else is free.
    assert bm.can_allocate(make_request(prompt)) is AllocStatus.LATER
    # 8 tokens: one hit (the 2nd block holds the last token), one new block that evicts the other.
    exact = make_request(prompt[:8])
    assert bm.can_allocate(exact) is AllocStatus.OK
    assert admit_cached(bm, exact) == 4
    assert bm.get_num_free_gpu_blocks() == 0
    bm.check_invariants()


def test_prefix_caching_with_fork_copy_on_write_and_swap():
    bm = BlockManager(4, num_gpu_blocks=16, num_cpu_blocks=16, watermark=0, enable_caching=True)
    group = make_request(list(range(6)))
    admit_cached(bm, group)
    parent = group.seqs[0]
    child = fork(bm, group, parent)
    for seq, token in ((parent, 7), (child, 8)):  # copy-on-write of the partial block
        decode(bm, seq, token)
        decode(bm, seq, token)
        bm.cache_full_blocks(seq, seq.get_len())
    assert bm.get_block_table(parent)[0] == bm.get_block_table(child)[0]
    assert len({bm.get_block_table(parent)[1], bm.get_block_table(child)[1]}) == 2  # now full and cached
    bm.check_invariants()
    assert admit_cached(bm, make_request(list(range(6)) + [8, 8, 0])) == 8  # the child's path

    swap_out = dict(bm.swap_out(group))
    for seq in group.seqs:
        seq.status = SequenceStatus.SWAPPED
    assert all(bm.gpu_pool.blocks[b].block_hash is not None for b in swap_out if bm.gpu_pool.ref_cnt(b) == 0)
    bm.swap_in(group)
    for seq in group.seqs:
        seq.status = SequenceStatus.RUNNING
        bm.cache_full_blocks(seq, seq.get_len())  # the copies duplicate cached blocks: not cached again
    bm.check_invariants()
    for seq in group.seqs:
        bm.free(seq)
    bm.check_invariants()


def test_check_invariants_catches_a_wrong_reference_count_and_a_stale_cache_entry():
    bm = BlockManager(4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0, enable_caching=True)
    group = make_request(list(range(9)))
    admit_cached(bm, group)
    block = bm.gpu_pool.blocks[bm.get_block_table(group.seqs[0])[0]]
    block.ref_cnt += 1
    with pytest.raises(AssertionError, match="ref_cnt 2, held by 1"):
        bm.check_invariants()
    block.ref_cnt -= 1
    block.block_hash = b"stale"
    with pytest.raises(AssertionError, match="hash"):
        bm.check_invariants()
