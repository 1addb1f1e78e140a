"""The KV cache: its spec (one owner for layout, dtype and bytes) and the pool as a typed pytree.

KVCacheSpec says what a block is: layers, kv heads (the pool's head axis, counting the copies
tensor parallelism makes), head dim, block size, dtype, and so its bytes on each device. Pool
sizing (the engine), the runner (the device pool, the host swap pool, the swapped pages' shape)
and the kernel call sites (Attention, block copies) all take it from here.

KVCache is the pool: k and v pages, [num_kv_heads, num_layers * num_blocks, block_size, head_dim]
(layer l's pages follow layer l - 1's; see LayerStack), and a slot for per-layer scales (None
while the pages hold the model's dtype; a quantized cache keeps f32[num_layers] scales there).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.config import KV_CACHE_DTYPES
from jpaged.models.layers import Attention
from jpaged.models.stacked import LayerStack
from pallas_kernels.cache_ops import FP8, RAW_BITS, as_dtype


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["k_pages", "v_pages", "k_scale", "v_scale", "scales_pending"],
                   meta_fields=["raw_of", "v_transposed"])
@dataclasses.dataclass
class KVCache:
    k_pages: jax.Array
    v_pages: jax.Array
    k_scale: jax.Array | None = None  # f32[num_layers] for a quantized cache
    v_scale: jax.Array | None = None
    # bool[] with calculate_kv_scales: True until a step computed the scales from its K and V
    # (the runner clears it after the first step).
    scales_pending: jax.Array | None = None
    # The pages hold the raw bits (unsigned ints of its width) of this dtype, None: of their own.
    # On a CPU for dtypes narrower than 32 bits: XLA's CPU backend cannot scatter them in place
    # (pallas_kernels.cache_ops.write_kv).
    raw_of: np.dtype | None = None
    # v_pages are [num_kv_heads, pages, head_dim, block_size] (pallas_kernels.cache_ops' variant
    # layout for fp8 caches, kv_cache_v_transposed); k_pages keep [.., block_size, head_dim].
    v_transposed: bool = False

    def replace(self, **changes) -> "KVCache":
        return dataclasses.replace(self, **changes)

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the values the pages hold."""
        return np.dtype(self.raw_of or self.k_pages.dtype)

    def typed_pages(self) -> tuple[jax.Array, jax.Array]:
        """k_pages and v_pages as `dtype` arrays (for tests and tools; the step reads raw ones)."""
        return as_dtype(self.k_pages, self.raw_of), as_dtype(self.v_pages, self.raw_of)


# kv_cache_dtype (vLLM's names) -> the pages' dtype; "auto" keeps the model's.
FP8_DTYPES = {name: jnp.float8_e5m2 if name.endswith("e5m2") else jnp.float8_e4m3fn
              for name in KV_CACHE_DTYPES if name != "auto"}


def kv_dtype(kv_cache_dtype: str, model_dtype) -> np.dtype:
    return np.dtype(FP8_DTYPES.get(kv_cache_dtype, model_dtype))


