"""Llama family: Llama 2, Llama 3 (incl. llama3 rope scaling), Mistral and Qwen2.

Pre-norm decoder with RMSNorm, rotary embeddings, GQA/MQA and a SiLU-gated MLP. Qwen2
differs only by q/k/v biases (and usually tied embeddings); Mistral's sliding window is not
implemented, so the engine caps max_model_len at it.
"""

from flax import nnx

from jpaged.models.layers import (Attention, AttentionOps, Embedding, GatedMLP, HFWeights, LayerStack, Linear,
                                  RMSNorm, RopeConfig)


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, cfg, head_dim, *, ops, dtype, qkv_bias, o_bias):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim,
                                   ops=ops, dtype=dtype, qkv_bias=qkv_bias, o_bias=o_bias,
                                   rope=RopeConfig.from_hf(cfg, head_dim))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype=dtype)

    def __call__(self, x, positions, kv_cache, meta):
        h, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, meta)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache

    def hf_weights(self, prefix: str) -> HFWeights:
        return {**self.input_layernorm.hf_weights(f"{prefix}.input_layernorm"),
                **self.self_attn.hf_weights(f"{prefix}.self_attn"),
                **self.post_attention_layernorm.hf_weights(f"{prefix}.post_attention_layernorm"),
                **self.mlp.hf_weights(f"{prefix}.mlp")}


class LlamaForCausalLM(nnx.Module):
    def __init__(self, cfg, *, dtype, ops: AttentionOps):
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        qwen2 = cfg.model_type == "qwen2"
        qkv_bias = qwen2 or getattr(cfg, "attention_bias", False)
        o_bias = not qwen2 and getattr(cfg, "attention_bias", False)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = LayerStack(lambda: LlamaDecoderLayer(cfg, head_dim, ops=ops, dtype=dtype, qkv_bias=qkv_bias,
                                                           o_bias=o_bias), cfg.num_hidden_layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else Linear(
            (cfg.hidden_size,), (cfg.vocab_size,), ("embed", "vocab"), dtype=dtype)

    def __call__(self, input_ids, positions, kv_cache, meta):
        x, kv_cache = self.layers(self.embed_tokens(input_ids), positions, kv_cache, meta)
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
