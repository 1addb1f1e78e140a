"""The vision towers' stacked layers (CLIP's VisionLayers, SigLIP's and Qwen2-VL's EncoderStack)
unrolled, as the loader builds them on a GPU (stacked.unroll_layers_on_gpu), compute what their scan
does (the CPU's form), and lower without a loop; $JPAGED_SCAN_LAYERS keeps the scans on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers as tf
from flax import nnx
from test_layer_stack import _Mesh

from jpaged.models.clip_vision import CLIPVisionTower
from jpaged.models.layers import Linear
from jpaged.models.siglip import SiglipVisionTower
from jpaged.models.stacked import SCAN_LAYERS_ENV, Unrollable, layers_form, unroll_layers_on_gpu
from jpaged.models.vision_layers import EncoderStack

SEED = 20261128


def randomized(model, seed=SEED):
    """Every parameter random (stacked ones start as zeros): layers that differ from each other."""
    rng = np.random.default_rng(seed)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            node.set_value(jnp.asarray(rng.normal(0, 0.2, node.shape), node.dtype))
    return model


def stacks(model):
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, Unrollable)]


def scanned_and_unrolled(model, fn, *args):
    """fn(model, *args) jitted with the model's stacks scanned, then unrolled; and each one's
    lowered text."""
    graphdef, state = nnx.split(model)
    results = []
    for unroll in (False, True):
        model = nnx.merge(graphdef, state)
        for stack in stacks(model):
            stack.unroll = unroll
        g, s = nnx.split(model)
        jitted = jax.jit(lambda s, *a: fn(nnx.merge(g, s), *a))
        results.append((np.asarray(jitted(s, *args)), jitted.lower(s, *args).as_text()))
    return results


CLIP = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                           image_size=28, patch_size=14)
SIGLIP = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                               image_size=28, patch_size=14)


@pytest.mark.parametrize("num_layers", [2, 3])  # LLaVA takes the hidden states of the first layers only
def test_clip_tower_unrolled_equals_the_scan(num_layers):
    tower = randomized(CLIPVisionTower(CLIP, dtype=jnp.float32))
    pixels = jnp.asarray(np.random.default_rng(SEED).normal(size=(2, 3, 28, 28)), jnp.float32)
    (scanned, scan_text), (unrolled, unrolled_text) = scanned_and_unrolled(
        tower, lambda m, p: m(p, num_layers), pixels)
    assert scanned.shape == (num_layers + 1, 2, 5, 32) and np.abs(scanned).max() > 0.1
    np.testing.assert_allclose(unrolled, scanned, rtol=1e-5, atol=1e-5)
    assert "stablehlo.while" in scan_text and "stablehlo.while" not in unrolled_text


def test_siglip_tower_unrolled_equals_the_scan():
    tower = randomized(SiglipVisionTower(SIGLIP, dtype=jnp.float32))
    pixels = jnp.asarray(np.random.default_rng(SEED).normal(size=(2, 3, 28, 28)), jnp.float32)
    (scanned, scan_text), (unrolled, unrolled_text) = scanned_and_unrolled(tower, lambda m, p: m(p), pixels)
    assert np.abs(scanned).max() > 0.1
    np.testing.assert_allclose(unrolled, scanned, rtol=1e-5, atol=1e-5)
    assert "stablehlo.while" in scan_text and "stablehlo.while" not in unrolled_text


class _Block(nnx.Module):
    """A block that reads `shared` and its own row of `per_layer` (as Qwen2.5-VL's full-attention flag)."""

    def __init__(self):
        self.proj = Linear((8,), (8,), ("vision_embed", "vision_mlp"), dtype=jnp.float32)

    def __call__(self, x, shared, per_layer):
        return jnp.tanh(self.proj(x) * shared + jnp.where(per_layer, 1.0, -1.0))

    def hf_weights(self, prefix):
        return {}


def test_encoder_stack_with_per_layer_rows_unrolled_equals_the_scan():
    stack = randomized(EncoderStack(_Block, 4))
    x = jnp.asarray(np.random.default_rng(SEED).normal(size=(5, 8)), jnp.float32)
    per_layer = jnp.asarray([True, False, False, True])
    (scanned, _), (unrolled, unrolled_text) = scanned_and_unrolled(
        stack, lambda m, x, p: m(x, 0.5, p), x, per_layer)
    np.testing.assert_allclose(unrolled, scanned, rtol=1e-6, atol=1e-6)
    assert "stablehlo.while" not in unrolled_text


def test_only_a_gpu_unrolls_the_towers_and_scan_layers_keeps_the_scan(monkeypatch):
    monkeypatch.delenv(SCAN_LAYERS_ENV, raising=False)
    for platform, expected in (("cpu", "scanned"), ("gpu", "unrolled")):
        tower = nnx.eval_shape(lambda: CLIPVisionTower(CLIP, dtype=jnp.float32))
        siglip = nnx.eval_shape(lambda: SiglipVisionTower(SIGLIP, dtype=jnp.float32))
        for model in (tower, siglip):
            unroll_layers_on_gpu(model, _Mesh(platform))
            assert stacks(model) and layers_form(model) == expected, platform
    monkeypatch.setenv(SCAN_LAYERS_ENV, "1")
    tower = nnx.eval_shape(lambda: CLIPVisionTower(CLIP, dtype=jnp.float32))
    unroll_layers_on_gpu(tower, _Mesh("gpu"))
    assert layers_form(tower) == "scanned"
