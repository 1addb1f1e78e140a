"""Gemma 2 and Gemma 3 (text): embeddings scaled by sqrt(hidden), GeGLU MLP, RMSNorms with (1 + w)
before and after both the attention and the MLP, queries scaled by query_pre_attn_scalar^-1/2,
local (sliding-window) layers alternating with global ones as `layer_types` says.

Gemma 2 soft-caps the attention logits (in the kernels) and the final logits; Gemma 3 drops the
soft-capping for a per-head RMSNorm of q and k, and gives local and global layers their own rope
base (and scaling). Weights are stored once for all layers: a layer's kind is data, picked by the
scan's layer index.
"""

import jax.numpy as jnp
from flax import nnx

from jpaged.models.batch_invariant import separate
from jpaged.models.layers import (Attention, Embedding, GatedMLP, HFWeights, Linear,
                                  RMSNorm, RopeConfig, sliding_windows)
from jpaged.models.llama import LlamaForCausalLM
from jpaged.models.paged_attention import AttentionOps
from jpaged.models.stacked import LayerStack


class GemmaDecoderLayer(nnx.Module):
    def __init__(self, cfg, *, ops, dtype):
        gemma3 = cfg.model_type == "gemma3_text"
        norm = lambda dim=cfg.hidden_size: RMSNorm(dim, cfg.rms_norm_eps, dtype=dtype, offset=1.0)  # noqa: E731
        layer_types = tuple(cfg.layer_types)
        self.input_layernorm = norm()
        self.self_attn = Attention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, ops=ops, dtype=dtype,
            qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
            rope=tuple(RopeConfig.from_hf(cfg, cfg.head_dim, layer_type=t) for t in layer_types),
            scale=cfg.query_pre_attn_scalar ** -0.5, sliding_window=sliding_windows(cfg),
            logits_soft_cap=cfg.attn_logit_softcapping, qk_norm=(lambda: norm(cfg.head_dim)) if gemma3 else None)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_activation, dtype=dtype)
        self.post_feedforward_layernorm = norm()

    def __call__(self, x, positions, kv_cache):
        h, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), kv_cache

    def hf_weights(self, prefix: str) -> HFWeights:
        norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm")
        specs = {**self.self_attn.hf_weights(f"{prefix}.self_attn"), **self.mlp.hf_weights(f"{prefix}.mlp")}
        for name in norms:
            specs.update(getattr(self, name).hf_weights(f"{prefix}.{name}"))
        return specs


class GemmaForCausalLM(nnx.Module):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (Gemma 3's text-only checkpoints, e.g. gemma-3-1b)."""

    def __init__(self, cfg, *, dtype, ops: AttentionOps, max_model_len: int | None = None):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_scale = cfg.hidden_size ** 0.5
        self.layers = LayerStack(lambda: GemmaDecoderLayer(cfg, ops=ops, dtype=dtype), cfg.num_hidden_layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, offset=1.0)
        self.final_logit_softcapping = cfg.final_logit_softcapping
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            (cfg.hidden_size,), (cfg.vocab_size,), ("embed", "vocab"), dtype=dtype)

    def __call__(self, input_ids, positions, kv_cache):
        x = self.embed_tokens(input_ids)
        # HF rounds the scale to the activations' dtype first.
        x = x * jnp.asarray(self.embed_scale, x.dtype)
        if self.embed_tokens.batch_invariant:  # a product the first residual add would contract with
            x = separate(x)
        x, kv_cache = self.layers(x, positions, kv_cache)
        return self.norm(x), kv_cache

    def compute_logits(self, hidden):
        logits = self.embed_tokens.attend(hidden) if self.lm_head is None else self.lm_head(hidden)
        logits = logits.astype(jnp.float32)
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = cap * jnp.tanh(logits / cap)
            if self.embed_tokens.batch_invariant:  # a product: no FMA with what the sampler subtracts
                logits = separate(logits)
        return logits

    # Llama's checkpoint layout: the same tensor names.
    hf_weights = LlamaForCausalLM.hf_weights
    ignored_hf_weights = LlamaForCausalLM.ignored_hf_weights
