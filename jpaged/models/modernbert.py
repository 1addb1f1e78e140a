"""ModernBERT (answerdotai/ModernBERT-base shaped) as an encoder for the pooling runner: pre-norm
layers without biases by default, rotary positions (one theta for global layers, another for the
local ones), every `global_attn_every_n_layers`-th layer global and the others attending only to
keys within `sliding_window` positions (bidirectional), a GeGLU MLP, no norm before the first
layer's attention. Read from transformers' config (`layer_types`, `rope_parameters`), which also
standardizes older config files (global_rope_theta, local_attention, ...).

The layers run as one scanned layer (LayerStack): what differs per layer (the window, the rotary
frequencies, the first layer's missing norm) is picked by the layer index the stack sets.
"""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.models.forward_context import get_forward_context
from jpaged.models.layers import Embedding, HFWeights, LayerNorm, Linear, RopeConfig, activation, apply_rope
from jpaged.models.stacked import LayerStack
from jpaged.pooling.packed import packed_attention

FULL, SLIDING = "full_attention", "sliding_attention"


class ModernBertLayer(nnx.Module):
    def __init__(self, cfg, *, dtype):
        hidden, heads = cfg.hidden_size, cfg.num_attention_heads
        self.head_dim = hidden // heads
        norm = dict(dtype=dtype, use_bias=cfg.norm_bias)
        self.attn_norm = LayerNorm(hidden, cfg.norm_eps, **norm)
        self.wqkv = Linear((hidden,), (3, heads, self.head_dim), ("embed", None, "q_heads", "head_dim"),
                           use_bias=cfg.attention_bias, dtype=dtype)
        self.wo = Linear((heads, self.head_dim), (hidden,), ("q_heads", "head_dim", "embed"),
                         use_bias=cfg.attention_bias, dtype=dtype)
        self.mlp_norm = LayerNorm(hidden, cfg.norm_eps, **norm)
        self.wi = Linear((hidden,), (2 * cfg.intermediate_size,), ("embed", "mlp"), use_bias=cfg.mlp_bias, dtype=dtype)
        self.mlp_out = Linear((cfg.intermediate_size,), (hidden,), ("mlp", "embed"), use_bias=cfg.mlp_bias, dtype=dtype)
        self.act = cfg.hidden_activation
        types = list(cfg.layer_types)
        self.local = tuple(t == SLIDING for t in types)  # static, indexed by the traced layer number
        self.window = int(cfg.sliding_window)
        # the rotary frequencies of global and local layers (static tuples; None: no such layer)
        freqs = {t: tuple(RopeConfig(self.head_dim, float(cfg.rope_parameters[t]["rope_theta"])).inv_freq().tolist())
                 for t in (FULL, SLIDING) if t in types}
        self.full_freq, self.local_freq = freqs.get(FULL), freqs.get(SLIDING)

    def __call__(self, x, positions, kv_cache):
        layer = get_forward_context().attn.layer
        local = jnp.asarray(self.local)[layer]
        inv_freq = jnp.asarray(self.full_freq or self.local_freq, jnp.float32)
        if self.local_freq is not None:
            inv_freq = jnp.where(local, jnp.asarray(self.local_freq, jnp.float32), inv_freq)
        h = jnp.where(layer == 0, x, self.attn_norm(x))  # the first layer has no attention norm
        qkv = self.wqkv(h)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        window = jnp.where(local, self.window, np.iinfo(np.int32).max)
        attn = packed_attention(q, k, v, self.head_dim ** -0.5, causal=False, window=window)
        x = x + self.wo(attn.astype(x.dtype))
        up, gate = jnp.split(self.wi(self.mlp_norm(x)), 2, axis=-1)
        return x + self.mlp_out(activation(self.act)(up) * gate), kv_cache

    def hf_weights(self, prefix: str) -> HFWeights:
        return {**self.attn_norm.hf_weights(f"{prefix}.attn_norm"), **self.wqkv.hf_weights(f"{prefix}.attn.Wqkv"),
                **self.wo.hf_weights(f"{prefix}.attn.Wo"), **self.mlp_norm.hf_weights(f"{prefix}.mlp_norm"),
                **self.wi.hf_weights(f"{prefix}.mlp.Wi"), **self.mlp_out.hf_weights(f"{prefix}.mlp.Wo")}


class ModernBertModel(nnx.Module):
    """The encoder: hidden states of every token, [tokens, hidden] (after the final norm)."""

    is_encoder = True
    base_prefix = ""  # where the checkpoint keeps the encoder's tensors (the classifier: "model.")
    ignored_hf_weights = (r".*position_ids", r"head\..*", r"decoder\..*")

    def __init__(self, cfg, *, dtype, ops=None, max_model_len=None):
        self.tok_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_norm = LayerNorm(cfg.hidden_size, cfg.norm_eps, dtype=dtype, use_bias=cfg.norm_bias)
        self.layers = LayerStack(lambda: ModernBertLayer(cfg, dtype=dtype), cfg.num_hidden_layers)
        self.final_norm = LayerNorm(cfg.hidden_size, cfg.norm_eps, dtype=dtype, use_bias=cfg.norm_bias)

    @staticmethod
    def max_positions(cfg) -> int:
        return cfg.max_position_embeddings

    def __call__(self, input_ids, positions, kv_cache, token_type_ids=None):
        x, kv_cache = self.layers(self.embed_norm(self.tok_embeddings(input_ids)), positions, kv_cache)
        return self.final_norm(x), kv_cache

    def hf_weights(self) -> HFWeights:
        p = self.base_prefix
        layers = self.layers.hf_weights(lambda i: f"{p}layers.{i}")
        # The first layer has no attention norm: its slice of the stacked norm stays unread (zeros).
        layers = {name: targets for name, targets in layers.items() if not name.startswith(f"{p}layers.0.attn_norm.")}
        return {**self.tok_embeddings.hf_weights(f"{p}embeddings.tok_embeddings.weight"),
                **self.embed_norm.hf_weights(f"{p}embeddings.norm"), **layers,
                **self.final_norm.hf_weights(f"{p}final_norm")}


class ModernBertForSequenceClassification(ModernBertModel):
    """`classifier_pooling` (CLS or mean) -> head (dense, activation, norm) -> classifier."""

    base_prefix = "model."
    ignored_hf_weights = (r".*position_ids",)

    def __init__(self, cfg, *, dtype, ops=None, max_model_len=None):
        super().__init__(cfg, dtype=dtype)
        hidden = cfg.hidden_size
        self.dense = Linear((hidden,), (hidden,), ("embed", "mlp"), use_bias=cfg.classifier_bias, dtype=dtype)
        self.head_act = cfg.classifier_activation
        self.head_norm = LayerNorm(hidden, cfg.norm_eps, dtype=dtype, use_bias=cfg.norm_bias)
        self.classifier = Linear((hidden,), (cfg.num_labels,), ("embed", "vocab"), use_bias=True, dtype=dtype)

    @staticmethod
    def classify_pooling(cfg) -> str:
        return "MEAN" if cfg.classifier_pooling == "mean" else "CLS"

    def classify(self, pooled):
        return self.classifier(self.head_norm(activation(self.head_act)(self.dense(pooled)))).astype(jnp.float32)

    def hf_weights(self) -> HFWeights:
        return {**super().hf_weights(), **self.dense.hf_weights("head.dense"), **self.head_norm.hf_weights("head.norm"),
                **self.classifier.hf_weights("classifier")}


