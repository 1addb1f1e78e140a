"""Gemma 3's multimodal checkpoints against transformers on a tiny random one (save_pretrained):
SigLIP + the multimodal projector equal to HF's get_image_features for 1, 2 and 3 images of
different sizes through transformers' Gemma 3 image processor; the text decoder under the
multimodal wrapper equal to HF's logits on text; with images, equal to HF's forward with
token_type_ids (an image's tokens attend to each other both ways: jpaged's key limits) and
without (causal: no key limits)."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jpaged.models.gemma3_mm import Gemma3ForConditionalGeneration
from jpaged.models.loader import build_model, iter_safetensors
from tests.vision_checkpoints import (GEMMA_BOI, GEMMA_EOI, GEMMA_IMAGE_TOKEN, gemma3_image_processor, paged_forward,
                                      random_images, save_gemma3)

SIZES = [(100, 60), (57, 200), (150, 150)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    seed = int(os.environ.get("JPAGED_TEST_SEED") or 20261125) + 7
    print(f"gemma3 checkpoint seed {seed}")
    path = tmp_path_factory.mktemp("gemma3")
    hf = save_gemma3(path, seed)
    names = Gemma3ForConditionalGeneration.rename_hf_weight
    ours = build_model(hf.config, ((names(n), t) for n, t in iter_safetensors(str(path))), dtype=jnp.float32,
                       model_cls=Gemma3ForConditionalGeneration)
    return hf, ours, np.random.default_rng(seed)


@pytest.mark.parametrize("count", [1, 2, 3])
def test_image_features_equal_hf(checkpoint, count):
    hf, ours, rng = checkpoint
    pixels = gemma3_image_processor()(images=random_images(rng, SIZES[:count]), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        ref = hf.get_image_features(pixels).pooler_output.numpy()  # [images, 4, hidden]
    one_by_one = np.stack([np.asarray(ours.embed_image(jnp.asarray(pixels[i:i + 1].numpy()))) for i in range(count)])
    together = np.asarray(ours.embed_image(jnp.asarray(pixels.numpy()))).reshape(ref.shape)
    for mine in (one_by_one, together):
        np.testing.assert_allclose(mine, ref, atol=2e-5 * max(1.0, np.abs(ref).max()), rtol=0)


def test_rename_hf_weight():
    rename = Gemma3ForConditionalGeneration.rename_hf_weight
    assert rename("language_model.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert rename("model.language_model.norm.weight") == "model.norm.weight"
    assert rename("vision_tower.vision_model.post_layernorm.bias") == "vision_tower.post_layernorm.bias"
    assert rename("model.vision_tower.vision_model.embeddings.patch_embedding.weight") == \
        "vision_tower.embeddings.patch_embedding.weight"
    assert rename("multi_modal_projector.mm_soft_emb_norm.weight") == "multi_modal_projector.mm_soft_emb_norm.weight"


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("count", [0, 2])
def test_logits_equal_hf(checkpoint, count, bidirectional):
    """Text with `count` images (boi, 4 image tokens, eoi), longer than the sliding window: ours
    (embeddings in place, paged prefill) against HF's forward with token_type_ids (each image's
    tokens see their whole image: our key limits at the image's last position) or without
    (causal, as ours without key limits)."""
    hf, ours, rng = checkpoint
    ids = rng.integers(3, 290, 6).tolist()
    for _ in range(count):
        ids += [GEMMA_BOI] + [GEMMA_IMAGE_TOKEN] * 4 + [GEMMA_EOI] + rng.integers(3, 290, 5).tolist()
    kwargs = {}
    embeds = np.array(ours.embed_tokens_fn(jnp.asarray(ids, jnp.int32)))
    if count:
        pixels = gemma3_image_processor()(images=random_images(rng, SIZES[:count]), return_tensors="pt")["pixel_values"]
        kwargs["pixel_values"] = pixels
        embeds[np.asarray(ids) == GEMMA_IMAGE_TOKEN] = np.asarray(ours.embed_image(jnp.asarray(pixels.numpy())))
    limits = None
    if bidirectional:
        image = np.asarray(ids) == GEMMA_IMAGE_TOKEN
        kwargs["token_type_ids"] = torch.from_numpy(image.astype(np.int64)[None])
        ends = np.flatnonzero(image & ~np.append(image[1:], False))  # each image's last position
        following = ends[np.minimum(np.searchsorted(ends, np.arange(len(ids))), len(ends) - 1)] if len(ends) else 0
        limits = np.where(image, following, -1)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids]), **kwargs).logits[0].numpy()
    logits = np.asarray(ours.compute_logits(paged_forward(ours, jnp.asarray(embeds), np.arange(len(ids)),
                                                          key_limits=limits)))
    assert np.abs(logits - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())
