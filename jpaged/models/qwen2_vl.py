"""Qwen2-VL and Qwen2.5-VL (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration):
the vision transformer of qwen2_vl_vision.py in front of a Qwen2 decoder whose rotary embedding
is M-RoPE (mrope.py): three positions per token (temporal, height, width), each turning its
section of the head's frequencies.

Positions: the step's `positions` are int[3, tokens] (the M-RoPE positions: the runner builds them
for a model with `uses_mrope`, jpaged/multimodal/mrope_step.py) or int[tokens] (the three equal:
the ordinary rotary embedding, exact for text).

Images: `image_pixel_inputs` (host) cuts one image's patches out of the processor's batch, pads
them to a bucket of patch counts (`VISION_BUCKETS`: each bucket one executable, compiled at
start-up) and adds the grid-dependent arrays; `embed_image` runs the tower on them and returns
bucket / merge^2 rows, of which the image's t * h * w / merge^2 tokens come first.
"""

import copy

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.models.forward_context import get_forward_context
from jpaged.models.layers import Attention, GatedMLP, HFWeights, RopeConfig
from jpaged.models.llama import LlamaDecoderLayer, LlamaForCausalLM, head_dim_of
from jpaged.models.llava import adapt_multimodal_config, encoder_cache_rows
from jpaged.models.mrope import apply_mrope, mrope_positions
from jpaged.models.paged_attention import AttentionOps
from jpaged.models.qwen2_vl_processor import Qwen2VLPromptProcessor
from jpaged.models.qwen2_vl_vision import Qwen2VisionTransformer, tokens_per_image
from jpaged.models.vision_layers import bucket_size
from jpaged.multimodal.encoder_cache import EncoderCache, embed_with_cache

# Patch counts an image is padded to (one compiled encoder each). 16384 patches of 14 x 14 pixels:
# about 3.2M pixels (a 1080p photo at its own resolution, as transformers runs it); the processor
# lowers max_pixels to the last (Qwen2VLPromptProcessor), so no image needs another encoder.
VISION_BUCKETS = (256, 1024, 4096, 16384)


class MRopeAttention(Attention):
    """Attention whose rotary embedding is M-RoPE (one rope for every layer)."""

    def __init__(self, *args, mrope_section, **kwargs):
        super().__init__(*args, **kwargs)
        self.mrope_section = tuple(int(n) for n in mrope_section)

    def __call__(self, x, positions, kv_cache):
        meta = get_forward_context().attn
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        inv_freq = np.asarray(self.rope[0][0], np.float32)
        q, k = (apply_mrope(t, positions, inv_freq, self.mrope_section) for t in (q, k))
        # (no sliding window: Qwen2-VL's use_sliding_window is refused when the layers are built)
        out, kv_cache = self.ops(q, k, v, kv_cache, meta, self.scale, None, self.logits_soft_cap)
        return self.o_proj(out.astype(x.dtype)), kv_cache


def text_config_of(cfg):
    """The language model's config, with the top-level fields it inherits (tied embeddings)."""
    text = copy.deepcopy(cfg.text_config)
    text.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
    return text


class Qwen2VLTextModel(LlamaForCausalLM):
    """Qwen2's decoder (q/k/v biases) with M-RoPE; HF names model.layers.*, model.norm, lm_head."""

    @staticmethod
    def make_layer(cfg, *, ops, dtype, max_model_len) -> nnx.Module:
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", False):
            raise ValueError("Qwen2-VL with use_sliding_window is not supported")
        head_dim = head_dim_of(cfg)
        section = dict(cfg.rope_parameters or {}).get("mrope_section") or [16, 24, 24]
        if sum(section) * 2 != head_dim:
            raise ValueError(f"mrope_section {list(section)} must add up to head_dim / 2 = {head_dim // 2}")
        attn = MRopeAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, ops=ops,
                              dtype=dtype, qkv_bias=True,
                              rope=RopeConfig.from_hf(cfg, head_dim, max_model_len=max_model_len),
                              mrope_section=section)
        return LlamaDecoderLayer(attn, GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype=dtype),
                                 cfg, dtype=dtype)

    def forward_embeds(self, x, positions, kv_cache):
        x, kv_cache = self.layers(x, positions, kv_cache)
        return self.norm(x), kv_cache


