"""fp8 KV cache (kv_cache_dtype="fp8" | "fp8_e4m3" | "fp8_e5m2"): the attention call site against
a float64 reference of the dequantized pages, scales (checkpoint, calculated, 1.0), pool sizing,
and the engine's paths (swap, copy-on-write, prefix caching, multi-step, async scheduling,
tensor parallelism) on fp8 pages. The kernels' own fp8 tests are in test_kernels.py."""

import json
import logging
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

import jpaged
from jpaged.models.forward_context import AttentionMetadata
from jpaged.models.kv_cache import KVCacheSpec
from jpaged.models.paged_attention import AttentionOps
from test_engine import assert_all_blocks_free, workload

FP8 = {"fp8": ml_dtypes.float8_e4m3fn, "fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}
LIMITS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, block_size=16)
# The engine tests' workloads are fixed (as test_multi_step's): a run on the CPU is deterministic,
# so they pass or fail the same way every time.
SEED = 20261124


def fp8_workload(rng, num):
    """test_engine's greedy workload, with top-5 logprobs for assert_close_outputs."""
    prompts, params = workload(rng, num)
    return prompts, [jpaged.SamplingParams(temperature=0, max_tokens=p.max_tokens, ignore_eos=True, logprobs=5)
                     for p in params]


def assert_close_outputs(reference, outs, atol=0.05):
    """Two runs over fp8 pages whose batches differ (shape, device count, steps per call): fp32
    rounding differs by ~1e-6 there, and fp8 rounding can turn that into a flipped page value,
    so an exact match would be luck. As vLLM's check_logprobs_close: until the first differing
    token the logprobs agree within `atol` (a wrong or stale page moves them by whole nats); at
    it, each side's token is in the other's top 5, and the rest of that completion is moot."""
    for ref, out in zip(reference, outs, strict=True):
        for a, b in zip(ref.outputs, out.outputs, strict=True):
            assert len(a.token_ids) == len(b.token_ids)
            for token_a, token_b, top_a, top_b in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
                if token_a != token_b:
                    assert token_a in top_b and token_b in top_a, (a.token_ids, b.token_ids)
                    break
                assert abs(top_a[token_a] - top_b[token_b]) < atol, (a.token_ids, b.token_ids)


