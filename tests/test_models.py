"""Parity of every supported architecture with Hugging Face transformers (torch, fp32), on tiny
random checkpoints written with save_pretrained and loaded back through jpaged's loader."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from flax import nnx

import jpaged
from jpaged.models.forward_context import AttentionMetadata, ForwardContext, forward_context
from jpaged.models.loader import build_model, iter_safetensors

VOCAB = 160
COMMON = dict(vocab_size=VOCAB, max_position_embeddings=256)
LLAMA = dict(COMMON, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             initializer_range=0.3)
PHI3 = dict(LLAMA, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # Phi-3's defaults lie outside VOCAB
GEMMA = dict(LLAMA, pad_token_id=0, bos_token_id=1, eos_token_id=2, layer_types=["sliding_attention", "full_attention"])
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}

CASES = {
    "llama2-mha": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(LLAMA, num_key_value_heads=4)),
    "llama3-gqa-rope-scaling": (tf.LlamaConfig, tf.LlamaForCausalLM,
                                dict(LLAMA, num_key_value_heads=2, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)),
    "llama-mqa-tied-bias": (tf.LlamaConfig, tf.LlamaForCausalLM,
                            dict(LLAMA, num_key_value_heads=1, tie_word_embeddings=True, attention_bias=True)),
    "mistral-gqa": (tf.MistralConfig, tf.MistralForCausalLM, dict(LLAMA, num_key_value_heads=2, head_dim=16)),
    # Prompts of 17-40 tokens and 16 new ones: every sequence outgrows the window.
    "mistral-sliding-window": (tf.MistralConfig, tf.MistralForCausalLM,
                               dict(LLAMA, num_key_value_heads=2, sliding_window=11)),
    "qwen2-mqa-tied": (tf.Qwen2Config, tf.Qwen2ForCausalLM,
                       dict(LLAMA, num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen3-gqa": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(LLAMA, num_key_value_heads=2, head_dim=32)),
    # Layer 0 full, layer 1 windowed (max_window_layers).
    "qwen3-tied-sliding-layer": (tf.Qwen3Config, tf.Qwen3ForCausalLM,
                                 dict(LLAMA, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
                                      use_sliding_window=True, sliding_window=9, max_window_layers=1)),
    "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(PHI3, num_key_value_heads=2)),
    # LongRoPE past original_max_position_embeddings (long factors, attention factor); Phi-4-mini's
    # partial rotary factor; a window over every layer. Every sequence here is longer than 4, so HF
    # too rotates with the long factors throughout (it switches factors with the sequence's length).
    "phi3-longrope-partial-sliding": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(
        PHI3, num_key_value_heads=1, original_max_position_embeddings=4, partial_rotary_factor=0.5,
        sliding_window=13, rope_scaling={"type": "longrope", "short_factor": [1.5, 1.0, 3.0, 1.2],
                                         "long_factor": [2.0, 4.0, 8.0, 16.0]})),
    # Layer 0 local (window 10), layer 1 global; attention and final logits soft-capped low enough
    # to bite; head_dim != hidden / heads.
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, dict(
        GEMMA, num_key_value_heads=2, head_dim=24, query_pre_attn_scalar=20, sliding_window=10,
        attn_logit_softcapping=3.0, final_logit_softcapping=4.0)),
    # Local and global layers with their own rope bases (the global one linearly scaled).
    "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, dict(
        GEMMA, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=12,
        sliding_window_pattern=2, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}})),
    # 8 experts, top 2 (renormalised); a window over every layer.
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, dict(
        LLAMA, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, sliding_window=14)),
    # Top 3 of 6, not renormalised (norm_topk_prob=False); q/k norm.
    "qwen3-moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(
        LLAMA, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=40,
        norm_topk_prob=False)),
    "opt": (tf.OPTConfig, tf.OPTForCausalLM,
            dict(COMMON, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                 word_embed_proj_dim=64, init_std=0.3)),
    "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel,
             dict(vocab_size=VOCAB, n_positions=256, n_embd=64, n_layer=2, n_head=4, initializer_range=0.3)),
}


def make_checkpoint(path, case, **save_kwargs):
    config_cls, model_cls, kwargs = CASES[case]
    torch.manual_seed(np.random.randint(1 << 30))
    model = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():  # HF zero-inits biases and one-inits norms: randomise them so they are tested
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
            elif "norm" in name or ".ln_" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(path, **save_kwargs)
    return model


def prompt_logits(llm: jpaged.LLM, ids: list[int]) -> np.ndarray:
    """All prompt positions' logits through the paged prefill path, in fresh pages 0, 1, ..."""
    runner = llm.llm_engine.runner
    model = nnx.merge(runner.graphdef, runner.state)
    n, bs = len(ids), runner.block_size
    kv_cache = jax.tree.map(jnp.zeros_like, runner.kv_cache)
    meta = AttentionMetadata(slot_mapping=jnp.arange(n, dtype=jnp.int32),
                             block_tables=jnp.arange(-(-n // bs), dtype=jnp.int32)[None],
                             context_lens=jnp.array([n], jnp.int32), query_start_loc=jnp.array([0, n], jnp.int32))
    with forward_context(ForwardContext(meta)):
        hidden, _ = model(jnp.array(ids, jnp.int32), jnp.arange(n, dtype=jnp.int32), kv_cache)
    return np.asarray(model.compute_logits(hidden))


def hf_greedy(model, ids: list[int], steps: int, with_logprobs=False):
    """HF's greedy continuation (the whole sequence recomputed each step), and its logprobs."""
    tokens, logprobs = torch.tensor([ids]), []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(tokens).logits[0, -1].double()
            nxt = logits.argmax()
            logprobs.append(torch.log_softmax(logits, -1)[nxt].item())
            tokens = torch.cat([tokens, nxt.view(1, 1)], dim=1)
    return (tokens[0, len(ids):].tolist(), logprobs) if with_logprobs else tokens[0, len(ids):].tolist()


@pytest.mark.parametrize("case,backend", [(case, "xla") for case in CASES] + [(case, "pallas") for case in ("llama3-gqa-rope-scaling", "mistral-sliding-window", "gemma2")])
def test_hf_parity(case, backend, tmp_path):
    hf = make_checkpoint(tmp_path, case)
    # 64 blocks of 8 (4 sequences of 128 tokens): on a GPU a pool sized from memory would be most of
    # it, and prompt_logits copies the pool.
    llm = jpaged.LLM(str(tmp_path), dtype="float32", block_size=8, attention_backend=backend, enforce_eager=True,
                     max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks_override=64)
    ids = np.random.randint(0, VOCAB, size=np.random.randint(17, 40)).tolist()

    ours = prompt_logits(llm, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    # fp32 on both sides: rounding grows with the logits' size (LongRoPE's attention factor scales them).
    assert np.abs(ours - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())

    out = llm.generate([ids], jpaged.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf, ids, 16)


def test_sharded_bf16_checkpoint_auto_dtype(tmp_path):
    hf = make_checkpoint(tmp_path, "llama3-gqa-rope-scaling", max_shard_size="20KB")
    hf.to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    # dtype="auto" -> bfloat16
    llm = jpaged.LLM(str(tmp_path), block_size=8, attention_backend="xla", enforce_eager=True, max_model_len=128)
    assert all(leaf.dtype == np.dtype("bfloat16") for leaf in
               jax.tree_util.tree_leaves(llm.llm_engine.runner.state))
    ids = np.random.randint(0, VOCAB, size=24).tolist()
    with torch.no_grad():
        ref = hf.float()(torch.tensor([ids])).logits[0].numpy()
    ours = prompt_logits(llm, ids)
    # bf16 weights and activations: loose, but proves the tensors landed in the right places.
    assert np.corrcoef(ours.ravel(), ref.ravel())[0, 1] > 0.99


NEW_ARCHITECTURES = ["mistral-sliding-window", "qwen3-tied-sliding-layer", "phi3-longrope-partial-sliding", "gemma2",
                     "gemma3", "mixtral", "qwen3-moe"]


@pytest.mark.parametrize("case", NEW_ARCHITECTURES)
def test_hf_parity_tp2_under_recompute_preemption(case, tmp_path):
    """Tensor parallelism over 2 devices, and four sequences that all start at once (one block
    each) and grow past what the pool holds, even with the blocks that fell out of a window freed
    (3 each at most, 10 in all): some are preempted and recomputed, their prefill running through
    the windows. Greedy tokens equal HF's, logprobs within 1e-4."""
    hf = make_checkpoint(tmp_path, case)
    llm = jpaged.LLM(str(tmp_path), dtype="float32", block_size=8, attention_backend="xla", enforce_eager=True,
                     max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, tensor_parallel_size=2,
                     num_gpu_blocks_override=10, preemption_mode="recompute")
    # Equal lengths keep the windows in phase: all four hold their most blocks at once (with
    # lengths drawn from 5-8, a CI run's windows took turns and fit the pool: no preemption).
    prompts = [np.random.randint(0, VOCAB, size=8).tolist() for _ in range(4)]
    outs = llm.generate(prompts, jpaged.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1),
                        use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    for ids, out in zip(prompts, outs):
        tokens, logprobs = hf_greedy(hf, ids, 40, with_logprobs=True)
        assert out.outputs[0].token_ids == tokens
        ours = [lp[t] for lp, t in zip(out.outputs[0].logprobs, tokens)]
        # fp32 against float64-softmaxed fp32 logits: LongRoPE's scaled logits round coarser
        # (a CI run saw 1.3e-4 on a logprob of -1.44).
        np.testing.assert_allclose(ours, logprobs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["mixtral", "qwen3-moe"])
def test_moe_routing_equals_hf(case, tmp_path):
    """Layer 0's sparse block on random hidden states: the same experts (no near-ties among the
    chosen and the next best), routing weights and output as HF's."""
    hf = make_checkpoint(tmp_path, case)
    cfg = tf.AutoConfig.from_pretrained(tmp_path)
    model = build_model(cfg, iter_safetensors(str(tmp_path)), dtype=jnp.float32, attention_backend="xla")
    graphdef, state = nnx.split(model.layers.layer)
    layer0 = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state))
    block = hf.model.layers[0].mlp  # transformers 5 names Mixtral's block `mlp` too (not in the checkpoint)
    x = np.random.randn(50, cfg.hidden_size).astype(np.float32)
    with torch.no_grad():
        _, hf_weights, hf_experts = block.gate(torch.tensor(x))
        hf_out = block(torch.tensor(x)[None])[0].numpy()
        probs = torch.softmax(block.gate(torch.tensor(x))[0], -1).sort(-1, descending=True).values.numpy()
    k = cfg.num_experts_per_tok
    # Ties-free tokens only: where the k-th and next best are close, the choice is a rounding accident.
    clear = probs[:, k - 1] - probs[:, k] > 1e-4
    assert clear.sum() >= 40
    experts, weights = layer0.mlp.route(jnp.asarray(x))
    ours, theirs = np.sort(np.asarray(experts), -1)[clear], np.sort(hf_experts.numpy(), -1)[clear]
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_allclose(np.sort(np.asarray(weights), -1)[clear], np.sort(hf_weights.numpy(), -1)[clear],
                               atol=1e-6)
    # Sums of experts' fp32 outputs: a CI run saw 1.1e-5 off on a value of 0.002 among 3200.
    np.testing.assert_allclose(np.asarray(layer0.mlp(jnp.asarray(x)))[clear], hf_out[clear], rtol=1e-5, atol=3e-5)