def is_quantized(dtype) -> bool:
    return np.dtype(dtype) in {np.dtype(t) for t in FP8}


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int  # the pool's head axis: kv heads times their tensor-parallel copies
    head_dim: int
    block_size: int
    dtype: np.dtype
    tp_size: int = 1  # the head axis is split over this many devices
    v_transposed: bool = False  # V pages [.., head_dim, block_size] (KVCache.v_transposed)

    @classmethod
    def of_model(cls, model: nnx.Module, block_size: int, dtype, tp_size: int = 1,
                 v_transposed: bool = False) -> "KVCacheSpec":
        """Read off the model's layer stack and attention layers (one spec for every layer)."""
        nodes = [node for _, node in nnx.iter_graph(model)]
        stack = next(node for node in nodes if isinstance(node, LayerStack))
        num_kv_heads, head_dim = next(node for node in nodes if isinstance(node, Attention)).k_proj.out_shape
        return cls(stack.num_layers, num_kv_heads, head_dim, block_size, np.dtype(dtype), tp_size, v_transposed)

    @property
    def bytes_per_block(self) -> int:
        """One block of every layer, K and V, on each device (its share of the kv heads)."""
        return (2 * self.num_layers * (self.num_kv_heads // self.tp_size) * self.block_size * self.head_dim
                * self.dtype.itemsize)

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        """k_pages / v_pages: [num_kv_heads, num_layers * num_blocks, block_size, head_dim]."""
        return (self.num_kv_heads, self.num_layers * num_blocks, self.block_size, self.head_dim)

    def v_pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        """v_pages: pool_shape's, or [.., head_dim, block_size] when v_transposed."""
        shape = self.pool_shape(num_blocks)
        return shape[:2] + shape[:1:-1] if self.v_transposed else shape

    def swapped_pages_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Blocks in flight between the pool and the host: [layers, k/v, kv_heads, blocks, block_size, head_dim]
        (V in the standard layout whatever the pool's: kv_transfer transposes it)."""
        return (self.num_layers, 2, self.num_kv_heads, num_blocks, self.block_size, self.head_dim)

    def host_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One device's host swap pool: its share of the kv heads."""
        return (self.num_layers, 2, self.num_kv_heads // self.tp_size, num_blocks, self.block_size, self.head_dim)

    @property
    def quantized(self) -> bool:
        """fp8 pages: K and V stored divided by a per-layer scale (KVCache.k_scale, v_scale)."""
        return is_quantized(self.dtype)

    def allocate(self, num_blocks: int, sharding, scales: "tuple[np.ndarray, np.ndarray] | None" = None,
                 calculate_scales: bool = False) -> KVCache:
        """Zeroed pages; fp8 ones with per-layer scales (`scales`: (k, v) f32[num_layers], else 1.0,
        or computed by the first step with `calculate_scales`)."""
        shapes = self.abstract(num_blocks, sharding, scales, calculate_scales)
        cache = shapes.replace(k_pages=zeros(shapes.k_pages), v_pages=zeros(shapes.v_pages))
        if self.quantized:
            k, v = scales if scales is not None else (np.ones(self.num_layers, np.float32),) * 2
            replicated = shapes.k_scale.sharding
            cache = cache.replace(k_scale=jax.device_put(np.asarray(k, np.float32), replicated),
                                  v_scale=jax.device_put(np.asarray(v, np.float32), replicated),
                                  scales_pending=jax.device_put(np.bool_(True), replicated) if calculate_scales
                                  else None)
        return cache

    def abstract(self, num_blocks: int, sharding, scales=None, calculate_scales: bool = False) -> KVCache:
        """The KVCache `allocate` would return, as shapes (jax.ShapeDtypeStruct) only: nothing is
        allocated (a runner that compiles to measure memory before the pool is sized)."""
        raw = stores_raw_bits(self.dtype, sharding)
        pages, v_pages = (jax.ShapeDtypeStruct(shape, RAW_BITS[self.dtype.itemsize] if raw else self.dtype,
                                               sharding=sharding)
                          for shape in (self.pool_shape(num_blocks), self.v_pool_shape(num_blocks)))
        cache = KVCache(pages, v_pages, raw_of=self.dtype if raw else None, v_transposed=self.v_transposed)
        if self.quantized:
            replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
            scale = jax.ShapeDtypeStruct((self.num_layers,), jnp.float32, sharding=replicated)
            cache = cache.replace(k_scale=scale, v_scale=scale, scales_pending=jax.ShapeDtypeStruct(
                (), jnp.bool_, sharding=replicated) if calculate_scales else None)
        return cache


def zeros(pages: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeroed pages. On a CPU, numpy's zeros copied to the devices: jnp.zeros compiles two
    executables there, the process's first (XLA's set-up included: 0.15-0.25 s of a cached start);
    on an accelerator jnp.zeros fills them in place, with no host copy of the pool."""
    if next(iter(pages.sharding.device_set)).platform == "cpu" and pages.sharding.is_fully_addressable:
        return jax.device_put(np.zeros(pages.shape, pages.dtype), pages.sharding)
    return jnp.zeros(pages.shape, pages.dtype, device=pages.sharding)


def stores_raw_bits(dtype, sharding) -> bool:
    """Whether a pool of `dtype` on `sharding`'s devices holds raw bits: on a CPU, for floats
    narrower than 32 bits (see KVCache.raw_of)."""
    platform = next(iter(sharding.device_set)).platform
    return platform == "cpu" and np.dtype(dtype).itemsize < 4


def max_scale(x, dtype, axis_name: str | None = None):
    """The scale that maps x's largest magnitude to `dtype`'s largest finite value
    (calculate_kv_scales); `axis_name`: the mesh axis x's heads are split over (inside shard_map)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    if axis_name is not None:
        amax = jax.lax.pmax(amax, axis_name)
    return jnp.maximum(amax / float(jnp.finfo(dtype).max), 1e-12)
