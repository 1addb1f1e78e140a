"""Gemma 3's multimodal checkpoints (Gemma3ForConditionalGeneration): the SigLIP tower
(siglip.py), the multimodal projector, and Gemma 3's text decoder (gemma.py).

Projector: the tower's patches, a side x side grid, are average-pooled to
mm_tokens_per_image tokens (a sqrt(mm_tokens_per_image) grid), normed by an RMSNorm with
Gemma's (1 + w) scale, and projected to the text width by a plain matrix. The text embeddings
are scaled by sqrt(hidden) (`embed_tokens_fn`), the image embeddings are not.

An image's tokens attend to each other both ways, as in HF (token_type_ids -> a bidirectional
block per image, within the sliding window on local layers): the model says `is_mm_prefix_lm`
(vLLM's name), so the runner gives every step per-token key limits (multimodal/mm_prefix.py:
an image token sees up to its image's last token) and the scheduler keeps each image whole in
one prefill chunk (`disable_chunked_mm_input`).
"""

import copy

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.models.gemma import GemmaForCausalLM
from jpaged.models.layers import HFWeights, RMSNorm, WeightTarget, fp32_precision, weight_param
from jpaged.models.paged_attention import AttentionOps
from jpaged.models.llava import adapt_multimodal_config, encoder_cache_rows
from jpaged.models.siglip import SiglipVisionTower
from jpaged.multimodal.encoder_cache import EncoderCache, embed_with_cache


class Gemma3MultiModalProjector(nnx.Module):
    def __init__(self, cfg, *, dtype):
        v = cfg.vision_config
        self.side = v.image_size // v.patch_size
        self.tokens_side = int(round(cfg.mm_tokens_per_image ** 0.5))
        if self.tokens_side ** 2 != cfg.mm_tokens_per_image or self.side % self.tokens_side:
            raise ValueError(f"mm_tokens_per_image={cfg.mm_tokens_per_image} must be a square dividing the "
                             f"{self.side} x {self.side} patch grid")
        self.kernel = self.side // self.tokens_side
        self.mm_soft_emb_norm = RMSNorm(v.hidden_size, v.layer_norm_eps, dtype=dtype, offset=1.0)
        self.mm_input_projection_weight = weight_param((v.hidden_size, cfg.text_config.hidden_size),
                                                       ("vision_embed", "embed"), dtype)

    def __call__(self, x):
        """x [batch, side^2, vision hidden] -> [batch, mm_tokens_per_image, text hidden]."""
        b, _, d = x.shape
        t, k = self.tokens_side, self.kernel
        grid = x.reshape(b, t, k, t, k, d)  # patch (row, col) = (i * k + a, j * k + c)
        pooled = grid.astype(jnp.float32).mean(axis=(2, 4)).astype(x.dtype).reshape(b, t * t, d)
        normed = self.mm_soft_emb_norm(pooled)
        w = self.mm_input_projection_weight[...]
        return jnp.matmul(normed, w, precision=fp32_precision(normed.dtype)).astype(x.dtype)

    def hf_weights(self, prefix):
        w = self.mm_input_projection_weight
        return {**self.mm_soft_emb_norm.hf_weights(f"{prefix}.mm_soft_emb_norm"),
                f"{prefix}.mm_input_projection_weight": [WeightTarget(w, w.shape, lambda a: a)]}


class Gemma3ForConditionalGeneration(nnx.Module):
    is_multimodal = True
    is_mm_prefix_lm = True  # an image's tokens attend to each other both ways (multimodal/mm_prefix.py)

    def __init__(self, cfg, *, dtype, ops: AttentionOps, max_model_len: int | None = None):
        self.vision_tower = SiglipVisionTower(cfg.vision_config, dtype=dtype)
        self.multi_modal_projector = Gemma3MultiModalProjector(cfg, dtype=dtype)
        text = copy.deepcopy(cfg.text_config)
        text.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", text.tie_word_embeddings))
        self.language_model = GemmaForCausalLM(text, dtype=dtype, ops=ops, max_model_len=max_model_len)
        self.image_token_id = cfg.image_token_index
        self.vocab_size = text.vocab_size
        self.tokens_per_image = cfg.mm_tokens_per_image
        self.encoder_cache = EncoderCache(jnp.zeros((encoder_cache_rows(cfg, self.tokens_per_image), text.hidden_size),
                                                    dtype))

    adapt_hf_config = staticmethod(adapt_multimodal_config)

    def embed_tokens_fn(self, input_ids):
        lm = self.language_model
        x = lm.embed_tokens(input_ids)
        return x * jnp.asarray(lm.embed_scale, x.dtype)  # HF rounds the scale to the activations' dtype

    def forward_embeds(self, x, positions, kv_cache):
        lm = self.language_model
        x, kv_cache = lm.layers(x, positions, kv_cache)
        return lm.norm(x), kv_cache

    def __call__(self, input_ids, positions, kv_cache):
        """ids >= vocab_size: rows of the encoder cache (an image's embeddings; encoder_cache.py)."""
        x = embed_with_cache(self.embed_tokens_fn, self.encoder_cache, input_ids, self.vocab_size)
        return self.forward_embeds(x, positions, kv_cache)

    def compute_logits(self, hidden):
        return self.language_model.compute_logits(hidden)

    max_images_per_encode = 4  # (fixed-size images: encoded in batches of 1, 2 or 4; multimodal/runner.py)

    def embed_images(self, pixel_values):
        """pixel_values [images, 3, size, size] -> [images, mm_tokens_per_image, text hidden]."""
        out = self.multi_modal_projector(self.vision_tower(pixel_values))
        return out.astype(self.language_model.embed_tokens.embedding.dtype)

    def embed_image(self, pixel_values):
        """pixel_values [images, 3, size, size] -> [images * mm_tokens_per_image, text hidden]."""
        out = self.embed_images(pixel_values)
        return out.reshape(-1, out.shape[-1])

    def encoder_input_shapes(self) -> list[dict]:
        t = self.vision_tower
        return [{"pixel_values": ((1, t.channels, t.size, t.size), jnp.float32)}]

    def num_image_tokens(self, pixel_inputs: dict) -> int:
        return self.tokens_per_image * int(np.shape(pixel_inputs["pixel_values"])[0])

    def hf_weights(self) -> HFWeights:
        return {**self.vision_tower.hf_weights("vision_tower"),
                **self.multi_modal_projector.hf_weights("multi_modal_projector"),
                **self.language_model.hf_weights()}

    # SiglipVisionModel's pooling head (vision_use_head): Gemma 3 reads the patches, not the pooled vector.
    ignored_hf_weights = GemmaForCausalLM.ignored_hf_weights + (r"vision_tower\.head\..*",)

    @staticmethod
    def rename_hf_weight(name: str) -> str:
        """The hub's and transformers' layouts -> ours: language_model.model.* / model.language_model.*
        -> model.*, vision_tower.vision_model.* -> vision_tower.*."""
        for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                         ("language_model.lm_head.", "lm_head."), ("model.vision_tower.", "vision_tower."),
                         ("model.multi_modal_projector.", "multi_modal_projector.")):
            if name.startswith(old):
                name = new + name.removeprefix(old)
                break
        return name.replace("vision_tower.vision_model.", "vision_tower.", 1)
