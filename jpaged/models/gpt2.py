"""GPT-2: learned absolute positions, pre-LayerNorm decoder, gelu_new MLP, Conv1D weights
(stored [in, out]) with q/k/v fused in one `c_attn` tensor; output tied to the token embedding."""

import jax.numpy as jnp
from flax import nnx

from jpaged.models.layers import (Attention, Embedding, HFWeights, LayerNorm, MLP,
                                  WeightTarget)
from jpaged.models.paged_attention import AttentionOps
from jpaged.models.stacked import LayerStack


class GPT2Block(nnx.Module):
    def __init__(self, cfg, *, ops, dtype):
        head_dim = cfg.n_embd // cfg.n_head
        self.ln_1 = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon, dtype=dtype)
        self.attn = Attention(cfg.n_embd, cfg.n_head, cfg.n_head, head_dim, ops=ops, dtype=dtype,
                              qkv_bias=True, o_bias=True, scale=head_dim ** -0.5 if cfg.scale_attn_weights else 1.0)
        self.ln_2 = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon, dtype=dtype)
        self.mlp = MLP(cfg.n_embd, cfg.n_inner or 4 * cfg.n_embd, cfg.activation_function, dtype=dtype)

    def __call__(self, x, positions, kv_cache):
        h, kv_cache = self.attn(self.ln_1(x), positions, kv_cache)
        x = x + h
        return x + self.mlp(self.ln_2(x)), kv_cache

    def hf_weights(self, prefix: str) -> HFWeights:
        attn = self.attn
        embed = attn.o_proj.out_shape[0]
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)

        def part(i, proj, is_bias):
            # c_attn packs [q | k | v] along its output columns.
            cols = slice(i * embed, (i + 1) * embed)
            if is_bias:
                return WeightTarget(proj.bias, (3 * embed,), lambda a: a[cols].reshape(proj.out_shape))
            return WeightTarget(proj.kernel, (embed, 3 * embed), lambda a: a[:, cols].reshape(proj.in_shape + proj.out_shape))

        return {f"{prefix}.attn.c_attn.weight": [part(i, p, False) for i, p in enumerate(projections)],
                f"{prefix}.attn.c_attn.bias": [part(i, p, True) for i, p in enumerate(projections)],
                **attn.o_proj.hf_weights(f"{prefix}.attn.c_proj", hf_layout="in_out"),
                **self.ln_1.hf_weights(f"{prefix}.ln_1"), **self.ln_2.hf_weights(f"{prefix}.ln_2"),
                **self.mlp.fc1.hf_weights(f"{prefix}.mlp.c_fc", hf_layout="in_out"),
                **self.mlp.fc2.hf_weights(f"{prefix}.mlp.c_proj", hf_layout="in_out")}


class GPT2LMHeadModel(nnx.Module):
    def __init__(self, cfg, *, dtype, ops: AttentionOps, max_model_len: int | None = None):
        if cfg.scale_attn_by_inverse_layer_idx or cfg.reorder_and_upcast_attn:
            raise ValueError("GPT-2 with scale_attn_by_inverse_layer_idx or reorder_and_upcast_attn is not supported")
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd, dtype=dtype)
        self.wpe = Embedding(cfg.n_positions, cfg.n_embd, ("positions", "embed"), dtype=dtype)
        self.h = LayerStack(lambda: GPT2Block(cfg, ops=ops, dtype=dtype), cfg.n_layer)
        self.ln_f = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon, dtype=dtype)

    def __call__(self, input_ids, positions, kv_cache):
        x, kv_cache = self.h(self.wte(input_ids) + self.wpe(positions), positions, kv_cache)
        return self.ln_f(x), kv_cache

    def compute_logits(self, hidden):
        return self.wte.attend(hidden).astype(jnp.float32)

    def hf_weights(self) -> HFWeights:
        specs = {**self.wte.hf_weights("transformer.wte.weight"), **self.wpe.hf_weights("transformer.wpe.weight"),
                 **self.ln_f.hf_weights("transformer.ln_f"), **self.h.hf_weights(lambda i: f"transformer.h.{i}")}
        return specs

    # Causal-mask buffers saved by older transformers versions, and the tied head.
    ignored_hf_weights = (r"transformer\.h\.\d+\.attn\.(masked_)?bias", r"lm_head\.weight")
