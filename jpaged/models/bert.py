"""BERT, RoBERTa and XLM-RoBERTa encoders (bidirectional attention), for the pooling runner:
embedding models (all-MiniLM, bge, e5 shaped) and the cross-encoder rerankers
BertForSequenceClassification and XLMRobertaForSequenceClassification (bge-reranker shaped).

Post-norm layers with biases everywhere; RoBERTa's positions start after its padding index. The
encoder runs over a packed batch (jpaged/pooling/packed.py), attention kept inside each input.
"""

import jax.numpy as jnp
from flax import nnx

from jpaged.models.layers import Embedding, HFWeights, LayerNorm, Linear, activation
from jpaged.models.modernbert import ModernBertForSequenceClassification, ModernBertModel
from jpaged.models.stacked import LayerStack
from jpaged.pooling.packed import packed_attention


class BertLayer(nnx.Module):
    def __init__(self, cfg, *, dtype):
        hidden, heads = cfg.hidden_size, cfg.num_attention_heads
        self.head_dim = hidden // heads
        self.act = cfg.hidden_act
        qkv = dict(use_bias=True, dtype=dtype)
        self.query = Linear((hidden,), (heads, self.head_dim), ("embed", "q_heads", "head_dim"), **qkv)
        self.key = Linear((hidden,), (heads, self.head_dim), ("embed", "q_heads", "head_dim"), **qkv)
        self.value = Linear((hidden,), (heads, self.head_dim), ("embed", "q_heads", "head_dim"), **qkv)
        self.attn_out = Linear((heads, self.head_dim), (hidden,), ("q_heads", "head_dim", "embed"), **qkv)
        self.attn_norm = LayerNorm(hidden, cfg.layer_norm_eps, dtype=dtype)
        self.intermediate = Linear((hidden,), (cfg.intermediate_size,), ("embed", "mlp"), **qkv)
        self.output = Linear((cfg.intermediate_size,), (hidden,), ("mlp", "embed"), **qkv)
        self.out_norm = LayerNorm(hidden, cfg.layer_norm_eps, dtype=dtype)

    def __call__(self, x, positions, kv_cache):
        attn = packed_attention(self.query(x), self.key(x), self.value(x), self.head_dim ** -0.5, causal=False)
        x = self.attn_norm(x + self.attn_out(attn.astype(x.dtype)))
        return self.out_norm(x + self.output(activation(self.act)(self.intermediate(x)))), kv_cache

    def hf_weights(self, prefix: str) -> HFWeights:
        return {**self.query.hf_weights(f"{prefix}.attention.self.query"),
                **self.key.hf_weights(f"{prefix}.attention.self.key"),
                **self.value.hf_weights(f"{prefix}.attention.self.value"),
                **self.attn_out.hf_weights(f"{prefix}.attention.output.dense"),
                **self.attn_norm.hf_weights(f"{prefix}.attention.output.LayerNorm"),
                **self.intermediate.hf_weights(f"{prefix}.intermediate.dense"),
                **self.output.hf_weights(f"{prefix}.output.dense"),
                **self.out_norm.hf_weights(f"{prefix}.output.LayerNorm")}