class Qwen2VLForConditionalGeneration(nnx.Module):
    is_multimodal = True
    uses_mrope = True
    buckets = VISION_BUCKETS

    def __init__(self, cfg, *, dtype, ops: AttentionOps, max_model_len: int | None = None):
        self.visual = Qwen2VisionTransformer(cfg.vision_config, dtype=dtype)
        self.language_model = Qwen2VLTextModel(text_config_of(cfg), dtype=dtype, ops=ops, max_model_len=max_model_len)
        self.image_token_id = cfg.image_token_id
        self.vocab_size = cfg.text_config.vocab_size
        merge = cfg.vision_config.spatial_merge_size
        self.encoder_cache = EncoderCache(jnp.zeros(
            (encoder_cache_rows(cfg, max(self.buckets) // merge ** 2), cfg.text_config.hidden_size), dtype))

    adapt_hf_config = staticmethod(adapt_multimodal_config)

    @classmethod
    def load_processor(cls, model_dir: str) -> Qwen2VLPromptProcessor:
        """transformers' Qwen2VLProcessor needs torchvision: the image processor and the tokenizer
        instead, images kept within the largest bucket."""
        return Qwen2VLPromptProcessor.from_pretrained(model_dir, max_patches=max(cls.buckets))

    # ------------------------------------------------------------------ language model
    def __call__(self, input_ids, positions, kv_cache):
        """ids >= vocab_size: rows of the encoder cache (an image's embeddings; encoder_cache.py)."""
        x = embed_with_cache(self.embed_tokens_fn, self.encoder_cache, input_ids, self.vocab_size)
        return self.language_model.forward_embeds(x, positions, kv_cache)

    def embed_tokens_fn(self, input_ids):
        return self.language_model.embed_tokens(input_ids)

    def forward_embeds(self, embeds, positions, kv_cache):
        return self.language_model.forward_embeds(embeds, positions, kv_cache)

    def compute_logits(self, hidden):
        return self.language_model.compute_logits(hidden)

    # ------------------------------------------------------------------ vision
    def embed_image(self, pixel_values, rope, frames, windows=None, unpermute=None):
        """One image's padded patches (image_pixel_inputs: a leading batch axis of 1) ->
        [bucket / merge^2, text hidden]: the image's tokens first, then rows of padding
        (encoder_output_rows in all)."""
        windows, unpermute = (None if a is None else a[0] for a in (windows, unpermute))
        return self.visual(pixel_values[0], rope[0], frames[0], windows, unpermute).astype(self.encoder_cache.dtype)

    def num_image_tokens(self, pixel_inputs: dict) -> int:
        """The image's placeholder tokens: its real (unpadded) patches / merge^2."""
        return int((np.asarray(pixel_inputs["frames"]) >= 0).sum()) // self.visual.merge ** 2

    def encoder_output_rows(self, pixel_inputs: dict) -> int:
        """The rows embed_image writes (the bucket's, padding included)."""
        return int(np.shape(pixel_inputs["frames"])[-1]) // self.visual.merge ** 2

    def encoder_input_shapes(self) -> list[dict]:
        """One executable per bucket of patch counts."""
        v = self.visual
        shapes = []
        for b in self.buckets:
            shape = {"pixel_values": ((1, b, v.patch_dim), np.float32), "rope": ((1, b, 2), np.int32),
                     "frames": ((1, b), np.int32)}
            if v.qwen25:
                shape.update(windows=((1, b), np.int32), unpermute=((1, b // v.merge ** 2), np.int32))
            shapes.append(shape)
        return shapes

    def image_grid(self, pixel_inputs: dict) -> tuple[int, int, int]:
        """The grid (t, h, w) in patches of the image whose padded inputs these are."""
        frames = np.asarray(pixel_inputs["frames"]).reshape(-1)
        real = frames >= 0
        rope = np.asarray(pixel_inputs["rope"]).reshape(-1, 2)[real]
        t = len(np.unique(frames[real]))
        return t, int(rope[:, 0].max()) + 1, int(rope[:, 1].max()) + 1

    def mrope_prompt(self, token_ids, pixel_inputs: list[dict]) -> tuple[np.ndarray, int]:
        """A prompt's M-RoPE positions [3, len] and delta (mrope.py), its images' grids read off
        their encoder inputs."""
        grids = [self.image_grid(p) for p in pixel_inputs]
        return mrope_positions(token_ids, grids, self.image_token_id, self.visual.merge)

    def pixel_inputs(self, processed: dict, i: int) -> dict[str, np.ndarray]:
        """Image i's encoder inputs from the processor's batch (pixel_values rows of every image one
        after another, image_grid_thw)."""
        grids = np.asarray(processed["image_grid_thw"]).reshape(-1, 3)
        start = int(np.prod(grids[:i], axis=1).sum())
        rows = np.asarray(processed["pixel_values"])[start:start + int(np.prod(grids[i]))]
        return image_pixel_inputs(self.visual, rows, grids[i], self.buckets)

    def hf_weights(self) -> HFWeights:
        return {**self.visual.hf_weights("visual"), **self.language_model.hf_weights()}

    ignored_hf_weights = LlamaForCausalLM.ignored_hf_weights

    @staticmethod
    def rename_hf_weight(name: str) -> str:
        """transformers' newer layout (model.visual.*, model.language_model.*) -> the checkpoints'."""
        if name.startswith("model.visual."):
            return name.removeprefix("model.")
        if name.startswith("model.language_model."):
            return "model." + name.removeprefix("model.language_model.")
        return name


def image_pixel_inputs(visual: Qwen2VisionTransformer, rows: np.ndarray, grid, buckets=VISION_BUCKETS
                       ) -> dict[str, np.ndarray]:
    """One image's encoder inputs: its processor rows [t * h * w, patch_dim] (pixel_values of the
    processor's batch, this image's part) padded to the smallest bucket, with the rotary
    positions and segment ids of its grid (t, h, w)."""
    grid = tuple(int(g) for g in grid)
    n = grid[0] * grid[1] * grid[2]
    if rows.shape != (n, visual.patch_dim):
        raise ValueError(f"image grid {grid} has {n} patches of {visual.patch_dim} values, pixel_values has "
                         f"{tuple(rows.shape)}")
    inputs = visual.pack(rows, [grid], pad_to=bucket_size(n, buckets))
    return {name: value[None] for name, value in inputs.items()}  # (a batch of one image, as the engine's)


def image_tokens(hf_config, grid) -> int:
    return tokens_per_image(grid, hf_config.vision_config.spatial_merge_size)
