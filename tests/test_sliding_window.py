"""Sliding-window block reclamation: when every layer is windowed, blocks that hold only keys
before the window of a sequence's next token go back to the pool (vLLM does the same)."""

import numpy as np
import pytest

import jpaged
from jpaged.core.block_manager import FREED_BLOCK, BlockManager
from jpaged.core.sequence import SequenceStatus
from test_block_manager import admit, fork, make_group
from test_models import VOCAB, hf_greedy, make_checkpoint


def schedule_decode(bm: BlockManager, seq, token: int) -> int:
    """What the scheduler and the engine do for one decode step of one sequence; returns the
    position of the token it computes."""
    seq.append_token_id(token, 0.0)
    bm.append_slots(seq)
    bm.cache_full_blocks(seq, seq.num_computed_tokens + 1)
    bm.free_out_of_window(seq)
    seq.num_computed_tokens += 1
    return seq.num_computed_tokens - 1


def assert_window_held(bm: BlockManager, seq, window: int, pos: int):
    """The token at `pos` (and every later one) sees keys pos - window + 1 ...: all their blocks
    are held, and every other held block but the last was freed."""
    table, size = bm.get_block_table(seq), bm.block_size
    first_key = max(pos - window + 1, 0)
    assert all(table[k // size] != FREED_BLOCK for k in range(first_key, seq.get_len()))
    for i, block_id in enumerate(table[:-1]):
        assert (block_id == FREED_BLOCK) == ((i + 1) * size <= first_key), (i, table, first_key)
    bm.check_invariants()


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("block_size,window", [(4, 6), (4, 4), (8, 1), (1, 3)])
def test_blocks_out_of_window_are_freed_and_stay_consistent(block_size, window, caching):
    bm = BlockManager(block_size, 64, 64, watermark=0, enable_caching=caching, sliding_window=window)
    group = make_group(13)
    admit(bm, group)
    seq = group.get_seqs()[0]
    bm.free_out_of_window(seq)  # as if the prompt's last token were computed again
    assert_window_held(bm, seq, window, seq.num_computed_tokens)
    rng = np.random.default_rng()
    for _ in range(30):
        pos = schedule_decode(bm, seq, int(rng.integers(0, 50)))
        assert_window_held(bm, seq, window, pos)
        # Held blocks stay bounded by the window, whatever the length.
        assert len([b for b in bm.get_block_table(seq) if b != FREED_BLOCK]) <= -(-window // block_size) + 2
    child = fork(bm, group, seq)  # shares the held blocks and the freed entries
    assert bm.get_block_table(child) == bm.get_block_table(seq)
    bm.check_invariants()
    group.get_seqs()[1].status = SequenceStatus.RUNNING
    bm.swap_out(group)
    bm.check_invariants()
    for s in group.get_seqs():
        s.status = SequenceStatus.SWAPPED
    bm.swap_in(group)
    for s in group.get_seqs():
        s.status = SequenceStatus.RUNNING
    assert bm.get_block_table(child) == bm.get_block_table(seq)
    schedule_decode(bm, seq, 1)
    schedule_decode(bm, child, 2)
    bm.check_invariants()
    for s in group.get_seqs():
        bm.free(s)
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == bm.num_gpu_blocks and bm.get_num_free_cpu_blocks() == bm.num_cpu_blocks


def test_no_window_frees_nothing():
    bm = BlockManager(4, 32, 0)
    group = make_group(20)
    admit(bm, group)
    bm.free_out_of_window(group.get_seqs()[0])
    assert FREED_BLOCK not in bm.get_block_table(group.get_seqs()[0])


def test_windowed_model_serves_more_than_its_pool_without_preemption(tmp_path):
    """Four sequences of ~80 tokens need 44 blocks of 8 without reclamation; the pool has 20.
    With the window's blocks freed none is preempted, and the tokens are HF's."""
    hf = make_checkpoint(tmp_path, "mistral-sliding-window")  # window 11, every layer
    llm = jpaged.LLM(str(tmp_path), dtype="float32", block_size=8, attention_backend="xla", enforce_eager=True,
                     max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks_override=20)
    assert llm.llm_engine.block_manager.sliding_window == 11
    prompts = [np.random.randint(0, VOCAB, size=np.random.randint(17, 25)).tolist() for _ in range(4)]
    outs = llm.generate(prompts, jpaged.SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                        use_tqdm=False)
    assert llm.stats()["num_preemptions"] == 0
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 60)
    assert llm.stats()["num_free_gpu_blocks"] == llm.stats()["num_gpu_blocks"]
