"""LLaVA-1.5 (`LlavaForConditionalGeneration`): a CLIP vision tower, a two-layer projector, and a
Llama-family decoder (jpaged/models/llama.py) for the text.

An image's embeddings: the tower's hidden states at `vision_feature_layer` (a list: concatenated
on the feature axis), the class token dropped under the "default" select strategy, through
linear_1 -> act -> linear_2 into the decoder's width. They are written into the model's encoder
cache by the engine (jpaged/multimodal/runner.py) and read back at the placeholder tokens'
positions by `__call__` (jpaged/multimodal/encoder_cache.py): the decoder itself is the text
model's, over the same paged attention.
"""

import re

import jax.numpy as jnp
from flax import nnx

from jpaged.models.clip_vision import CLIPVisionTower
from jpaged.models.layers import HFWeights, Linear, activation
from jpaged.models.llama import LlamaForCausalLM
from jpaged.multimodal.encoder_cache import EncoderCache, embed_with_cache

# Text-config fields the engine reads off the top-level config (vocab_size, max_position_embeddings, ...).
TEXT_FIELDS = ("vocab_size", "max_position_embeddings", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "sliding_window", "rms_norm_eps", "eos_token_id",
               "bos_token_id", "pad_token_id")
DEFAULT_ENCODER_CACHE_TOKENS = 8192  # vLLM's default encoder_cache_size (its max_num_batched_tokens offline)


def adapt_multimodal_config(hf_config):
    """Copy the text config's fields the engine reads onto the top-level config (a LlavaConfig has none)."""
    text = hf_config.get_text_config()
    for name in TEXT_FIELDS:
        if getattr(hf_config, name, None) is None and getattr(text, name, None) is not None:
            setattr(hf_config, name, getattr(text, name))


def encoder_cache_rows(hf_config, tokens_per_image: int) -> int:
    """Rows of the device encoder cache: `encoder_cache_size` if the config carries one (the engine
    may set it through hf_overrides), else vLLM's default; at least one image."""
    rows = getattr(hf_config, "encoder_cache_size", None) or DEFAULT_ENCODER_CACHE_TOKENS
    return max(int(rows), tokens_per_image)


class LlavaProjector(nnx.Module):
    def __init__(self, vision_width: int, text_width: int, act: str, bias: bool, *, dtype):
        self.act = act
        self.linear_1 = Linear((vision_width,), (text_width,), ("vision_embed", "embed"), use_bias=bias, dtype=dtype)
        self.linear_2 = Linear((text_width,), (text_width,), ("embed_in", "embed"), use_bias=bias, dtype=dtype)

    def __call__(self, x):
        return self.linear_2(activation(self.act)(self.linear_1(x)))

    def hf_weights(self, prefix: str) -> HFWeights:
        return {**self.linear_1.hf_weights(f"{prefix}.linear_1"), **self.linear_2.hf_weights(f"{prefix}.linear_2")}


class LlavaForConditionalGeneration(nnx.Module):
    is_multimodal = True

    def __init__(self, cfg, *, dtype, ops, max_model_len: int | None = None):
        text, vision = cfg.get_text_config(), cfg.vision_config
        self.vocab_size = text.vocab_size
        self.image_token_id = cfg.image_token_index
        self.language_model = LlamaForCausalLM(text, dtype=dtype, ops=ops, max_model_len=max_model_len)
        self.vision_tower = CLIPVisionTower(vision, dtype=dtype)
        layers = cfg.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        total = vision.num_hidden_layers + 1  # hidden states: the encoder's input, then each layer's output
        self.feature_layers = tuple(layer % total for layer in layers)
        self.keep_class_token = cfg.vision_feature_select_strategy == "full"
        self.image_size = vision.image_size
        self.num_channels = getattr(vision, "num_channels", 3)
        self.tokens_per_image = (vision.image_size // vision.patch_size) ** 2 + int(self.keep_class_token)
        self.multi_modal_projector = LlavaProjector(
            vision.hidden_size * len(layers), text.hidden_size, cfg.projector_hidden_act,
            getattr(cfg, "multimodal_projector_bias", True), dtype=dtype)
        self.encoder_cache = EncoderCache(jnp.zeros((encoder_cache_rows(cfg, self.tokens_per_image),
                                                     text.hidden_size), dtype))

    adapt_hf_config = staticmethod(adapt_multimodal_config)

    def encoder_input_shapes(self) -> list[dict]:
        """The pixel inputs of one image, by name: (shape, dtype) (one executable: fixed size)."""
        return [{"pixel_values": ((1, self.num_channels, self.image_size, self.image_size), jnp.float32)}]

    def num_image_tokens(self, pixel_inputs: dict) -> int:
        return self.tokens_per_image

    max_images_per_encode = 4  # (fixed-size images: encoded in batches of 1, 2 or 4; multimodal/runner.py)

    def embed_images(self, pixel_values):
        """A batch of images' embeddings, [images, tokens_per_image, text hidden]."""
        states = self.vision_tower(pixel_values, max(self.feature_layers))
        features = jnp.concatenate([states[i] for i in self.feature_layers], axis=-1)
        if not self.keep_class_token:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def embed_image(self, pixel_values):
        """One image's embeddings, [tokens_per_image, text hidden]."""
        return self.embed_images(pixel_values)[0]

    def __call__(self, input_ids, positions, kv_cache):
        lm = self.language_model
        x = embed_with_cache(lm.embed_tokens, self.encoder_cache, input_ids, self.vocab_size)
        x, kv_cache = lm.layers(x, positions, kv_cache)
        return lm.norm(x), kv_cache

    def compute_logits(self, hidden):
        return self.language_model.compute_logits(hidden)

    def hf_weights(self) -> HFWeights:
        lm = {f"language_model.{name}": targets for name, targets in self.language_model.hf_weights().items()}
        return {**lm, **self.vision_tower.hf_weights("vision_tower"),
                **self.multi_modal_projector.hf_weights("multi_modal_projector")}

    @staticmethod
    def rename_hf_weight(name: str) -> str:
        """Checkpoints name the parts differently by transformers version (llava-hf's
        `language_model.model.*` and `vision_tower.vision_model.*`, transformers 5's
        `model.language_model.*` and top-level `lm_head`): one spelling, hf_weights'."""
        name = re.sub(r"^model\.language_model\.", "language_model.model.", name)
        if name == "lm_head.weight":
            name = "language_model.lm_head.weight"
        name = re.sub(r"^model\.(vision_tower|multi_modal_projector)\.", r"\1.", name)
        return re.sub(r"^vision_tower\.vision_model\.", "vision_tower.", name)

    ignored_hf_weights = (r".*rotary_emb\.inv_freq", r".*position_ids", r"language_model\.lm_head\.weight")
