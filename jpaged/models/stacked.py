"""Layers whose weights are stacked on a leading "layers" axis, for a `jax.lax.scan` over them."""

import jax.numpy as jnp
from flax import nnx


def stack_params(layer: nnx.Module, num_layers: int):
    """Give every Param of `layer` a leading "layers" axis of `num_layers` (zeros; the loader fills
    them): one module then holds every layer's weights, and a scan runs one layer per row."""
    for _, node in nnx.iter_graph(layer):
        if isinstance(node, nnx.Param):
            node.set_value(jnp.zeros((num_layers,) + node.shape, node.dtype))
            node.set_metadata(logical_axes=("layers",) + node.logical_axes)
