"""KV pool and swap space sized for the device they are on: a GPU's free memory; on a CPU, room
for what a CPU runs (not 5% of RAM plus 4 GiB of swap for a 12.5 MiB model), or
$JPAGED_CPU_KVCACHE_SPACE GiB as vLLM's CPU backend reads VLLM_CPU_KVCACHE_SPACE."""

import logging
import random

import pytest

from jpaged.engine.kv_pool_size import (CPU_POOL_SEQUENCES, CPU_POOL_TOKENS, DEFAULT_SWAP_SPACE_GIB, GIB,
                                       GPU_MARGIN_BYTES, GPU_MARGIN_FRACTION, GROWTH_SLACK_BYTES, pool_size)

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


def test_gpu_plan_takes_weights_step_state_peak_and_margin_off_the_pool(test_seed):
    rng = random.Random(test_seed)
    for _ in range(200):
        limit = rng.randint(8, 141) * GIB + rng.randint(0, GIB)
        resident, state, peak = rng.randint(0, limit // 4), rng.randint(0, GIB), rng.randint(0, 4 * GIB)
        bytes_per_block, util = rng.randint(1, 1024) * KIB, rng.uniform(0.3, 1.0)
        margin = GPU_MARGIN_BYTES + int(GPU_MARGIN_FRACTION * limit)
        room = int(limit * util) - resident - state - peak - margin
        stats = {"bytes_limit": limit, "bytes_in_use": resident}
        if room < bytes_per_block:
            with pytest.raises(ValueError, match="no room for the KV cache.*gpu_memory_utilization.*"
                                                 "XLA_PYTHON_CLIENT_MEM_FRACTION"):
                cpu(memory_stats=stats, bytes_per_block=bytes_per_block, gpu_memory_utilization=util,
                    step_state=state, peak=peak, peak_of="forward 8192")
            continue
        pool = cpu(memory_stats=stats, bytes_per_block=bytes_per_block, gpu_memory_utilization=util,
                   step_state=state, peak=peak, peak_of="forward 8192",
                   environ={"JPAGED_CPU_KVCACHE_SPACE": "1"})  # a CPU's variable: not read on a GPU
        assert pool.num_gpu_blocks == room // bytes_per_block
        plan = pool.plan
        # Everything planned plus what is left free is what jax may use; the free part is at
        # least the (1 - utilization) share.
        assert plan.resident + plan.step_state + plan.peak + plan.margin + plan.pool + plan.free == limit
        assert plan.free >= limit - int(limit * util)
        assert "forward 8192" in pool.how and f"{plan.pool / GIB:.2f} GiB" in pool.how
        assert pool.num_cpu_blocks == DEFAULT_SWAP_SPACE_GIB * GIB // bytes_per_block


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


def _random_llama(path, seed: int) -> str:
    """A Llama checkpoint made by transformers' save_pretrained (not the built-in tiny model)."""
    import torch
    import transformers

    from jpaged.models import tiny

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tiny.tiny_tokenizer().save_pretrained(path)
    return str(path)


def test_gpu_plan_under_a_growing_allocator_fits_the_pool_in_one_piece(test_seed):
    """XLA_PYTHON_CLIENT_PREALLOCATE=false: the allocator holds regions (pool_bytes) below its limit;
    the pool is reserved in one piece, from a new region or the largest free block, so it is capped
    by the larger of the two, less room for the peak temporaries and the margin (regions that
    double can hold up to twice what is in use in them, in pieces)."""
    rng = random.Random(test_seed)
    for _ in range(200):
        limit = rng.randint(20, 141) * GIB
        resident = rng.randint(0, limit // 4)
        held = resident + rng.randint(0, resident + 1)  # regions are up to twice what they hold
        largest_free = rng.randint(0, held - resident)
        stats = {"bytes_limit": limit, "bytes_in_use": resident, "pool_bytes": held,
                 "largest_free_block_bytes": largest_free}
        pool = cpu(memory_stats=stats, bytes_per_block=512 * KIB, step_state=2**27, peak=GIB)
        plain = cpu(memory_stats={"bytes_limit": limit, "bytes_in_use": resident}, bytes_per_block=512 * KIB,
                    step_state=2**27, peak=GIB)
        piece = max(limit - held, largest_free) - GROWTH_SLACK_BYTES
        # the piece holds the pool and keeps room for the peak temporaries and the margin
        assert pool.num_gpu_blocks == min(plain.num_gpu_blocks, (piece - GIB - pool.plan.margin) // (512 * KIB))
        assert pool.plan.contiguous == piece and "in one piece" in pool.how
        assert plain.plan.contiguous is None and "in one piece" not in plain.how
    # Preallocated (pool_bytes == bytes_limit): no cap.
    stats = {"bytes_limit": 80 * GIB, "bytes_in_use": 10 * GIB, "pool_bytes": 80 * GIB}
    assert cpu(memory_stats=stats).plan.contiguous is None


@pytest.mark.parametrize("model", ["tiny", "checkpoint"])
def test_engine_on_a_gpu_plans_its_pool_from_the_executables_memory(model, monkeypatch, caplog, tmp_path, test_seed):
    """With a GPU's memory stats (faked here: the CPU has none), the engine measures its largest
    executables on an abstract runner before the pool exists, and the pool is what the plan leaves.
    The measured peak equals the one of the engine's own executables, compiled for the real pool
    (a different size): the temporaries do not depend on the pool's size."""
    import jpaged
    from jpaged.engine import start_up
    from jpaged.runner import step_memory

    path = "tiny" if model == "tiny" else _random_llama(tmp_path / "llama", test_seed)
    limit, resident = GIB, 40 * 2**20
    monkeypatch.setattr(start_up, "tightest_memory_stats", lambda devices: {"bytes_limit": limit,
                                                                           "bytes_in_use": resident})
    kwargs = dict(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=64, background_warmup=False)
    with caplog.at_level(logging.INFO, logger="jpaged.engine.llm_engine"):
        llm = jpaged.LLM(path, **kwargs)
    engine = llm.llm_engine
    plan, runner = engine.memory_plan, engine.runner
    measured = step_memory.measure(runner, compile_fn=runner._executable)  # the warm-up's executables
    top = step_memory.peak(measured)
    assert plan.peak == top.transient > 0 and plan.peak_of == " ".join(map(str, top.key))
    assert {s.key[0] for s in measured} >= {"forward", "sample", "copy_blocks", "swap_out", "swap_in"}
    assert plan.step_state == 4 * 8 * (256 + 1) + 4 * (8 + 1) * (256 // 16)  # histories, last tokens, block tables
    bytes_per_block = runner.kv_cache_spec.bytes_per_block
    room = int(limit * 0.9) - resident - plan.step_state - plan.peak - plan.margin
    assert llm.stats()["num_gpu_blocks"] == room // bytes_per_block == runner.num_gpu_blocks
    assert "peak step temporaries" in caplog.text and "left free" in caplog.text
    out = llm.generate([[1, 2, 3, 4]], jpaged.SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    # A device too small for any pool: a clear error at start, naming the numbers and the options.
    monkeypatch.setattr(start_up, "tightest_memory_stats", lambda devices: {"bytes_limit": GIB // 2,
                                                                           "bytes_in_use": resident})
    with pytest.raises(ValueError, match=r"no room for the KV cache: gpu_memory_utilization=0.9 of the 0.50 GiB"):
        jpaged.LLM(path, **kwargs)


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_a_proposers_device_state_is_planned_before_the_pool(method, monkeypatch, tmp_path):
    """A draft model's or an EAGLE head's runner holds device state besides its share of every block
    (its own token histories and block tables; an EAGLE head's chain scratch blocks past the
    target's block ids and its fill's rows). On a GPU the plan takes it off the pool before the
    pool is sized: what the proposer's runner then holds, summed from its arrays, is what was planned."""
    import jax

    import jpaged
    from eagle3_head import write_head
    from jpaged.engine import start_up
    from jpaged.models import tiny
    from test_spec_decode_draft import write_tiny

    limit, resident = GIB, 40 * 2**20
    monkeypatch.setattr(start_up, "tightest_memory_stats", lambda devices: {"bytes_limit": limit,
                                                                           "bytes_in_use": resident})
    monkeypatch.setattr(start_up, "measure_step_memory", lambda *a: (0, "not measured"))
    model = write_tiny(tmp_path / "draft", num_layers=1) if method == "draft_model" else \
        write_head(tmp_path / "head", tiny.tiny_config())
    llm = jpaged.LLM("tiny", max_num_seqs=8, max_model_len=256, max_num_batched_tokens=64, background_warmup=False,
                     speculative_config={"method": method, "model": str(model), "num_speculative_tokens": 3})
    engine = llm.llm_engine
    target, runner = engine.runner, engine.proposer.runner
    nbytes = lambda tree: sum(a.nbytes for a in jax.tree.leaves(tree))  # noqa: E731
    held = nbytes((runner.token_history, runner.last_tokens, runner.block_table, getattr(runner, "rows", ())))
    held += nbytes(runner.kv_cache) - target.num_gpu_blocks * runner.kv_cache_spec.bytes_per_block  # scratch blocks
    target_state = nbytes((target.token_history, target.last_tokens, target.block_table))
    assert held > 0 and engine.memory_plan.step_state == target_state + held
    assert nbytes(runner.kv_cache) > target.num_gpu_blocks * runner.kv_cache_spec.bytes_per_block  # (scratch)
    bytes_per_block = target.kv_cache_spec.bytes_per_block + runner.kv_cache_spec.bytes_per_block
    plan = engine.memory_plan
    room = int(limit * 0.9) - resident - plan.step_state - plan.peak - plan.margin
    assert target.num_gpu_blocks == room // bytes_per_block
    out = llm.generate([[1, 2, 3, 4]], jpaged.SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
