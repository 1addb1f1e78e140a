"""Qwen2-VL and Qwen2.5-VL against transformers on tiny random checkpoints (save_pretrained):
the vision tower + merger equal to HF's get_image_features for 1, 2 and 3 images of different
sizes (different grids) through transformers' own image processor; the M-RoPE positions equal to
HF's get_rope_index for prompts with 0 to 3 images; the language model with M-RoPE and the image
embeddings in place equal to HF's logits."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jpaged.models.loader import build_model, iter_safetensors
from jpaged.models.mrope import mrope_positions, step_mrope_positions, text_positions
from jpaged.models.qwen2_vl import Qwen2VLForConditionalGeneration, image_pixel_inputs, image_tokens
from tests.vision_checkpoints import (IMAGE_TOKEN, VISION_END, VISION_START, paged_forward, qwen_image_processor,
                                      random_images, save_qwen)

FAMILIES = ("qwen2_vl", "qwen2_5_vl")
SIZES = [(100, 60), (57, 200), (150, 150)]  # grids (1, 8, 4), (1, 4, 14), (1, 10, 10)
BUCKETS = (64, 256)


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    seed = int(os.environ.get("JPAGED_TEST_SEED") or 20261125) + FAMILIES.index(request.param)
    print(f"{request.param} checkpoint seed {seed}")
    path = tmp_path_factory.mktemp(request.param)
    hf = save_qwen(path, request.param, seed)
    ours = build_model(hf.config, iter_safetensors(str(path)), dtype=jnp.float32,
                       model_cls=Qwen2VLForConditionalGeneration)
    return hf, ours, np.random.default_rng(seed)


def encode(ours, hf_config, pixel_values: np.ndarray, grids) -> list[np.ndarray]:
    """Each image through embed_image on its own bucket-padded inputs, its tokens kept."""
    out, start = [], 0
    for grid in grids:
        n = int(np.prod(grid))
        inputs = image_pixel_inputs(ours.visual, pixel_values[start:start + n], grid, BUCKETS)
        emb = np.asarray(ours.embed_image(**{k: jnp.asarray(v) for k, v in inputs.items()}))
        assert emb.shape[0] == inputs["pixel_values"].shape[1] // 4
        out.append(emb[:image_tokens(hf_config, grid)])
        start += n
    return out


@pytest.mark.parametrize("count", [1, 2, 3])
def test_image_features_equal_hf(checkpoint, count):
    hf, ours, rng = checkpoint
    images = random_images(rng, SIZES[:count])
    batch = qwen_image_processor()(images=images, return_tensors="pt")
    grids = batch["image_grid_thw"].numpy()
    assert len({tuple(g) for g in grids}) == count  # different grids
    with torch.no_grad():
        ref = hf.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output
    ours_each = encode(ours, hf.config, batch["pixel_values"].numpy(), grids)
    for mine, theirs in zip(ours_each, ref):
        assert mine.shape == tuple(theirs.shape)
        np.testing.assert_allclose(mine, theirs.numpy(), atol=2e-5 * max(1.0, float(theirs.abs().max())), rtol=0)
    # Packed together (one sequence, one segment per image) the same.
    inputs = ours.visual.pack(batch["pixel_values"].numpy(), grids, pad_to=256 * count)
    packed = np.asarray(ours.embed_image(**{k: jnp.asarray(v[None]) for k, v in inputs.items()}))
    np.testing.assert_allclose(packed[:sum(len(r) for r in ref)], torch.cat(ref).numpy(), atol=2e-5, rtol=0)


def test_window_attention_matters(checkpoint):
    """Qwen2.5-VL: the windowed blocks see less than a frame (else the test above proves nothing)."""
    hf, ours, rng = checkpoint
    if not ours.visual.qwen25:
        pytest.skip("Qwen2-VL has no windows")
    batch = qwen_image_processor()(images=random_images(rng, SIZES[2:]), return_tensors="pt")
    inputs = image_pixel_inputs(ours.visual, batch["pixel_values"].numpy(), batch["image_grid_thw"][0], BUCKETS)
    assert len(set(inputs["windows"][inputs["windows"] >= 0].tolist())) > 1
    windowed = np.asarray(ours.embed_image(**{k: jnp.asarray(v) for k, v in inputs.items()}))
    full_blocks = ours.visual.full_blocks
    try:
        ours.visual.full_blocks = tuple(range(ours.visual.depth))  # every block attends to the whole frame
        full = np.asarray(ours.embed_image(**{k: jnp.asarray(v) for k, v in inputs.items()}))
    finally:
        ours.visual.full_blocks = full_blocks
    assert np.abs(windowed - full).max() > 1e-3


@pytest.mark.parametrize("block", [4, 16])
def test_banded_attention_equals_dense(block):
    """Contiguous runs of at most `block` (random lengths), then a longer run of padding: banded ==
    dense masked on every real query (a padding query sees fewer padding keys: dropped anyway)."""
    from jpaged.models.vision_layers import banded_attention, dense_attention

    rng = np.random.default_rng(block)
    lengths = []
    while sum(lengths) < 6 * block:
        lengths.append(int(rng.integers(1, block + 1)))
    segments = np.repeat(np.arange(len(lengths)), lengths)[:6 * block]
    segments = jnp.asarray(np.concatenate([segments, np.full(2 * block, -1)]), jnp.int32)
    q, k, v = (jnp.asarray(rng.standard_normal((8 * block, 2, 8)), jnp.float32) for _ in range(3))
    dense = np.asarray(dense_attention(q, k, v, segments, 0.3))
    banded = np.asarray(banded_attention(q, k, v, segments, block, 0.3))
    np.testing.assert_allclose(banded[:6 * block], dense[:6 * block], atol=1e-5, rtol=0)


def prompt_with_images(rng, grids, merge=2, text_runs=None):
    """Random text with each image's placeholders between vision start / end tokens."""
    runs = text_runs or [int(rng.integers(1, 6)) for _ in range(len(grids) + 1)]
    ids = rng.integers(3, 290, runs[0]).tolist()
    for i, grid in enumerate(grids):
        ids += [VISION_START] + [IMAGE_TOKEN] * (int(np.prod(grid)) // merge ** 2) + [VISION_END]
        ids += rng.integers(3, 290, runs[i + 1]).tolist()
    return ids


@pytest.mark.parametrize("count", [0, 1, 2, 3])
def test_mrope_positions_equal_hf(checkpoint, count):
    hf, _, rng = checkpoint
    grids = [(1, 8, 4), (1, 4, 14), (1, 10, 10)][:count]
    ids = prompt_with_images(rng, grids)
    ids_t = torch.tensor([ids])
    if count:
        ref, delta = hf.model.get_rope_index(ids_t, mm_token_type_ids=(ids_t == IMAGE_TOKEN).int(),
                                             image_grid_thw=torch.tensor(grids))
        ref, delta = ref[:, 0].numpy(), int(delta[0, 0])
    else:
        ref, delta = np.broadcast_to(np.arange(len(ids)), (3, len(ids))), 0
    pos, d = mrope_positions(ids, grids, IMAGE_TOKEN, 2)
    np.testing.assert_array_equal(pos, ref)
    assert d == delta
    np.testing.assert_array_equal(text_positions(len(ids), 2, d)[:, 0], [len(ids) + delta] * 3)


def test_mrope_positions_refuse_mismatch():
    ids = [5, IMAGE_TOKEN, IMAGE_TOKEN, 6]
    with pytest.raises(ValueError, match="placeholder"):
        mrope_positions(ids, [(1, 4, 4)], IMAGE_TOKEN, 2)  # 4 tokens needed, 2 given
    with pytest.raises(ValueError, match="image"):
        mrope_positions(ids, [], IMAGE_TOKEN, 2)
    with pytest.raises(ValueError, match="image"):
        mrope_positions([5, 6], [(1, 2, 2)], IMAGE_TOKEN, 2)


@pytest.mark.parametrize("count", [0, 1, 3])
def test_logits_with_images_equal_hf(checkpoint, count):
    """The whole prompt: ours (tower per image, embeddings in place, M-RoPE positions, paged
    prefill) against HF's forward with pixel_values."""
    hf, ours, rng = checkpoint
    images = random_images(rng, SIZES[:count])
    grids = []
    kwargs = {}
    if count:
        batch = qwen_image_processor()(images=images, return_tensors="pt")
        grids = [tuple(g) for g in batch["image_grid_thw"].tolist()]
        kwargs = dict(pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
    ids = prompt_with_images(rng, grids)
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        ref = hf(input_ids=ids_t, mm_token_type_ids=(ids_t == IMAGE_TOKEN).int(), **kwargs).logits[0].numpy()

    embeds = np.array(ours.embed_tokens_fn(jnp.asarray(ids, jnp.int32)))
    if count:
        feats = np.concatenate(encode(ours, hf.config, batch["pixel_values"].numpy(), grids))
        embeds[np.asarray(ids) == IMAGE_TOKEN] = feats
    positions, _ = mrope_positions(ids, grids, IMAGE_TOKEN, 2)
    logits = np.asarray(ours.compute_logits(paged_forward(ours, jnp.asarray(embeds), positions)))
    assert np.abs(logits - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())


def test_step_mrope_positions():
    """A step mixing a prefill chunk cut inside an image, a decode past an image prompt and a
    text-only prompt: each token's three positions are its prompt table's, or p + delta."""
    grids = [(1, 4, 6)]
    ids = [5, 6, VISION_START] + [IMAGE_TOKEN] * 6 + [VISION_END, 7]
    table, delta = mrope_positions(ids, grids, IMAGE_TOKEN, 2)
    assert delta == 3 + 3 + 2 - len(ids)  # text 3, image max(2, 3), text 2
    # seq 0: prompt positions 4..8 (a chunk); seq 1: decode at position 13; seq 2: text at 3..4; 2 pads.
    pos = np.array([4, 5, 6, 7, 8, 13, 3, 4, 0, 0], np.int32)
    out = step_mrope_positions(pos, [5, 1, 2], [(table, delta), (table, delta), None])
    np.testing.assert_array_equal(out[:, :5], table[:, 4:9])
    np.testing.assert_array_equal(out[:, 5], [13 + delta] * 3)
    np.testing.assert_array_equal(out[:, 6:], np.broadcast_to(pos[6:], (3, 4)))


def test_model_prompt_helpers(checkpoint):
    """pixel_inputs cuts image i out of the processor's batch; the grid read back off its padded
    inputs, and mrope_prompt equal to mrope_positions with the processor's grids."""
    hf, ours, rng = checkpoint
    ours.buckets = BUCKETS
    batch = qwen_image_processor()(images=random_images(rng, SIZES), return_tensors="np")
    grids = [tuple(int(v) for v in g) for g in batch["image_grid_thw"]]
    inputs = [ours.pixel_inputs(batch, i) for i in range(3)]
    assert [ours.image_grid(p) for p in inputs] == grids
    assert [ours.num_image_tokens(p) for p in inputs] == [image_tokens(hf.config, g) for g in grids]
    assert [ours.encoder_output_rows(p) for p in inputs] == [16, 16, 64]  # buckets 64, 64, 256
    start = grids[0][1] * grids[0][2]
    rows = inputs[1]["pixel_values"][0]
    if "unpermute" in inputs[1]:  # (Qwen2.5-VL: in window order; each merged unit's 4 patches together)
        rows = rows[(inputs[1]["unpermute"][0][:, None] * 4 + np.arange(4)).reshape(-1)]
    np.testing.assert_array_equal(rows[:grids[1][1] * grids[1][2]],
                                  batch["pixel_values"][start:start + grids[1][1] * grids[1][2]])
    ids = prompt_with_images(rng, grids)
    table, delta = ours.mrope_prompt(ids, inputs)
    ref, ref_delta = mrope_positions(ids, grids, IMAGE_TOKEN, 2)
    np.testing.assert_array_equal(table, ref)
    assert delta == ref_delta


def test_processor_keeps_images_within_the_largest_bucket():
    """A photo larger than the largest bucket is resized to fit it (not refused); each placeholder
    becomes its image's tokens; placeholders and images must agree."""
    import copy

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from jpaged.models import tiny
    from jpaged.models.qwen2_vl_processor import Qwen2VLPromptProcessor

    tok = copy.deepcopy(tiny.tiny_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": ["<|image_pad|>"]})
    proc = Qwen2VLPromptProcessor(tok, Qwen2VLImageProcessorPil(max_pixels=28 * 28 * 1280), max_patches=256)
    rng = np.random.default_rng(0)
    out = proc(text="a <|image_pad|> b <|image_pad|>", images=random_images(rng, [(600, 900), (40, 50)]))
    sizes = [int(np.prod(g)) for g in out["image_grid_thw"]]
    assert 128 < sizes[0] <= 256 and 16 <= sizes[1] < 128  # (min_pixels: 4 x 4 patches at least)
    ids = out["input_ids"][0]
    assert (ids == proc.image_token_id).sum() == sum(sizes) // 4 == out["mm_token_type_ids"].sum()
    assert out["pixel_values"].shape[0] == sum(sizes)
    with pytest.raises(ValueError, match="placeholder"):
        proc(text="no placeholder", images=random_images(rng, [(40, 50)]))


def test_query_chunks_equal_hf(checkpoint, monkeypatch):
    """A long packed sequence attended QUERY_CHUNK queries at a time (64 here: 4 chunks of a
    256-patch bucket, segment masks per chunk) equals HF's features."""
    from jpaged.models import vision_layers

    hf, ours, rng = checkpoint
    monkeypatch.setattr(vision_layers, "QUERY_CHUNK", 64)
    batch = qwen_image_processor()(images=random_images(rng, SIZES[:2]), return_tensors="pt")
    with torch.no_grad():
        ref = torch.cat(hf.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output).numpy()
    inputs = ours.visual.pack(batch["pixel_values"].numpy(), batch["image_grid_thw"].numpy(), pad_to=256)
    out = np.asarray(ours.embed_image(**{k: jnp.asarray(v[None]) for k, v in inputs.items()}))
    np.testing.assert_allclose(out[:len(ref)], ref, atol=2e-5 * max(1.0, np.abs(ref).max()), rtol=0)


def test_rename_hf_weight():
    """transformers' newer layout and the hub's (save_pretrained's) read the same."""
    rename = Qwen2VLForConditionalGeneration.rename_hf_weight
    assert rename("model.visual.blocks.0.attn.qkv.weight") == "visual.blocks.0.attn.qkv.weight"
    assert rename("model.language_model.layers.1.mlp.up_proj.weight") == "model.layers.1.mlp.up_proj.weight"
    assert rename("model.layers.1.mlp.up_proj.weight") == "model.layers.1.mlp.up_proj.weight"
    assert rename("lm_head.weight") == "lm_head.weight"
