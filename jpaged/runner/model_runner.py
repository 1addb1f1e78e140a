"""ModelRunner: owns the model's weights and the KV page arrays and runs jitted forward steps.

The NNX model is split once into a static graph definition and a state pytree; the jitted
step merges them inside, so no Python object traversal happens per step. The KV page arrays
(one (k_pages, v_pages) pair per layer, each [num_kv_heads, num_pages, page_size, head_dim])
are donated to the step and come back updated in place.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.models.layers import Attention, AttentionMetadata
from jpaged.models.loader import LoadedModel


def kv_cache_layout(model: nnx.Module) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim), read off the model's attention layers."""
    attns = [node for _, node in nnx.iter_graph(model) if isinstance(node, Attention)]
    num_kv_heads, head_dim = attns[0].k_proj.out_shape
    return len(attns), num_kv_heads, head_dim


class ModelRunner:
    def __init__(self, loaded: LoadedModel, *, block_size: int, num_blocks: int):
        self.block_size, self.num_blocks = block_size, num_blocks
        self.graphdef, self.state = nnx.split(loaded.model)
        num_layers, num_kv_heads, head_dim = kv_cache_layout(loaded.model)
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        self.kv_caches = [(jnp.zeros(shape, loaded.dtype), jnp.zeros(shape, loaded.dtype)) for _ in range(num_layers)]
        self._forward = jax.jit(functools.partial(_forward, self.graphdef), donate_argnums=(1,))

    def forward(self, input_ids, positions, meta: AttentionMetadata, logits_indices) -> np.ndarray:
        """Run one step over the packed tokens; returns fp32 logits of the rows in `logits_indices`."""
        logits, self.kv_caches = self._forward(self.state, self.kv_caches, jnp.asarray(input_ids, jnp.int32),
                                               jnp.asarray(positions, jnp.int32), meta,
                                               jnp.asarray(logits_indices, jnp.int32))
        return np.asarray(logits)


def _forward(graphdef, state, kv_caches, input_ids, positions, meta, logits_indices):
    model = nnx.merge(graphdef, state)
    hidden, kv_caches = model(input_ids, positions, kv_caches, meta)
    return model.compute_logits(hidden[logits_indices]), kv_caches