class BertModel(nnx.Module):
    """The encoder: hidden states of every token, [tokens, hidden]. Also RoBERTa / XLM-RoBERTa."""

    is_encoder = True
    base_prefix = ""  # where the checkpoint keeps the encoder's tensors (classifiers: "bert.", "roberta.")
    ignored_hf_weights = (r"(bert\.|roberta\.)?pooler\..*", r".*position_ids", r"lm_head\..*", r"cls\..*")

    def __init__(self, cfg, *, dtype, ops=None, max_model_len=None):
        self.roberta = cfg.model_type in ("roberta", "xlm-roberta", "camembert")
        # RoBERTa numbers positions from padding_idx + 1, so its table has padding_idx + 1 more rows.
        self.position_offset = (cfg.pad_token_id + 1) if self.roberta else 0
        self.word_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.position_embeddings = Embedding(cfg.max_position_embeddings, cfg.hidden_size, dtype=dtype)
        self.token_type_embeddings = Embedding(cfg.type_vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_norm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype)
        self.layers = LayerStack(lambda: BertLayer(cfg, dtype=dtype), cfg.num_hidden_layers)

    @staticmethod
    def max_positions(cfg) -> int:
        roberta = cfg.model_type in ("roberta", "xlm-roberta", "camembert")
        return cfg.max_position_embeddings - ((cfg.pad_token_id + 1) if roberta else 0)

    def __call__(self, input_ids, positions, kv_cache, token_type_ids=None):
        types = jnp.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions + self.position_offset)
             + self.token_type_embeddings(types))
        x, kv_cache = self.layers(self.embed_norm(x), positions, kv_cache)
        return x, kv_cache

    def hf_weights(self) -> HFWeights:
        p = self.base_prefix
        return {**self.word_embeddings.hf_weights(f"{p}embeddings.word_embeddings.weight"),
                **self.position_embeddings.hf_weights(f"{p}embeddings.position_embeddings.weight"),
                **self.token_type_embeddings.hf_weights(f"{p}embeddings.token_type_embeddings.weight"),
                **self.embed_norm.hf_weights(f"{p}embeddings.LayerNorm"),
                **self.layers.hf_weights(lambda i: f"{p}encoder.layer.{i}")}


class BertForSequenceClassification(BertModel):
    """CLS -> pooler (dense, tanh) -> classifier: one logit per label."""

    base_prefix = "bert."
    ignored_hf_weights = (r".*position_ids",)

    def __init__(self, cfg, *, dtype, ops=None, max_model_len=None):
        super().__init__(cfg, dtype=dtype)
        self.pooler = Linear((cfg.hidden_size,), (cfg.hidden_size,), ("embed", "mlp"), use_bias=True, dtype=dtype)
        self.classifier = Linear((cfg.hidden_size,), (cfg.num_labels,), ("embed", "vocab"), use_bias=True,
                                 dtype=dtype)

    def classify(self, cls_hidden):
        return self.classifier(jnp.tanh(self.pooler(cls_hidden))).astype(jnp.float32)

    def hf_weights(self) -> HFWeights:
        return {**super().hf_weights(), **self.pooler.hf_weights("bert.pooler.dense"),
                **self.classifier.hf_weights("classifier")}


class RobertaForSequenceClassification(BertModel):
    """CLS -> dense, tanh -> out_proj (RoBERTa's classification head; no pooler)."""

    base_prefix = "roberta."
    ignored_hf_weights = (r".*position_ids", r"roberta\.pooler\..*")

    def __init__(self, cfg, *, dtype, ops=None, max_model_len=None):
        super().__init__(cfg, dtype=dtype)
        self.dense = Linear((cfg.hidden_size,), (cfg.hidden_size,), ("embed", "mlp"), use_bias=True, dtype=dtype)
        self.out_proj = Linear((cfg.hidden_size,), (cfg.num_labels,), ("embed", "vocab"), use_bias=True, dtype=dtype)

    def classify(self, cls_hidden):
        return self.out_proj(jnp.tanh(self.dense(cls_hidden))).astype(jnp.float32)

    def hf_weights(self) -> HFWeights:
        return {**super().hf_weights(), **self.dense.hf_weights("classifier.dense"),
                **self.out_proj.hf_weights("classifier.out_proj")}


ENCODER_REGISTRY = {
    "BertModel": BertModel,
    "RobertaModel": BertModel,
    "XLMRobertaModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "RobertaForSequenceClassification": RobertaForSequenceClassification,
    "XLMRobertaForSequenceClassification": RobertaForSequenceClassification,
    "ModernBertModel": ModernBertModel,
    "ModernBertForSequenceClassification": ModernBertForSequenceClassification,
}
