"""OPT (Meta): learned positions offset by 2, pre-LayerNorm decoder, ReLU MLP, biases everywhere,
output projection tied to the token embedding."""

import jax.numpy as jnp
from flax import nnx

from jpaged.models.layers import Attention, Embedding, HFWeights, LayerNorm, MLP
from jpaged.models.paged_attention import AttentionOps
from jpaged.models.stacked import LayerStack

# OPT's learned position table has two extra leading rows (a fairseq legacy).
POSITION_OFFSET = 2


class OPTDecoderLayer(nnx.Module):
    def __init__(self, cfg, *, ops, dtype):
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.self_attn_layer_norm = LayerNorm(cfg.hidden_size, 1e-5, dtype=dtype)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_attention_heads, head_dim,
                                   ops=ops, dtype=dtype, qkv_bias=True, o_bias=True)
        self.final_layer_norm = LayerNorm(cfg.hidden_size, 1e-5, dtype=dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.ffn_dim, cfg.activation_function, dtype=dtype)

    def __call__(self, x, positions, kv_cache):
        h, kv_cache = self.self_attn(self.self_attn_layer_norm(x), positions, kv_cache)
        x = x + h
        return x + self.mlp(self.final_layer_norm(x)), kv_cache

    def hf_weights(self, prefix: str) -> HFWeights:
        return {**self.self_attn_layer_norm.hf_weights(f"{prefix}.self_attn_layer_norm"),
                **self.self_attn.hf_weights(f"{prefix}.self_attn", names=("q_proj", "k_proj", "v_proj", "out_proj")),
                **self.final_layer_norm.hf_weights(f"{prefix}.final_layer_norm"),
                **self.mlp.fc1.hf_weights(f"{prefix}.fc1"), **self.mlp.fc2.hf_weights(f"{prefix}.fc2")}


class OPTForCausalLM(nnx.Module):
    def __init__(self, cfg, *, dtype, ops: AttentionOps, max_model_len: int | None = None):
        unsupported = {"do_layer_norm_before": (cfg.do_layer_norm_before, True),
                       "word_embed_proj_dim": (cfg.word_embed_proj_dim, cfg.hidden_size),
                       "enable_bias": (getattr(cfg, "enable_bias", True), True),
                       "_remove_final_layer_norm": (getattr(cfg, "_remove_final_layer_norm", False), False)}
        for field, (value, supported) in unsupported.items():
            if value != supported:
                raise ValueError(f"OPT with {field}={value} is not supported (only {supported})")
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_positions = Embedding(cfg.max_position_embeddings + POSITION_OFFSET, cfg.hidden_size,
                                         ("positions", "embed"), dtype=dtype)
        self.layers = LayerStack(lambda: OPTDecoderLayer(cfg, ops=ops, dtype=dtype), cfg.num_hidden_layers)
        self.final_layer_norm = LayerNorm(cfg.hidden_size, 1e-5, dtype=dtype)

    def __call__(self, input_ids, positions, kv_cache):
        x = self.embed_tokens(input_ids) + self.embed_positions(positions + POSITION_OFFSET)
        x, kv_cache = self.layers(x, positions, kv_cache)
        return self.final_layer_norm(x), kv_cache

    def compute_logits(self, hidden):
        return self.embed_tokens.attend(hidden).astype(jnp.float32)

    def hf_weights(self) -> HFWeights:
        p = "model.decoder"
        specs = {**self.embed_tokens.hf_weights(f"{p}.embed_tokens.weight"),
                 **self.embed_positions.hf_weights(f"{p}.embed_positions.weight"),
                 **self.final_layer_norm.hf_weights(f"{p}.final_layer_norm"),
                 **self.layers.hf_weights(lambda i: f"{p}.layers.{i}")}
        return specs

    ignored_hf_weights = (r"lm_head\.weight",)
