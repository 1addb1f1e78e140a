"""Decoder checkpoints as pooling models (vLLM's `convert`): Llama / Mistral / Qwen2 / Qwen3 with
causal attention over packed inputs and no LM head (Qwen3-Embedding, gte-Qwen2 shaped), and their
*ForSequenceClassification (a `score` projection of the pooled hidden state), which may also be a
causal LM read as one (vLLM's `classifier_from_token`: Qwen3-Reranker's yes / no)."""

import jax.numpy as jnp
import numpy as np

from jpaged.models.layers import HFWeights, Linear, WeightTarget
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
    """`score` (no bias) over the last token's hidden state: one logit per label. From a causal LM
    (`classifier_token_ids`, set by the engine from `classifier_from_token`), `score` is made of
    the LM head's rows for those tokens, or, for Qwen3-Reranker (`is_original_qwen3_reranker`: two
    tokens, no / yes), of yes's row minus no's: one logit whose sigmoid is softmax([no, yes])[yes]."""

    def __init__(self, cfg, *, dtype, ops, max_model_len=None):
        super().__init__(cfg, dtype=dtype, ops=ops, max_model_len=max_model_len)
        self.score = Linear((cfg.hidden_size,), (cfg.num_labels,), ("embed", "vocab"), dtype=dtype)
        token_ids = getattr(cfg, "classifier_token_ids", None)
        self.token_ids = None if token_ids is None else tuple(token_ids)
        self.head = None if self.token_ids is None else (
            "model.embed_tokens.weight" if getattr(cfg, "tie_word_embeddings", False) else "lm_head.weight")
        self.vocab_size = cfg.vocab_size

    def classify(self, pooled):
        return self.score(pooled).astype(jnp.float32)

    def hf_weights(self) -> HFWeights:
        specs = super().hf_weights()
        if self.head is None:
            return {**specs, **self.score.hf_weights("score")}
        ids = list(self.token_ids)
        rows = (lambda w: w[ids[1]:ids[1] + 1] - w[ids[0]:ids[0] + 1]) if self.score.out_shape[0] == 1 and len(ids) == 2 \
            else (lambda w: w[ids])
        [target] = self.score.hf_weights("score")["score.weight"]  # [labels, hidden], from the head's rows
        head = WeightTarget(target.param, (self.vocab_size, self.score.in_shape[0]),
                            lambda w: target.convert(np.asarray(rows(np.asarray(w, np.float32)), w.dtype)))
        specs.setdefault(self.head, []).append(head)
        return specs


def classifier_tokens(cfg, tokenizer) -> tuple[list[int], int]:
    """vLLM's `classifier_from_token` (a list of token strings, each one token of the tokenizer):
    their ids, and the number of labels (1 for `is_original_qwen3_reranker`'s [no, yes])."""
    tokens = cfg.classifier_from_token
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens)):
        raise ValueError(f"hf_overrides: classifier_from_token={tokens!r}; expected a list of token strings")
    ids = []
    for token in tokens:
        enc = tokenizer.convert_tokens_to_ids(token)
        if enc is None or enc == tokenizer.unk_token_id:
            enc = tokenizer.encode(token, add_special_tokens=False)
            if len(enc) != 1:
                raise ValueError(f"hf_overrides: classifier_from_token {token!r} is {len(enc)} tokens, not one")
            enc = enc[0]
        ids.append(int(enc))
    if getattr(cfg, "is_original_qwen3_reranker", False):
        if len(ids) != 2:
            raise ValueError(f"hf_overrides: is_original_qwen3_reranker takes two tokens (no, yes), got {tokens!r}")
        return ids, 1
    return ids, len(ids)


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