def dequantized(x: np.ndarray, dtype, scale: float) -> np.ndarray:
    """What an fp8 page holds for x, read back: round(x / scale) in fp8 (saturated), times scale."""
    largest = np.float32(ml_dtypes.finfo(dtype).max)
    quantized = np.clip(x.astype(np.float32) / np.float32(scale), -largest, largest).astype(dtype)  # in f32, as written
    return quantized.astype(np.float64) * np.float64(np.float32(scale))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_attention_with_fp8_pages_and_layer_scales(kv_cache_dtype):
    """A prefill of n tokens through AttentionOps into layer 1 of a 2-layer fp8 pool: the output
    equals float64 causal attention over K and V rounded to fp8 at that layer's scales, and the
    pages hold exactly x / scale in fp8 (layer 0's pages untouched)."""
    rng = np.random.default_rng()
    dtype = FP8[kv_cache_dtype]
    heads, kv_heads, head_dim, page, n = 4, 2, 16, 8, 19
    spec = KVCacheSpec(2, kv_heads, head_dim, page, np.dtype(dtype))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    k_scale, v_scale = rng.uniform(0.01, 0.2, 2).astype(np.float32), rng.uniform(0.01, 0.2, 2).astype(np.float32)
    pages_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    cache = spec.allocate(4, pages_sharding, (k_scale, v_scale))
    q, k, v = (rng.standard_normal((n, h, head_dim)) for h in (heads, kv_heads, kv_heads))
    k[3, 1, 5] = 1e6  # an outlier saturates instead of turning into NaN
    blocks = np.array([2, 0, 3], np.int32)  # layer 1's pages of the sequence (layer-major pool: +4)
    pos = np.arange(n)
    meta = AttentionMetadata(slot_mapping=jnp.asarray((4 + blocks[pos // page]) * page + pos % page, jnp.int32),
                             block_tables=jnp.asarray(4 + blocks[None], jnp.int32),
                             context_lens=jnp.array([n], jnp.int32), query_start_loc=jnp.array([0, n], jnp.int32),
                             layer=jnp.int32(1))
    scale = 0.3
    out, cache = AttentionOps("xla")(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), cache, meta, scale)
    k_ref, v_ref = dequantized(k, dtype, k_scale[1]), dequantized(v, dtype, v_scale[1])
    group = heads // kv_heads
    ref = np.zeros((n, heads, head_dim))
    for t in range(n):
        for h in range(heads):
            s = k_ref[:t + 1, h // group] @ q[t, h] * scale
            p = np.exp(s - s.max())
            ref[t, h] = p @ v_ref[:t + 1, h // group] / p.sum()
    err = np.abs(np.asarray(out, np.float64) - ref).max()
    print(f"{kv_cache_dtype}: max abs err {err:.2e}")
    assert err < 1e-4
    k_pages = np.asarray(cache.typed_pages()[0])  # on a CPU the pool holds raw bits (KVCache.raw_of)
    assert k_pages.dtype == np.dtype(dtype)
    stored = k_pages.astype(np.float64)[:, 4 + blocks[pos // page], pos % page]  # [kvh, n, d]
    np.testing.assert_array_equal(stored * k_scale[1], np.swapaxes(k_ref, 0, 1))
    assert not k_pages[:, :4].astype(np.float32).any()  # layer 0: still zeros


def test_spec_bytes_and_pool_sizes_halve_against_bf16(caplog):
    """fp8 blocks take half a bf16 block's bytes: the host pool holds twice the blocks in the
    same swap_space, and the start-up line names the cache's dtype and its scales."""
    bf16 = KVCacheSpec(4, 2, 64, 16, np.dtype(jnp.bfloat16), tp_size=2)
    fp8 = KVCacheSpec(4, 2, 64, 16, np.dtype(jnp.float8_e4m3fn), tp_size=2)
    assert bf16.bytes_per_block == 2 * fp8.bytes_per_block == 2 * 4 * 1 * 16 * 64 * 2
    engines = {}
    with caplog.at_level(logging.INFO, logger="jpaged.engine.llm_engine"):
        for kv in ("auto", "fp8_e5m2"):
            engines[kv] = jpaged.LLM("tiny", dtype="bfloat16", kv_cache_dtype=kv, swap_space=1 / 64, enforce_eager=True,
                                     **LIMITS)
    assert engines["fp8_e5m2"].stats()["num_cpu_blocks"] == 2 * engines["auto"].stats()["num_cpu_blocks"]
    assert engines["fp8_e5m2"].stats()["kv_cache_dtype"] == "float8_e5m2"
    assert engines["auto"].stats()["kv_cache_dtype"] == "bfloat16"
    assert "KV cache float8_e5m2, scales 1.0" in caplog.text


def test_bad_kv_cache_options_are_value_errors():
    with pytest.raises(ValueError, match="kv_cache_dtype='fp4'"):
        jpaged.LLM("tiny", kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e3m4'"):
        jpaged.LLM("tiny", kv_cache_dtype="fp8_e3m4")
    # A combination no kernel takes fails at start-up, never falls back: Mosaic's wgmma wants
    # bf16/fp16 queries, fp8 pages or not.
    with pytest.raises(ValueError, match="attention_backend='mosaic' needs bf16 or fp16"):
        jpaged.LLM("tiny", dtype="float32", kv_cache_dtype="fp8", attention_backend="mosaic", enforce_eager=True)


def _checkpoint_with_kv_scales(path, k_scales, v_scales):
    """A tiny Llama checkpoint (transformers' save_pretrained) plus compressed-tensors' per-layer
    self_attn.k_scale / v_scale tensors."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tensors = safetensors.numpy.load_file(path / "model.safetensors")
    for i, (k, v) in enumerate(zip(k_scales, v_scales)):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = np.array(k, np.float32)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = np.array(v, np.float32)
    safetensors.numpy.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_checkpoint_scales_are_read_and_used(tmp_path, caplog):
    """Scales in the checkpoint become the pool's; calculate_kv_scales computes its own instead
    (vLLM's order); a model with fp8 scales still loads with kv_cache_dtype='auto'."""
    rng = np.random.default_rng()
    k_scales, v_scales = rng.uniform(0.05, 0.5, 2), rng.uniform(0.05, 0.5, 2)
    _checkpoint_with_kv_scales(tmp_path, k_scales, v_scales)
    prompts = [rng.integers(0, 128, 20).tolist()]
    sp = jpaged.SamplingParams(temperature=0, max_tokens=6, logprobs=1)
    with caplog.at_level(logging.INFO, logger="jpaged.engine.llm_engine"):
        from_file = jpaged.LLM(str(tmp_path), kv_cache_dtype="fp8", enforce_eager=True, max_model_len=128)
    assert "scales from the checkpoint" in caplog.text
    cache = from_file.llm_engine.runner.kv_cache
    np.testing.assert_allclose(np.asarray(cache.k_scale), k_scales.astype(np.float32))
    np.testing.assert_allclose(np.asarray(cache.v_scale), v_scales.astype(np.float32))
    from_file.generate(prompts, sp, use_tqdm=False)
    calculated = jpaged.LLM(str(tmp_path), kv_cache_dtype="fp8", calculate_kv_scales=True, enforce_eager=True,
                            max_model_len=128)
    calculated.generate(prompts, sp, use_tqdm=False)
    scales = np.asarray(calculated.llm_engine.runner.kv_cache.k_scale)
    assert np.isfinite(scales).all() and (scales > 0).all() and not np.allclose(scales, k_scales)
    plain = jpaged.LLM(str(tmp_path), enforce_eager=True, max_model_len=128)  # scales ignored
    assert plain.llm_engine.runner.kv_cache.k_scale is None
    # Every layer needs both scales.
    tensors = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_scale"]
    safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="layer 1 v_scale"):
        jpaged.LLM(str(tmp_path), kv_cache_dtype="fp8", enforce_eager=True, max_model_len=128)


def test_llmcompressor_checkpoint_scales(caplog):
    """A real llm-compressor checkpoint (tests/data/llmcompressor-fp8-kv, made by
    scripts/make_fp8_kv_checkpoint.py: a tiny random Llama whose FP8 KV scales llm-compressor
    calibrated, in its compressed-tensors format): the pool takes its per-layer scales exactly,
    and fp8 pages at those scales answer as the model's own dtype does (within fp8 rounding)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "llmcompressor-fp8-kv")
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["quantization_config"]["kv_cache_scheme"]["type"] == "float"
    tensors = safetensors.numpy.load_file(os.path.join(path, "model.safetensors"))
    expected = {kind: np.array([tensors[f"model.layers.{i}.self_attn.{kind}"].item() for i in range(2)], np.float32)
                for kind in ("k_scale", "v_scale")}
    limits = dict(max_model_len=128, max_num_seqs=4, enforce_eager=True)
    with caplog.at_level(logging.INFO, logger="jpaged.engine.llm_engine"):
        fp8 = jpaged.LLM(path, kv_cache_dtype="fp8", **limits)
    assert "KV cache float8_e4m3fn, scales from the checkpoint" in caplog.text
    cache = fp8.llm_engine.runner.kv_cache
    np.testing.assert_array_equal(np.asarray(cache.k_scale), expected["k_scale"])
    np.testing.assert_array_equal(np.asarray(cache.v_scale), expected["v_scale"])
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 17, 40)]
    sp = jpaged.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    assert_close_outputs(jpaged.LLM(path, **limits).generate(prompts, sp, use_tqdm=False),
                         fp8.generate(prompts, sp, use_tqdm=False), atol=0.02)


def test_fp8_pages_survive_swap_copy_on_write_beam_search_and_prefix_caching():
    """One warmed-up fp8 engine, cramped so it swaps, with n = 2 requests (copy-on-write), a beam
    search and shared prefixes (prefix cache hits): every output equals the same engine's output for that
    request alone in a roomy pool, nothing leaks and nothing compiles after warm-up. (e5m2 pages
    take the same paths; the kernels test both.)"""
    kv_cache_dtype = "fp8"
    rng = np.random.default_rng(SEED)
    prefix = rng.integers(0, 256, 40).tolist()
    prompts, params = fp8_workload(rng, 10)
    prompts = [prefix + p if i % 2 else p for i, p in enumerate(prompts)]
    params = [jpaged.SamplingParams(temperature=0.8, seed=i, n=2, max_tokens=p.max_tokens, ignore_eos=True, logprobs=5)
              if i % 3 == 0 else p for i, p in enumerate(params)]
    # Beam search: beams fork and share fp8 blocks every step.
    params[4] = jpaged.SamplingParams(use_beam_search=True, n=2, temperature=0, max_tokens=params[4].max_tokens,
                                      ignore_eos=True, logprobs=5)
    common = dict(kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=False, **LIMITS)
    cramped = jpaged.LLM("tiny", num_gpu_blocks_override=20, preemption_mode="swap", swap_space=0.05,
                         enable_prefix_caching=True, background_warmup=False, **common)
    compiled = cramped.llm_engine.runner.num_compilations
    outs = cramped.generate(prompts, params, use_tqdm=False)
    assert cramped.stats()["num_preemptions"] > 0 and cramped.stats()["prefix_cache_hits"] > 0
    assert cramped.llm_engine.runner.num_compilations == compiled
    assert_all_blocks_free(cramped)
    roomy = jpaged.LLM("tiny", num_gpu_blocks_override=200, enforce_eager=True, **common)
    assert_close_outputs([roomy.generate([prompt], sp, use_tqdm=False)[0] for prompt, sp in zip(prompts, params)],
                         outs)


def test_fp8_multi_step_and_async_scheduling_match_single_steps():
    rng = np.random.default_rng(SEED)
    prompts, params = fp8_workload(rng, 4)
    params = [jpaged.SamplingParams(temperature=0, max_tokens=p.max_tokens, ignore_eos=True) for p in params]
    common = dict(kv_cache_dtype="fp8", num_gpu_blocks_override=120, enforce_eager=True, **LIMITS)
    reference = jpaged.LLM("tiny", **common).generate(prompts, params, use_tqdm=False)
    for options in (dict(num_scheduler_steps=4), dict(async_scheduling=True)):
        outs = jpaged.LLM("tiny", **options, **common).generate(prompts, params, use_tqdm=False)
        # (multi-step samples on the device alone: no logprobs; the same batches, so tokens match
        # as in test_multi_step's own comparison)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference], options


def test_fp8_tensor_parallel_matches_one_device():
    """TP=2 on the 8-device CPU mesh: each shard quantizes its own heads with the shared scales,
    calculated over all heads (a cross-shard max); greedy tokens as on one device."""
    rng = np.random.default_rng(SEED)
    prompts, params = fp8_workload(rng, 4)
    outs = {}
    for tp in (1, 2):
        llm = jpaged.LLM("tiny", kv_cache_dtype="fp8", calculate_kv_scales=True, tensor_parallel_size=tp,
                         num_gpu_blocks_override=120, enforce_eager=True, **LIMITS)
        outs[tp] = llm.generate(prompts, params, use_tqdm=False)
        scales = np.asarray(llm.llm_engine.runner.kv_cache.k_scale)
        if tp == 1:
            one_device_scales = scales
    np.testing.assert_allclose(scales, one_device_scales, rtol=1e-5)
    assert_close_outputs(outs[1], outs[2])


def test_server_kv_cache_dtype_flag():
    """`jpaged serve --kv-cache-dtype fp8 --calculate-kv-scales` serves completions, and says so at start-up."""
    from test_server import Server, post, run

    server = Server("--kv-cache-dtype", "fp8", "--calculate-kv-scales", "--enforce-eager", "--max-model-len", "128",
                    "--max-num-seqs", "4")
    try:
        status, body = run(post(server.url, "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 5,
                                                                  "ignore_eos": True},
                                headers={}))
        assert status == 200 and body["usage"]["completion_tokens"] == 5, json.dumps(body)
        assert any("KV cache float8_e4m3fn, scales calculated from the first step" in line for line in server.log)
    finally:
        assert server.stop() == 0


def test_fp8_v_transposed_engine_matches_the_standard_layout():
    """kv_cache_v_transposed (V blocks [head_dim, block_size], pallas_kernels' variant layout): a
    cramped engine that swaps (the host keeps V in the standard layout), copies blocks on write (n=2)
    and hits cached prefixes gives the standard layout's outputs; fp8 only, and Mosaic (no prefill
    over transposed V) refused at start-up."""
    rng = np.random.default_rng(SEED)
    prefix = rng.integers(0, 256, 40).tolist()
    prompts, params = fp8_workload(rng, 8)
    prompts = [prefix + p if i % 2 else p for i, p in enumerate(prompts)]
    params[3] = jpaged.SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=params[3].max_tokens, ignore_eos=True,
                                      logprobs=5)
    common = dict(kv_cache_dtype="fp8", num_gpu_blocks_override=20, preemption_mode="swap", swap_space=0.05,
                  enable_prefix_caching=True, enforce_eager=True, **LIMITS)
    outs = {}
    for transposed in (False, True):
        llm = jpaged.LLM("tiny", kv_cache_v_transposed=transposed, **common)
        outs[transposed] = llm.generate(prompts, params, use_tqdm=False)
        pool = llm.llm_engine.runner.kv_cache
        k_shape, v_shape = pool.k_pages.shape, pool.v_pages.shape
        assert pool.v_transposed == transposed
        assert v_shape == (k_shape[:2] + k_shape[:1:-1] if transposed else k_shape), (k_shape, v_shape)
        assert llm.stats()["num_preemptions"] > 0 and llm.stats()["prefix_cache_hits"] > 0
        assert_all_blocks_free(llm)
    assert_close_outputs(outs[False], outs[True], atol=1e-4)
    with pytest.raises(ValueError, match="kv_cache_v_transposed"):
        jpaged.LLM("tiny", kv_cache_v_transposed=True)  # 16-bit pages
    with pytest.raises(ValueError, match="no prefill over transposed V"):
        jpaged.LLM("tiny", kv_cache_dtype="fp8", kv_cache_v_transposed=True, attention_backend="mosaic",
                   enforce_eager=True)
