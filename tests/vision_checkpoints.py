"""Tiny random vision-language checkpoints written by transformers (save_pretrained), shared by the
vision model tests, and helpers to run jpaged's models on them outside the engine."""

import copy

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.models.forward_context import AttentionMetadata, ForwardContext, forward_context
from jpaged.models.kv_cache import KVCache, KVCacheSpec

TEXT_VOCAB = 320
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 300, 301, 302, 303


def qwen_config(family: str):
    """A 2-layer Qwen2-VL ("qwen2_vl") or Qwen2.5-VL ("qwen2_5_vl") config: head_dim 16 with
    mrope_section [2, 3, 3]; Qwen2.5-VL's windows are 2 x 2 merged blocks, block 1 of 3 global."""
    import transformers

    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=TEXT_VOCAB, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    tokens = dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
                  vision_end_token_id=VISION_END)
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
        return transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **tokens)
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)


def randomize(model, seed: int):
    """HF inits weights small (std 0.02), biases to 0 and norms to 1: draw them all so that every
    one is tested and activations are O(1)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("bias"):
                p.copy_(0.3 * noise)
            elif "norm" in name or ".ln_" in name:
                p.copy_(1 + 0.2 * noise)
            elif p.ndim >= 2:
                p.copy_(noise / max(p[0].numel(), 1) ** 0.5)
    return model


def save_qwen(path, family: str, seed: int):
    import transformers

    config = qwen_config(family)
    cls = (transformers.Qwen2VLForConditionalGeneration if family == "qwen2_vl"
           else transformers.Qwen2_5_VLForConditionalGeneration)
    model = randomize(cls(config), seed).eval()
    model.save_pretrained(path)
    return model


def qwen_image_processor():
    """Small images: 4 .. 64 merged tokens (16 .. 256 patches)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)


def random_images(rng: np.random.Generator, sizes):
    from PIL import Image

    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def paged_forward(model, embeds: jax.Array, positions, block_size: int = 8, key_limits=None):
    """The model's final hidden states for one sequence of input embeddings, prefilled in fresh pages
    (`key_limits`: AttentionMetadata's, int32[tokens])."""
    n = embeds.shape[0]
    blocks = -(-n // block_size)
    spec = KVCacheSpec.of_model(model, block_size, embeds.dtype)
    pages = jnp.zeros(spec.pool_shape(blocks), embeds.dtype)
    kv_cache = KVCache(pages, pages)
    meta = AttentionMetadata(slot_mapping=jnp.arange(n, dtype=jnp.int32),
                             block_tables=jnp.arange(blocks, dtype=jnp.int32)[None],
                             context_lens=jnp.array([n], jnp.int32), query_start_loc=jnp.array([0, n], jnp.int32),
                             key_limits=None if key_limits is None else jnp.asarray(key_limits, jnp.int32))
    with forward_context(ForwardContext(meta)):
        hidden, _ = model.forward_embeds(embeds, jnp.asarray(positions, jnp.int32), kv_cache)
    return hidden


GEMMA_IMAGE_TOKEN, GEMMA_BOI, GEMMA_EOI = 300, 301, 302


def gemma3_config():
    """A 2-layer Gemma 3 (one sliding layer of window 8, one global with linear rope scaling) and
    a 2-layer SigLIP over 56 x 56 images (4 x 4 patches of 14) pooled to 4 tokens."""
    import transformers

    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, vocab_size=TEXT_VOCAB, sliding_window=8, max_position_embeddings=512,
                layer_types=["sliding_attention", "full_attention"],
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=56,
                  patch_size=14, vision_use_head=False)
    return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                     image_token_index=GEMMA_IMAGE_TOKEN, boi_token_index=GEMMA_BOI,
                                     eoi_token_index=GEMMA_EOI)


def save_gemma3(path, seed: int):
    import transformers

    model = randomize(transformers.Gemma3ForConditionalGeneration(gemma3_config()), seed).eval()
    model.save_pretrained(path)
    return model


def gemma3_image_processor():
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": 56, "width": 56})


QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_qwen_servable(path, family: str, seed: int):
    """A Qwen2-VL / Qwen2.5-VL checkpoint the engine can serve: the tiny byte tokenizer with Qwen's
    vision tokens (ids 259..262) and <|im_start|>/<|im_end|>, a chat template, the image
    processor; the LM head scaled so greedy choices are far apart. Returns the HF model."""
    import torch
    import transformers

    from jpaged.models import tiny

    tok = copy.deepcopy(tiny.tiny_tokenizer())  # (the cached one is shared: never changed)
    tok.add_special_tokens({"additional_special_tokens": ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                          "<|vision_end|>", "<|im_start|>", "<|im_end|>"]})
    tok.chat_template = QWEN_CHAT_TEMPLATE
    image, video, start, end = tok.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                          "<|vision_end|>"])
    config = qwen_config(family)
    config.text_config.vocab_size = len(tok)
    config.text_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    config.text_config.bos_token_id = config.text_config.pad_token_id = None
    config.image_token_id, config.video_token_id = image, video
    config.vision_start_token_id, config.vision_end_token_id = start, end
    cls = (transformers.Qwen2VLForConditionalGeneration if family == "qwen2_vl"
           else transformers.Qwen2_5_VLForConditionalGeneration)
    model = randomize(cls(config), seed).eval()
    with torch.no_grad():
        for name, p in model.model.language_model.named_parameters():  # (constant v biases: one token wins always)
            if name.endswith("bias"):
                p.mul_(0.1)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    qwen_image_processor().save_pretrained(path)
    return model


def save_gemma3_servable(path, seed: int):
    """A Gemma 3 checkpoint the engine can serve: the tiny byte tokenizer with Gemma's image tokens
    (<start_of_image> 259, <end_of_image> 260, <image_soft_token> 261) as its named boi / eoi /
    image tokens, a Gemma3Processor of 4 tokens per 56 x 56 image. Returns the HF model."""
    import transformers

    from jpaged.models import tiny

    tok = copy.deepcopy(tiny.tiny_tokenizer())  # (the cached one is shared: never changed)
    names = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tok.add_special_tokens({"additional_special_tokens": list(names.values())})
    tok._set_model_specific_special_tokens(names)  # (what Gemma's own tokenizer config declares)
    config = gemma3_config()
    config.text_config.vocab_size = len(tok)
    config.boi_token_index, config.eoi_token_index, config.image_token_index = tok.convert_tokens_to_ids(
        list(names.values()))
    config.text_config.bos_token_id, config.text_config.eos_token_id = 256, 257
    model = randomize(transformers.Gemma3ForConditionalGeneration(config), seed).eval()
    model.save_pretrained(path)
    transformers.Gemma3Processor(image_processor=gemma3_image_processor(), tokenizer=tok,
                                 image_seq_length=4).save_pretrained(path)
    return model
