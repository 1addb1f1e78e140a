"""Llama family: Llama 2, Llama 3 (incl. llama3 rope scaling), Mistral, Qwen2 and Qwen3.

Pre-norm decoder with RMSNorm, rotary embeddings, GQA/MQA and a SiLU-gated MLP. Qwen2 adds
q/k/v biases (and usually ties the embeddings), Qwen3 a per-head RMSNorm of q and k. Mistral's
sliding window covers every layer; Qwen2/3 window the layers their `layer_types` name.
"""

from flax import nnx

from jpaged.models.layers import (Attention, Embedding, GatedMLP, HFWeights, Linear,
                                  RMSNorm, RopeConfig, sliding_windows)
from jpaged.models.paged_attention import AttentionOps
from jpaged.models.stacked import LayerStack


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def llama_attention(cfg, *, ops, dtype, max_model_len=None, qkv_bias=False, o_bias=False) -> Attention:
    head_dim = head_dim_of(cfg)
    qk_norm = cfg.model_type in ("qwen3", "qwen3_moe")
    return Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, ops=ops,
                     dtype=dtype, qkv_bias=qkv_bias, o_bias=o_bias,
                     rope=RopeConfig.from_hf(cfg, head_dim, max_model_len=max_model_len),
                     sliding_window=sliding_windows(cfg),
                     qk_norm=(lambda: RMSNorm(head_dim, cfg.rms_norm_eps, dtype=dtype)) if qk_norm else None)


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, self_attn: Attention, mlp: nnx.Module, cfg, *, dtype):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = mlp

    def __call__(self, x, positions, kv_cache):
        h, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache

    def hf_weights(self, prefix: str) -> HFWeights:
        return {**self.input_layernorm.hf_weights(f"{prefix}.input_layernorm"),
                **self.self_attn.hf_weights(f"{prefix}.self_attn"),
                **self.post_attention_layernorm.hf_weights(f"{prefix}.post_attention_layernorm"),
                **self.mlp.hf_weights(f"{prefix}.mlp")}


class LlamaForCausalLM(nnx.Module):
    """Also the base of the families that keep Llama's outer structure (Phi-3, the MoE models):
    they override `make_layer`."""

    def __init__(self, cfg, *, dtype, ops: AttentionOps, max_model_len: int | None = None):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = LayerStack(lambda: self.make_layer(cfg, ops=ops, dtype=dtype, max_model_len=max_model_len),
                                 cfg.num_hidden_layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else Linear(
            (cfg.hidden_size,), (cfg.vocab_size,), ("embed", "vocab"), dtype=dtype)

    @staticmethod
    def make_layer(cfg, *, ops, dtype, max_model_len) -> nnx.Module:
        qwen2 = cfg.model_type == "qwen2"
        bias = getattr(cfg, "attention_bias", False)
        attn = llama_attention(cfg, ops=ops, dtype=dtype, max_model_len=max_model_len, qkv_bias=qwen2 or bias,
                               o_bias=not qwen2 and bias)
        return LlamaDecoderLayer(attn, GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype=dtype),
                                 cfg, dtype=dtype)

    def __call__(self, input_ids, positions, kv_cache):
        x, kv_cache = self.layers(self.embed_tokens(input_ids), positions, kv_cache)
        return self.norm(x), kv_cache

    def compute_logits(self, hidden):
        logits = self.embed_tokens.attend(hidden) if self.lm_head is None else self.lm_head(hidden)
        return logits.astype("float32")

    def hf_weights(self) -> HFWeights:
        specs = {**self.embed_tokens.hf_weights("model.embed_tokens.weight"), **self.norm.hf_weights("model.norm"),
                 **self.layers.hf_weights(lambda i: f"model.layers.{i}")}
        if self.lm_head is not None:
            specs.update(self.lm_head.hf_weights("lm_head"))
        return specs

    # Tensors some checkpoints carry that we do not need (recomputed or tied).
    ignored_hf_weights = (r".*rotary_emb\.inv_freq", r"lm_head\.weight")
