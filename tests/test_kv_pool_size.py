"""KV pool and swap space sized for the device they are on: a GPU's free memory; on a CPU, room
for what a CPU runs (not 5% of RAM plus 4 GiB of swap for a 12.5 MiB model), or
$JPAGED_CPU_KVCACHE_SPACE GiB as vLLM's CPU backend reads VLLM_CPU_KVCACHE_SPACE."""

import logging
import random

import pytest

from jpaged.engine.kv_pool_size import (CPU_POOL_SEQUENCES, CPU_POOL_TOKENS, DEFAULT_SWAP_SPACE_GIB, GIB, pool_size)

KIB = 1024


def cpu(environ=None, **overrides):
    args = dict(bytes_per_block=64 * KIB, block_size=16, max_model_len=4096, max_num_seqs=256,
                num_gpu_blocks_override=None, gpu_memory_utilization=0.9, swap_space=None, memory_stats=None,
                ram_bytes=24 * GIB, environ=environ or {})
    return pool_size(**{**args, **overrides})


def test_cpu_default_is_sized_for_a_cpu():
    # The offline tiny engine: 12.5 MiB of weights, 64 KiB blocks. It reserved 19,284 blocks (1.2 GiB,
    # 5% of RAM) and 65,536 host blocks (4 GiB); now 32768 tokens and as much swap.
    tiny = cpu()
    assert tiny.num_gpu_blocks == CPU_POOL_TOKENS // 16 == 2048 and tiny.num_cpu_blocks == 2048
    assert "CPU default" in tiny.how and "JPAGED_CPU_KVCACHE_SPACE" in tiny.how
    rng = random.Random()
    for _ in range(50):
        block_size = rng.choice([8, 16, 32])
        max_model_len, max_num_seqs = rng.randint(16, 32768), rng.randint(1, 512)
        per_seq = -(-max_model_len // block_size)
        bytes_per_block = rng.randint(1, 2048) * KIB
        ram = rng.randint(1, 64) * GIB
        pool = cpu(block_size=block_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                   bytes_per_block=bytes_per_block, ram_bytes=ram)
        # never more than every sequence at full length needs, nor 5% of RAM (at least one block)
        assert pool.num_gpu_blocks <= max(1, min(max_num_seqs * per_seq, 0.05 * ram // bytes_per_block))
        if max_num_seqs >= CPU_POOL_SEQUENCES and 0.05 * ram >= CPU_POOL_SEQUENCES * per_seq * bytes_per_block:
            assert pool.num_gpu_blocks >= CPU_POOL_SEQUENCES * per_seq  # a few whole sequences fit
        assert pool.num_cpu_blocks * bytes_per_block <= min(DEFAULT_SWAP_SPACE_GIB * GIB,
                                                            pool.num_gpu_blocks * bytes_per_block)
        # A small pool set in blocks (as tests set it to preempt) keeps the default pool's swap space.
        small = cpu(block_size=block_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                    bytes_per_block=bytes_per_block, ram_bytes=ram, num_gpu_blocks_override=3)
        assert small.num_gpu_blocks == 3 and small.num_cpu_blocks == pool.num_cpu_blocks


def test_cpu_kvcache_space_and_explicit_options():
    assert cpu({"JPAGED_CPU_KVCACHE_SPACE": "0.5"}).num_gpu_blocks == GIB // 2 // (64 * KIB)
    assert cpu({"VLLM_CPU_KVCACHE_SPACE": "1"}).num_gpu_blocks == GIB // (64 * KIB)  # vLLM's name
    both = cpu({"JPAGED_CPU_KVCACHE_SPACE": "0.25", "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert both.num_gpu_blocks == GIB // 4 // (64 * KIB) and "$JPAGED_CPU_KVCACHE_SPACE=0.25 GiB" in both.how
    assert cpu({"VLLM_CPU_KVCACHE_SPACE": "0"}).num_gpu_blocks == 2048  # vLLM's 0: the default
    for bad in ("lots", "-1", "nan", "inf"):
        with pytest.raises(ValueError, match=r"^\$JPAGED_CPU_KVCACHE_SPACE=.*GiB"):
            cpu({"JPAGED_CPU_KVCACHE_SPACE": bad})
    assert cpu(num_gpu_blocks_override=77).num_gpu_blocks == 77
    assert cpu(swap_space=0.5).num_cpu_blocks == GIB // 2 // (64 * KIB)
    assert cpu(swap_space=0).num_cpu_blocks == 0


def test_gpu_sizing_is_unchanged():
    stats = {"bytes_limit": 80 * GIB, "bytes_in_use": 10 * GIB}
    pool = cpu(memory_stats=stats, environ={"JPAGED_CPU_KVCACHE_SPACE": "1"})  # a CPU's variable: not read
    assert pool.num_gpu_blocks == int((80 * GIB * 0.9 - 10 * GIB) // (64 * KIB))
    assert pool.num_cpu_blocks == DEFAULT_SWAP_SPACE_GIB * GIB // (64 * KIB)
    assert pool.how == "gpu_memory_utilization=0.9"


def test_the_offline_tiny_engine_says_how_its_pool_was_sized(monkeypatch, caplog):
    import jpaged

    monkeypatch.delenv("JPAGED_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    with caplog.at_level(logging.INFO, logger="jpaged.engine.llm_engine"):
        stats = jpaged.LLM("tiny", enforce_eager=True).stats()
    assert stats["num_gpu_blocks"] == stats["num_cpu_blocks"] == 2048
    assert "2048 device blocks (128.0 MiB), 2048 host blocks" in caplog.text
    assert "pool sized by the CPU default, 32768 tokens; $JPAGED_CPU_KVCACHE_SPACE=GiB sets it" in caplog.text
    monkeypatch.setenv("JPAGED_CPU_KVCACHE_SPACE", "0.0625")
    assert jpaged.LLM("tiny", enforce_eager=True).stats()["num_gpu_blocks"] == 1024
