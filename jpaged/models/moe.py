"""Mixture of experts: Mixtral and Qwen3-MoE. Llama's decoder (Qwen3's q/k norm for Qwen3-MoE) with
the MLP replaced by a sparse block: a router picks each token's top-k experts, and the experts'
SiLU-gated MLPs run as grouped matmuls (`jax.lax.ragged_dot`) over the tokens sorted by expert.

Expert weights are stacked at load time ([experts, ...], from the checkpoint's one tensor per
expert). Tensor parallelism splits every expert's intermediate dimension ("mlp", as a dense MLP),
so each device holds a slice of every expert and the sum over devices follows the down projection.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jpaged.models.batch_invariant import row_tiled_dot, separate, tree_sum
from jpaged.models.layers import HFWeights, WeightTarget, activation, fp32_precision, weight_param
from jpaged.models.llama import LlamaDecoderLayer, LlamaForCausalLM, llama_attention


class SparseMoE(nnx.Module):
    def __init__(self, hidden, intermediate, num_experts, top_k, act, *, norm_topk_prob: bool, dtype):
        self.top_k, self.act, self.norm_topk_prob = top_k, act, norm_topk_prob
        self.router = weight_param((hidden, num_experts), ("embed", "experts"), dtype)
        self.gate_proj = weight_param((num_experts, hidden, intermediate), ("experts", "embed", "mlp"), dtype)
        self.up_proj = weight_param((num_experts, hidden, intermediate), ("experts", "embed", "mlp"), dtype)
        self.down_proj = weight_param((num_experts, intermediate, hidden), ("experts", "mlp", "embed"), dtype)
        self.batch_invariant = False  # the engine's batch_invariant mode: every expert on every token (static)

    def route(self, x):
        """Each token's top-k experts [T, k] and their weights [T, k] (fp32): softmax over all
        experts, then the top k, renormalised to sum to 1 when the model says so."""
        logits = jnp.matmul(x, self.router[...], precision=fp32_precision(x.dtype))
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, self.top_k)
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return experts, weights

    def __call__(self, x):
        if self.batch_invariant:
            return self._dense(x)
        num_tokens, num_experts = x.shape[0], self.router.shape[-1]
        experts, weights = self.route(x)
        # Sort the (token, expert) pairs by expert: each expert's rows are then one contiguous group.
        order = jnp.argsort(experts.reshape(-1), stable=True)
        token = order // self.top_k
        group_sizes = jnp.bincount(experts.reshape(-1), length=num_experts).astype(jnp.int32)
        grouped = functools.partial(jax.lax.ragged_dot, group_sizes=group_sizes, precision=fp32_precision(x.dtype))
        rows = x[token]
        gate, up = grouped(rows, self.gate_proj[...]), grouped(rows, self.up_proj[...])
        out = grouped(activation(self.act)(gate) * up, self.down_proj[...])
        out = out * weights.reshape(-1)[order][:, None].astype(out.dtype)
        return jnp.zeros((num_tokens, x.shape[1]), out.dtype).at[token].add(out).astype(x.dtype)

    def _dense(self, x):
        """Batch-invariant mode: ragged_dot's sums follow the group sizes (the batch), so every expert
        runs on every token as row-tiled dots ([tokens, experts, intermediate]) and the down
        projection sums over experts and their rows at once, weighted (0 for the experts not
        picked): a token's bits depend on its own row only. num_experts times the MLP's work."""
        precision = fp32_precision(x.dtype)
        logits = row_tiled_dot(x, self.router[...], ((1,), (0,)), precision).astype(jnp.float32)
        e = separate(jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)))  # fixed-order softmax
        probs = e / tree_sum(e)[:, None]
        weights, experts = jax.lax.top_k(probs, self.top_k)
        if self.norm_topk_prob:
            weights = weights / tree_sum(weights)[:, None]
        dense = jnp.zeros_like(probs).at[jnp.arange(x.shape[0])[:, None], experts].set(weights)
        gate = row_tiled_dot(x, self.gate_proj[...], ((1,), (1,)), precision)  # [T, E, I]
        up = row_tiled_dot(x, self.up_proj[...], ((1,), (1,)), precision)
        h = separate(activation(self.act)(gate) * up) * dense[:, :, None].astype(x.dtype)
        return row_tiled_dot(h, self.down_proj[...], ((1, 2), (0, 1)), precision).astype(x.dtype)

    def hf_weights(self, prefix: str, router: str, names: tuple[str, str, str]) -> HFWeights:
        """`names`: the checkpoint's (gate, up, down) names of expert e's [out, in] tensors."""
        # Shapes from the end: under a layer stack the params have a leading layers axis.
        num_experts, hidden, intermediate = self.gate_proj.shape[-3:]
        specs = {f"{prefix}.{router}.weight": [WeightTarget(self.router, (num_experts, hidden), lambda a: a.T)]}
        for e in range(num_experts):
            for param, name, shape in ((self.gate_proj, names[0], (intermediate, hidden)),
                                       (self.up_proj, names[1], (intermediate, hidden)),
                                       (self.down_proj, names[2], (hidden, intermediate))):
                specs[f"{prefix}.experts.{e}.{name}.weight"] = [WeightTarget(param, shape, lambda a: a.T, expert=e)]
        return specs


# The checkpoint's names: (the block, its router, each expert's (gate, up, down) [out, in] tensors).
MOE_NAMES = {"mixtral": ("block_sparse_moe", "gate", ("w1", "w3", "w2")),
             "qwen3_moe": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj"))}


class MoEDecoderLayer(LlamaDecoderLayer):
    def __init__(self, self_attn, mlp: SparseMoE, cfg, *, dtype):
        super().__init__(self_attn, mlp, cfg, dtype=dtype)
        self.names = MOE_NAMES[cfg.model_type]

    def hf_weights(self, prefix: str) -> HFWeights:
        block, router, experts = self.names
        return {**self.input_layernorm.hf_weights(f"{prefix}.input_layernorm"),
                **self.self_attn.hf_weights(f"{prefix}.self_attn"),
                **self.post_attention_layernorm.hf_weights(f"{prefix}.post_attention_layernorm"),
                **self.mlp.hf_weights(f"{prefix}.{block}", router, experts)}


class MixtralForCausalLM(LlamaForCausalLM):
    """MixtralForCausalLM and Qwen3MoeForCausalLM."""

    @staticmethod
    def make_layer(cfg, *, ops, dtype, max_model_len) -> nnx.Module:
        if cfg.model_type == "qwen3_moe":
            if cfg.decoder_sparse_step != 1 or cfg.mlp_only_layers:
                raise ValueError("Qwen3-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not "
                                 "supported")
            moe = SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                            cfg.hidden_act, norm_topk_prob=cfg.norm_topk_prob, dtype=dtype)
        else:
            moe = SparseMoE(cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok,
                            cfg.hidden_act, norm_topk_prob=True, dtype=dtype)
        bias = getattr(cfg, "attention_bias", False)
        attn = llama_attention(cfg, ops=ops, dtype=dtype, max_model_len=max_model_len, qkv_bias=bias, o_bias=bias)
        return MoEDecoderLayer(attn, moe, cfg, dtype=dtype)
