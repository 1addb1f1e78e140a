"""Decoder checkpoints as pooling models (vLLM's `convert`): Llama / Mistral / Qwen2 / Qwen3 with
causal attention over packed inputs and no LM head (Qwen3-Embedding, gte-Qwen2 shaped), and their
*ForSequenceClassification (a `score` projection of the pooled hidden state)."""

import jax.numpy as jnp

from jpaged.models.layers import HFWeights, Linear
from jpaged.models.llama import LlamaForCausalLM


class LlamaForEmbedding(LlamaForCausalLM):
    """The decoder's final (normed) hidden states; no LM head."""

    is_encoder = False
    ignored_hf_weights = (r".*rotary_emb\.inv_freq", r"lm_head\.weight")

    def __init__(self, cfg, *, dtype, ops, max_model_len=None):
        super().__init__(cfg, dtype=dtype, ops=ops, max_model_len=max_model_len)
        self.lm_head = None

    def hf_weights(self) -> HFWeights:
        specs = {**self.embed_tokens.hf_weights("model.embed_tokens.weight"), **self.norm.hf_weights("model.norm"),
                 **self.layers.hf_weights(lambda i: f"model.layers.{i}")}
        return specs


class LlamaForSequenceClassification(LlamaForEmbedding):
    """`score` (no bias) over the last token's hidden state: one logit per label."""

    def __init__(self, cfg, *, dtype, ops, max_model_len=None):
        super().__init__(cfg, dtype=dtype, ops=ops, max_model_len=max_model_len)
        self.score = Linear((cfg.hidden_size,), (cfg.num_labels,), ("embed", "vocab"), dtype=dtype)

    def classify(self, pooled):
        return self.score(pooled).astype(jnp.float32)

    def hf_weights(self) -> HFWeights:
        return {**super().hf_weights(), **self.score.hf_weights("score")}


_FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3")
DECODER_REGISTRY = {
    **{f"{f}Model": LlamaForEmbedding for f in _FAMILIES},
    **{f"{f}ForCausalLM": LlamaForEmbedding for f in _FAMILIES},
    **{f"{f}ForSequenceClassification": LlamaForSequenceClassification for f in _FAMILIES},
}


def decoder_weight_names(weights):
    """A base model saved alone (sentence-transformers saves Qwen3Model: "layers.0...") named as
    inside its causal LM ("model.layers.0...")."""
    for name, tensor in weights:
        if not name.startswith(("model.", "lm_head.", "score.")):
            name = "model." + name
        yield name, tensor
