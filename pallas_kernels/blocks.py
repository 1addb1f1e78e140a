"""Building blocks shared by the decode and prefill Pallas kernels.

Both kernels hold a block of query rows [R, dp] in registers and walk a
sequence's block table `pages_per_iter` pages (~KEYS_PER_ITER keys) at a time:
one vector load gathers the pages of K and of V, then one online-softmax step
updates (out, max, sumexp) in fp32.
"""

import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.targets import e4m3_as_bits

# jax >= 0.11 deprecates Pallas' Triton backend with a warning at every compile. The engine's start-up
# log says it once, with which backend runs and why (pallas_kernels.backend_reason).
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

MASK_VALUE = -1e30  # finite: a fully masked block never computes inf - inf
KEYS_PER_ITER = 64
NO_WINDOW = 1 << 30  # the window of full attention: longer than any context, far from int32 overflow


def init_carry(rows, dp):
    return (
        jnp.zeros((rows, dp), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def normalize(out, l):
    """Final out / sumexp; rows that saw no key (l == 0) stay zero."""
    return out / jnp.where(l > 0, l, 1.0)[:, None]


def attend_block(carry, q, k, v, key_live, scale, row_ok=None, soft_cap=None, v_transposed=False, mask_v=True):
    """One online-softmax step. q [R, dp], k/v [B, dp] (v [dp, B] when `v_transposed`: the
    transposed V pages' block, load_pages_transposed); key_live bool [B] marks real keys, row_ok
    bool [R, B] (optional) a per-row (causal) mask; soft_cap c (optional) maps scores to
    c * tanh(score / c). mask_v=False: every slot of v holds a written key (no select on v)."""
    out, m, l = carry
    prec = lax.Precision.HIGHEST  # IEEE fp32 instead of TF32; no-op for bf16
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32, precision=prec) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    ok = key_live[None, :] if row_ok is None else key_live[None, :] & row_ok
    s = jnp.where(ok, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    # Unused slots may hold anything (even NaN): keep them out of p @ v.
    if v_transposed:  # p @ v.T: v's keys are its minor (contiguous) dimension, a K-major operand
        v = jnp.where(key_live[None, :], v, jnp.zeros_like(v)) if mask_v else v
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                             precision=prec)
    else:
        v = jnp.where(key_live[:, None], v, jnp.zeros_like(v)) if mask_v else v
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=prec)
    return out * alpha[:, None] + pv, m_new, l * alpha + jnp.sum(p, axis=1)


def fp8_compute_dtype(q_dtype, page_dtype):
    """The dtype the kernels widen fp8 pages to and run their dots in: f16 for bf16 queries (sm_89+
    converts two fp8 values to f16 in one instruction, while bf16 costs two more per value through
    f16 or f32; fp8 values are exact in f16, and f16 keeps 3 more mantissa bits of q and p), else
    q's dtype."""
    if jnp.dtype(page_dtype).itemsize == 1 and jnp.dtype(q_dtype) == jnp.bfloat16:
        return jnp.float16
    return jnp.dtype(q_dtype)


def to_f16_range(q):
    """q as f16 over a power of two: (q / 2**k in f16, 2**k as f32[1]), k >= 0 the least that keeps
    |q| / 2**k below 2**15 (f16's largest is 65504). Exact for bf16 q (8 mantissa bits fit f16's 11)
    wherever q / 2**k stays above f16's smallest normal; k = 0 unless some |q| >= 32768."""
    amax = jnp.max(jnp.abs(q.astype(jnp.float32)))
    _, exponent = jnp.frexp(amax)  # amax < 2**exponent
    factor = jnp.ldexp(jnp.float32(1), jnp.maximum(exponent - 15, 0))
    return (q.astype(jnp.float32) / factor).astype(jnp.float16), factor.reshape(1)


def pages_for_triton(pages, as_bits=None):
    """float8_e4m3fn pages as their bytes (uint8, a free bitcast) where Triton cannot convert e4m3
    (below sm_89: `as_bits` None asks the target GPU); load_pages widens them by arithmetic."""
    if pages.dtype != jnp.float8_e4m3fn or not (e4m3_as_bits() if as_bits is None else as_bits):
        return pages
    return lax.bitcast_convert_type(pages, jnp.uint8)


def widen_e4m3(bits, dtype):
    """float8_e4m3fn bytes (any integer dtype) -> `dtype`, exactly, by integer arithmetic and an f32
    bitcast: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, 0x7f/0xff are NaN."""
    x = bits.astype(jnp.int32) & 0xFF
    exponent, mantissa = (x >> 3) & 0xF, x & 0x7
    sign = (x >> 7) << 31
    normal = lax.bitcast_convert_type(sign | ((exponent + 120) << 23) | (mantissa << 20), jnp.float32)
    subnormal = mantissa.astype(jnp.float32) * (2.0 ** -9)  # exponent 0: m/8 * 2^-6
    subnormal = jnp.where(sign != 0, -subnormal, subnormal)
    value = jnp.where(exponent == 0, subnormal, normal)
    return jnp.where((x & 0x7F) == 0x7F, jnp.nan, value).astype(dtype)


def _widen(x, dtype):
    return widen_e4m3(x, dtype) if x.dtype == jnp.uint8 else x.astype(dtype)


def load_pages(pages_ref, page_ids, head_dim, dtype):
    """Gather pages [n] -> [n * page_size, dp] in `dtype` (fp8 pages widened in registers; uint8
    ones are e4m3 bytes: pages_for_triton), zero past head_dim."""
    n = page_ids.shape[0]
    _, page_size, dp = pages_ref.shape
    if head_dim == dp:
        x = _widen(pages_ref[page_ids], dtype)
    else:  # all-array indices: the form masked loads support in interpret mode
        idx = (page_ids[:, None, None], jnp.arange(page_size)[None, :, None], jnp.arange(dp)[None, None, :])
        mask = idx[2] < head_dim
        if jnp.dtype(pages_ref.dtype).itemsize == 1:  # fp8: Triton has no integer fill to splat into fp8
            x = jnp.where(mask, _widen(plgpu.load(pages_ref.at[idx], mask=mask), dtype), jnp.zeros((), dtype))
        else:
            x = plgpu.load(pages_ref.at[idx], mask=mask, other=0).astype(dtype)
    return x.reshape(n * page_size, dp)


def load_pages_transposed(pages_ref, page_ids, head_dim, dtype):
    """Gather transposed pages [n] (pages_ref [num_pages, dp, page_size]: V stored [head_dim,
    page_size] per page) -> [dp, n * page_size] in `dtype`, keys minor, zero past head_dim. One
    pointer tensor [dp, n, page_size] whose minor dimension is a page's contiguous keys (16 bytes of
    an fp8 page of 16), so the loads stay vectorized and p @ V's operand arrives K-major."""
    n = page_ids.shape[0]
    _, dp, page_size = pages_ref.shape
    idx = (page_ids[None, :, None], jnp.arange(dp)[:, None, None], jnp.arange(page_size)[None, None, :])
    if head_dim == dp:
        x = _widen(plgpu.load(pages_ref.at[idx]), dtype)
    else:
        mask = idx[1] < head_dim
        x = jnp.where(mask, _widen(plgpu.load(pages_ref.at[idx], mask=mask), dtype), jnp.zeros((), dtype))
    return x.reshape(dp, n * page_size)
