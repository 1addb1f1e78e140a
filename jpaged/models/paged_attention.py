"""The paged attention call site: each layer's new K/V written into the KV pages (quantized for
an fp8 cache, at the layer's scales), then the kernels reading them through the block tables,
per tensor-parallel shard under shard_map. The one place the model meets pallas_kernels.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

import pallas_kernels
from pallas_kernels import invariant
from jpaged.models.forward_context import AttentionMetadata
from jpaged.models.kv_cache import KVCache, KVCacheSpec, max_scale
from jpaged.models.layers import Attention
from jpaged.parallel.sharding import TP_AXIS, kv_cache_sharding


@dataclasses.dataclass(frozen=True)
class AttentionOps:
    """The swappable attention functions (hashable, so they live in the static graph).

    With a `mesh` (tensor parallelism) the KV write and the kernels run per shard (shard_map),
    each on its own heads and its own part of every page; the block tables are the same for all.
    """

    backend: str = "auto"
    mesh: Mesh | None = None
    batch_invariant: bool = False  # pallas_kernels.invariant for every step, decode or prefill
    # LLM.policy()'s forward: the invariant attention visits this many key chunks (a static loop,
    # which jax.grad can reverse); None: up to the longest context (a loop with a traced end).
    static_chunks: int | None = None
    # The invariant attention's rows per query tile, (one-token sequences, others): measured at load
    # (invariant.invariant_tiles), other than QUERY_TILE where this backend's dots keep the bits.
    invariant_tiles: tuple[int, int] = (invariant.QUERY_TILE, invariant.QUERY_TILE)

    def __call__(self, q, k, v, kv_cache: KVCache, meta: AttentionMetadata, scale: float, sliding_window=None,
                 logits_soft_cap: float | None = None):
        """`sliding_window`: None (full attention), an int, or a traced int32 scalar (per layer)."""
        # A step known to be a decode when tracing: static, so it does not travel into shard_map.
        decode_only = meta.decode is True
        if decode_only:
            meta = dataclasses.replace(meta, decode=None)
        attend = functools.partial(self._attend, scale=scale, logits_soft_cap=logits_soft_cap, decode_only=decode_only)
        if self.mesh is None:
            return attend(q, k, v, kv_cache, meta, sliding_window)
        heads, pages = P(None, TP_AXIS, None), kv_cache_sharding(self.mesh).spec
        # check_vma=False: the Pallas kernels do not declare how they vary across the mesh.
        pool = KVCache(pages, pages, *(None if x is None else P() for x in
                                       (kv_cache.k_scale, kv_cache.v_scale, kv_cache.scales_pending)),
                       raw_of=kv_cache.raw_of, v_transposed=kv_cache.v_transposed)
        return jax.shard_map(attend, mesh=self.mesh, in_specs=(heads, heads, heads, pool, P(), P()),
                             out_specs=(heads, pool), check_vma=False)(
            q, k, v, kv_cache, meta, sliding_window)

    def _attend(self, q, k, v, kv_cache: KVCache, meta: AttentionMetadata, sliding_window, scale: float,
                logits_soft_cap, decode_only: bool):
        k_scale = v_scale = None
        if kv_cache.k_scale is not None:  # fp8 pages: this layer's scales
            kv_cache, k_scale, v_scale = self._layer_scales(kv_cache, k, v, meta.layer)
        k_pages, v_pages = pallas_kernels.write_kv(kv_cache.k_pages, kv_cache.v_pages, k, v, meta.slot_mapping,
                                                   k_scale, v_scale, kv_dtype=kv_cache.raw_of,
                                                   v_transposed=kv_cache.v_transposed)
        kv_cache = kv_cache.replace(k_pages=k_pages, v_pages=v_pages)
        if k_scale is not None:  # q . (k8 * k_scale) = (q * k_scale) . k8: the kernels only widen fp8 pages
            q = (q.astype(jnp.float32) * k_scale).astype(q.dtype)
        out = self._kernels(q, k_pages, v_pages, meta, sliding_window, scale, logits_soft_cap, decode_only,
                            kv_cache.raw_of, kv_cache.v_transposed)
        if v_scale is not None:  # sum_j p_j (v8_j * v_scale) = v_scale * sum_j p_j v8_j
            out = (out.astype(jnp.float32) * v_scale).astype(out.dtype)
        return out, kv_cache

    def _layer_scales(self, kv_cache: KVCache, k, v, layer):
        """Layer `layer`'s K and V scales. While `scales_pending` (calculate_kv_scales, until the
        first step ran), they are computed from this step's keys and values, over every shard's
        heads, and kept."""
        k_scale, v_scale = kv_cache.k_scale[layer], kv_cache.v_scale[layer]
        if kv_cache.scales_pending is None:  # scales given (checkpoint or 1.0): nothing to compute
            return kv_cache, k_scale, v_scale
        axis = None if self.mesh is None else TP_AXIS
        pending = kv_cache.scales_pending
        k_scale = jnp.where(pending, max_scale(k, kv_cache.dtype, axis), k_scale)
        v_scale = jnp.where(pending, max_scale(v, kv_cache.dtype, axis), v_scale)
        kv_cache = kv_cache.replace(k_scale=kv_cache.k_scale.at[layer].set(k_scale),
                                    v_scale=kv_cache.v_scale.at[layer].set(v_scale))
        return kv_cache, k_scale, v_scale

    def _kernels(self, q, k_pages, v_pages, meta, sliding_window, scale, logits_soft_cap, decode_only, kv_dtype,
                 v_transposed=False):
        args = (q, k_pages, v_pages, meta.block_tables, meta.context_lens)
        # pallas_kernels picks the kernels (interpret mode for Pallas ones off-GPU).
        opts = dict(scale=scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, backend=self.backend,
                    kv_dtype=kv_dtype, **({"v_transposed": True} if v_transposed else {}))

        def decode():
            return pallas_kernels.paged_attention(*args, **opts)

        limits = {} if meta.key_limits is None else {"key_limits": meta.key_limits}  # (Gemma 3's images)

        def ragged():
            return pallas_kernels.ragged_paged_attention(*args, meta.query_start_loc, **opts, **limits)

        if self.batch_invariant:  # (EngineConfig refuses kv_cache_v_transposed with it)
            return invariant.ragged_paged_attention_invariant(*args, meta.query_start_loc, scale=scale,
                                                              sliding_window=sliding_window,
                                                              logits_soft_cap=logits_soft_cap, kv_dtype=kv_dtype,
                                                              num_chunks=self.static_chunks,
                                                              tiles=self.invariant_tiles, **limits)
        # XLA's ragged path is as fast as its decode path on decode steps (tile 1; measured faster
        # inside the multi-step decode on a CPU): one branch, less to compile.
        if pallas_kernels.kernel_family(self.backend) == "xla":
            return ragged()
        if decode_only:  # a step the host knows is a decode (its own executable; multi-step): the decode kernel alone
            return decode()
        if meta.decode is None:
            return ragged()
        return jax.lax.cond(meta.decode, decode, ragged)  # (a traced flag: XLA:GPU reads it on the host)


def check_kernels(model, spec: KVCacheSpec, dtype, backend: str) -> None:
    """A model or KV cache dtype the chosen kernels cannot take is a ValueError at start-up, not at
    the first step that traces them (enforce_eager compiles nothing before serving)."""
    attention = next(node for _, node in nnx.iter_graph(model) if isinstance(node, Attention))
    if spec.v_transposed and pallas_kernels.kernel_family(backend) == "mosaic":
        raise ValueError("kv_cache_v_transposed: attention_backend='mosaic' has no prefill over transposed V blocks "
                         "yet: use 'pallas' or 'auto'")
    num_heads, head_dim = attention.q_proj.out_shape
    pallas_kernels.check_supported(jax.ShapeDtypeStruct((1, num_heads, head_dim), dtype),
                                   jax.ShapeDtypeStruct(spec.pool_shape(1), spec.dtype), backend)


def attention_family(model) -> str:
    """The kernel family of a model's attention ("pallas", "mosaic" or "xla"; none: "xla")."""
    attention = next((node for _, node in nnx.iter_graph(model) if isinstance(node, Attention)), None)
    return "xla" if attention is None else pallas_kernels.kernel_family(attention.ops.backend)
