"""Layers whose weights are stacked on a leading "layers" axis, for a `jax.lax.scan` over them."""

import os

from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.models.forward_context import forward_context, get_forward_context, hidden_states_capture

if TYPE_CHECKING:
    from jpaged.models.layers import HFWeights


def stack_params(layer: nnx.Module, num_layers: int):
    """Give every Param of `layer` a leading "layers" axis of `num_layers` (zeros; the loader fills
    them): one module then holds every layer's weights, and a scan runs one layer per row."""
    for _, node in nnx.iter_graph(layer):
        if isinstance(node, nnx.Param):
            node.set_value(jnp.zeros((num_layers,) + node.shape, node.dtype))
            node.set_metadata(logical_axes=("layers",) + node.logical_axes)


# Set (1, true): keep every scan over stacked layers on a GPU too (MaxText's scan_layers), instead of
# unrolling it (unroll_layers_on_gpu): compiles ~1.8x faster; each step copies the layers' weights
# out of the stack unless XLA's dynamic-slice fusion takes the slices (docs/PERF.md, "Warm-up
# compile time, deviceless H200").
SCAN_LAYERS_ENV = "JPAGED_SCAN_LAYERS"


def scan_layers_on_gpu() -> bool:
    """$JPAGED_SCAN_LAYERS: keep the scans on a GPU."""
    return os.environ.get(SCAN_LAYERS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class Unrollable:
    """A module that runs stacked layers under a scan, unrolled where its `unroll` is set (the loader
    sets it on a GPU: unroll_layers_on_gpu): LayerStack, and the vision towers' VisionLayers and
    EncoderStack."""

    def scan_unroll(self) -> int | bool:
        """`jax.lax.scan`'s unroll: every layer (static weight slices) or one (a loop)."""
        return True if getattr(self, "unroll", False) else 1


def layers_form(model: nnx.Module) -> str:
    """How the model's stacked layers run: "unrolled", "scanned", or "" (none): the executable
    cache's key takes it (engine/start_up.model_fingerprint)."""
    forms = {bool(node.unroll) for _, node in nnx.iter_graph(model) if isinstance(node, Unrollable)}
    return "" if not forms else "unrolled" if forms == {True} else "scanned" if forms == {False} else "mixed"


class LayerStack(nnx.Module, Unrollable):
    """`num_layers` decoder layers as one layer whose weights carry a leading "layers" axis, run
    under `jax.lax.scan`: a step compiles one layer whatever the depth (MaxText's scan-layers).

    `unroll` (the loader sets it on a GPU): the scan is unrolled, so each layer reads its weights
    where they lie. Scanned, XLA's GPU compiler copies every layer's weights out of the stack
    (a dynamic slice its GEMM fusions cannot take) on every step: all the weights read twice and
    written once more per step, ~1 ms of an H200's decode step for a 1B model (docs/PERF.md, the
    second GPU run). Unrolled, the slices are static and fuse into the GEMMs; compiling takes
    ~1.8x as long. CPUs keep the scan (compile time; XLA's CPU GEMMs read the slices in place).

    The KV pool is one KVCache (k_pages, v_pages) for all layers, [num_kv_heads, num_layers *
    pages_per_layer, page_size, head_dim]: each layer's pages follow the previous layer's, so the
    kernels keep their per-layer signature (the layer only offsets the block tables and slots)
    and the scan writes into the donated pool in place, with no per-layer slice copied out.
    """

    def __init__(self, make_layer: Callable[[], nnx.Module], num_layers: int):
        self.num_layers = num_layers
        self.unroll = False
        self.layer = make_layer()
        stack_params(self.layer, num_layers)

    def __call__(self, x, positions, kv_cache):
        graphdef, weights = nnx.split(self.layer)
        ctx = get_forward_context()
        num_pages, page_size = kv_cache.k_pages.shape[1:3]
        pages_per_layer = num_pages // self.num_layers

        capture = hidden_states_capture()
        if capture is not None and capture["states"] is not None:
            capture = None  # (the first stack's: the decoder's)
        # EAGLE-3's features: the inputs of these layers (a layer may be named twice).
        wanted = np.asarray(capture["layers"] if capture is not None else (), np.int32)

        def one_layer(carry, layer_weights_and_index):
            x, kv_cache, aux = carry
            layer_weights, index = layer_weights_and_index
            if capture is not None:
                aux = jnp.where((jnp.asarray(wanted) == index)[:, None, None], x[None], aux)
            layer = nnx.merge(graphdef, layer_weights)
            with forward_context(ctx.replace(attn=ctx.attn.for_layer(index, pages_per_layer, page_size))):
                x, kv_cache = layer(x, positions, kv_cache)
            return (x, kv_cache, aux), None

        aux = jnp.zeros((len(wanted),) + x.shape, x.dtype) if capture is not None else None
        (x, kv_cache, aux), _ = jax.lax.scan(one_layer, (x, kv_cache, aux), (weights, jnp.arange(self.num_layers)),
                                             unroll=self.scan_unroll())
        if capture is not None:
            capture["states"] = aux
        return x, kv_cache

    def hf_weights(self, prefix: Callable[[int], str]) -> "HFWeights":
        """Layer i's tensors (named with `prefix(i)`) fill slice i of the stacked weights."""
        specs = {}
        for i in range(self.num_layers):
            for name, targets in self.layer.hf_weights(prefix(i)).items():
                specs[name] = [target._replace(layer=i) for target in targets]
        return specs


def unroll_layers_on_gpu(model: nnx.Module, mesh) -> None:
    """On a GPU, unroll every scan over stacked layers (LayerStack, the vision towers' stacks: the
    GEMMs then read each layer's weights in place instead of a copy per step), unless
    $JPAGED_SCAN_LAYERS says to keep them. The loader calls it on every model it builds."""
    if mesh.devices.flat[0].platform == "gpu" and not scan_layers_on_gpu():
        for _, node in nnx.iter_graph(model):
            if isinstance(node, Unrollable):
                node.unroll = True
