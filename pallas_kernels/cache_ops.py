"""KV cache updates: write new tokens' K/V, copy whole pages.

Both are one fused XLA scatter on every backend. A Pallas version would only
re-implement a scatter that XLA already emits as a single in-place kernel when
the page arrays are donated (callers jit with donate_argnums); there is no
reduction or reuse a custom kernel could exploit.

Layout: k_pages, v_pages [num_kv_heads, num_pages, page_size, head_dim];
slot = page * page_size + offset. With `v_transposed` (a variant layout, for fp8 pages: issue 66)
v_pages are [num_kv_heads, num_pages, head_dim, page_size], a page's keys contiguous per
dimension, as FlashAttention-3 stores fp8 V: p @ V's operand is then K-major, which fp8 wgmma
and 8-bit ldmatrix need. copy_blocks moves whole pages and takes either layout.
"""

import functools

import jax
import jax.numpy as jnp


FP8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)
RAW_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def as_dtype(pages, kv_dtype):
    """Pages as `kv_dtype` values: a free reinterpretation when they hold its raw bits (see
    write_kv's `kv_dtype`); unchanged when kv_dtype is None or already theirs."""
    if kv_dtype is None or pages.dtype == jnp.dtype(kv_dtype):
        return pages
    return jax.lax.bitcast_convert_type(pages, kv_dtype)


def quantize(x, dtype, scale):
    """x / scale in fp8 `dtype`, saturated at its largest finite value (e4m3fn has no infinity:
    an overflow would be NaN)."""
    largest = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -largest, largest).astype(dtype)


def transpose_v_pages(v_pages):
    """V pages from one layout to the other ([.., page_size, head_dim] <-> [.., head_dim, page_size])."""
    return jnp.swapaxes(v_pages, -1, -2)


@functools.partial(jax.jit, static_argnames=("kv_dtype", "v_transposed"))
def write_kv(k_pages, v_pages, k, v, slot_mapping, k_scale=None, v_scale=None, kv_dtype=None, v_transposed=False):
    """Store k, v [T, num_kv_heads, head_dim] at slots int32[T].

    Negative slots (padding, -1) and slots >= num_pages * page_size are
    dropped: those tokens leave the pages untouched. With duplicate slots one
    of the writes wins (unspecified which). fp8 pages store k / k_scale and
    v / v_scale (f32 scalars), saturated; readers multiply back.

    `kv_dtype`: the pages hold the raw bits (RAW_BITS of its width) of this dtype. XLA's CPU
    backend has no bf16, fp16 or fp8 scatter: it would convert the whole pool to a wider type and
    back around every write (per layer and step: 1.7 s per token with an fp8 pool of 8,192
    blocks), while an integer scatter stays in place. GPUs scatter every dtype natively.
    """
    num_pages, page_size = k_pages.shape[1:3]
    # Index (page, offset) in the 4-D layout: scattering into a flattened
    # [kvh, slots, d] view makes XLA copy the whole pool when the same step
    # then reads the pages (measured: 0.14 s per step for 1 GiB on CPU).
    slots = jnp.where(slot_mapping < 0, num_pages * page_size, slot_mapping)
    pages_idx, offsets = slots // page_size, slots % page_size

    def scatter(pages, new, scale, transposed=False):
        dtype = jnp.dtype(kv_dtype or pages.dtype)
        new = quantize(new, dtype, 1.0 if scale is None else scale) if dtype in FP8 else new.astype(dtype)
        if new.dtype != pages.dtype:  # raw bits
            new = jax.lax.bitcast_convert_type(new, pages.dtype)
        if transposed:  # the slice between the index arrays puts their [T] first: the update is [T, kvh, d]
            return pages.at[:, pages_idx, :, offsets].set(new, mode="drop")
        return pages.at[:, pages_idx, offsets].set(jnp.swapaxes(new, 0, 1), mode="drop")  # [kvh, T, d]

    return scatter(k_pages, k, k_scale), scatter(v_pages, v, v_scale, v_transposed)


@jax.jit
def copy_blocks(k_pages, v_pages, src, dst):
    """Copy page src[i] -> dst[i] (all kv heads) for every i, in one call.

    Pairs with src < 0 (padding) or an out-of-range src/dst are skipped. All
    copies read the pages as they were before the call (copy-on-write never
    chains copies within one step).
    """
    num_pages = k_pages.shape[1]
    ok = (src >= 0) & (src < num_pages) & (dst >= 0) & (dst < num_pages)
    src = jnp.clip(src, 0, num_pages - 1)
    dst = jnp.where(ok, dst, num_pages)

    def copy(pages):
        return pages.at[:, dst].set(pages[:, src], mode="drop")

    return copy(k_pages), copy(v_pages)
