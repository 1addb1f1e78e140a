"""Block copies and swaps of the KV pool: the device functions that copy a block's pages of every
layer, gather them for a swap-out and scatter them back for a swap-in, the host-side padding of
(block, block) pairs into fixed-size chunks, and the runner's operations over them (`BlockOps`,
which ModelRunner inherits)."""

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels

from jpaged.models.kv_cache import KVCache
from jpaged.runner.buckets import BLOCK_OP_SIZES, fit


def padded_chunks(pairs):
    """Index pairs as chunks of at most BLOCK_OP_SIZES[-1], each padded to a size of
    BLOCK_OP_SIZES (-1: skip): (first indices, second indices, real length) per chunk."""
    largest = BLOCK_OP_SIZES[-1]
    for start in range(0, len(pairs), largest):
        chunk = pairs[start:start + largest]
        arr = np.full((fit(BLOCK_OP_SIZES, len(chunk)), 2), -1, np.int32)
        arr[:len(chunk)] = chunk
        yield arr[:, 0], arr[:, 1], len(chunk)


def every_layer(blocks, num_layers: int, pages_per_layer: int):
    """Blocks int32[n] -> the pool pages holding them in every layer, int32[num_layers * n] (layer
    major); padding (-1) stays -1."""
    pages = blocks[None, :] + pages_per_layer * jnp.arange(num_layers, dtype=blocks.dtype)[:, None]
    return jnp.where(blocks[None, :] < 0, -1, pages).reshape(-1)


def copy_blocks(num_layers, kv_cache: KVCache, src, dst) -> KVCache:
    pages_per_layer = kv_cache.k_pages.shape[1] // num_layers
    k, v = pallas_kernels.copy_blocks(kv_cache.k_pages, kv_cache.v_pages, every_layer(src, num_layers, pages_per_layer),
                                      every_layer(dst, num_layers, pages_per_layer))
    return kv_cache.replace(k_pages=k, v_pages=v)


def gather_blocks(num_layers, kv_cache: KVCache, blocks):
    """Blocks' pages of every layer: [num_layers, k/v, num_kv_heads, blocks, page_size, head_dim]."""
    k, v = kv_cache.k_pages, kv_cache.v_pages
    pages = every_layer(blocks, num_layers, k.shape[1] // num_layers)
    v_blocks = jnp.swapaxes(v[:, pages], -1, -2) if kv_cache.v_transposed else v[:, pages]  # the host's: standard
    both = jnp.stack([k[:, pages], v_blocks])  # [2, kv_heads, layers * blocks, ...]
    both = both.reshape(both.shape[:2] + (num_layers, len(blocks)) + both.shape[3:])
    return both.transpose(2, 0, 1, 3, 4, 5)


def scatter_blocks(num_layers, kv_cache: KVCache, pages, blocks) -> KVCache:
    k, v = kv_cache.k_pages, kv_cache.v_pages
    dst = every_layer(blocks, num_layers, k.shape[1] // num_layers)
    dst = jnp.where(dst < 0, k.shape[1], dst)  # padding -> dropped

    def layer_major(part):  # [layers, kv_heads, blocks, ...] -> [kv_heads, layers * blocks, ...]
        part = part.transpose(1, 0, 2, 3, 4)
        return part.reshape((part.shape[0], -1) + part.shape[3:])

    v_new = layer_major(pages[:, 1])
    if kv_cache.v_transposed:  # (the host's V is in the standard layout)
        v_new = jnp.swapaxes(v_new, -1, -2)
    return kv_cache.replace(k_pages=k.at[:, dst].set(layer_major(pages[:, 0]), mode="drop"),
                            v_pages=v.at[:, dst].set(v_new, mode="drop"))


class BlockOps:
    """The runner's block copies (copy-on-write) and swaps between the device pool and the host's,
    for every pool addressed by the same block ids (`pools`: the runner's and its proposer's).
    Each chunk is a device operation (`dispatch_op`: multi-host sends it); the executables are the
    runner's (`_executable`), its pages `kv_cache` and its host pool `host_kv`."""

    def copy_blocks(self, pairs: list[tuple[int, int]]):
        # Chunks may run one after another: copy-on-write never chains copies within a step.
        for src, dst, _ in padded_chunks(pairs):
            self.dispatch_op("copy_blocks", src, dst)

    def _copy_blocks(self, src, dst):
        for pool in self.pools:
            pool.copy_pool_blocks(src, dst)

    def copy_pool_blocks(self, src, dst):
        """These pages' blocks `src` -> `dst`."""
        self.kv_cache = self._executable(("copy_blocks", len(src)))(self.kv_cache, src, dst)

    def swap_out(self, pairs: list[tuple[int, int]]):
        """Device pages -> host pool, for (gpu_block, cpu_block) pairs."""
        for gpu, cpu, n in padded_chunks(pairs):
            self.dispatch_op("swap_out", gpu, cpu[:n])

    def _swap_out(self, gpu, cpu):
        for pool in self.pools:
            pool.swap_pool_out(gpu, cpu)

    def swap_pool_out(self, gpu, cpu):
        """These pages' blocks `gpu` -> the host pool's `cpu`."""
        pages = self._executable(("swap_out", len(gpu)))(self.kv_cache, gpu)
        for shard in pages.addressable_shards:  # each shard's heads go to its own host pool
            self.host_kv[shard.index[2].start or 0][:, :, :, cpu] = np.asarray(shard.data)[:, :, :, :len(cpu)]

    def swap_in(self, pairs: list[tuple[int, int]]):
        """Host pool -> device pages, for (cpu_block, gpu_block) pairs."""
        for cpu, gpu, n in padded_chunks(pairs):
            self.dispatch_op("swap_in", cpu[:n], gpu)

    def _swap_in(self, cpu, gpu):
        for pool in self.pools:
            pool.swap_pool_in(cpu, gpu)

    def swap_pool_in(self, cpu, gpu):
        """The host pool's blocks `cpu` -> these pages' `gpu`."""
        pool = next(iter(self.host_kv.values()))

        def local_pages(index):  # this shard's heads, padded to len(gpu) blocks
            pages = np.zeros(pool.shape[:3] + (len(gpu),) + pool.shape[4:], pool.dtype)
            pages[:, :, :, :len(cpu)] = self.host_kv[index[2].start or 0][:, :, :, cpu]
            return pages

        pages = jax.make_array_from_callback(self._swapped_pages_shape(len(gpu)).shape, self._pages_sharding,
                                             local_pages)
        self.kv_cache = self._executable(("swap_in", len(gpu)))(self.kv_cache, pages, gpu)
