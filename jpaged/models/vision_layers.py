"""Building blocks of the vision encoders (Qwen2-VL's ViT, SigLIP): dense bidirectional attention
over a packed patch sequence, masked per image (or per window), and a scanned stack of encoder
blocks that, unlike the decoders' LayerStack, has no KV cache.

Several images travel as one sequence: each patch carries a segment id (its image, frame or
window) and attends only to patches of its own segment, which is what HF's cu_seqlens does. A
sequence padded to a fixed length (a bucket, so nothing compiles while serving) gives its padding
one more segment of its own: the padding attends to itself and is dropped afterwards.

Weights use their own logical axis names ("vision_*"), which the tensor-parallel rules do not
split: a vision tower is small next to its language model and runs replicated.
"""

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.models.layers import ACTIVATIONS, HFWeights, Linear, WeightTarget, fp32_precision
from jpaged.models.stacked import Unrollable, stack_params


def quick_gelu(x):
    """CLIP's and Qwen2-VL's x * sigmoid(1.702 x)."""
    return x * jax.nn.sigmoid(1.702 * x)


def vision_activation(name: str):
    if name == "quick_gelu":
        return quick_gelu
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported vision activation {name!r}; supported: {sorted(ACTIVATIONS) + ['quick_gelu']}")
    return ACTIVATIONS[name]


def vision_linear(n_in: int, out_shape, *, bias=True, dtype) -> Linear:
    out_shape = tuple(out_shape) if isinstance(out_shape, (tuple, list)) else (out_shape,)
    axes = ("vision_in",) + tuple(f"vision_out{i}" for i in range(len(out_shape)))
    return Linear((n_in,), out_shape, axes, use_bias=bias, dtype=dtype)


# Queries attended at a time in a long packed sequence (bounds the logits' memory: heads x QUERY_CHUNK x N).
QUERY_CHUNK = 1024


def dense_attention(q, k, v, segments, scale: float):
    """Softmax attention of q, k, v [..., N, heads, head_dim], query i seeing key j when
    segments[i] == segments[j] (segments int[N], or None: every key), the softmax in fp32 as HF's
    eager attention does; the output [..., N, heads, head_dim] in q's dtype. A sequence of more than
    QUERY_CHUNK patches (a multiple of it) is attended QUERY_CHUNK queries at a time."""
    n = q.shape[-3]
    if n > QUERY_CHUNK and n % QUERY_CHUNK == 0 and q.ndim == 3:
        chunks = n // QUERY_CHUNK
        qs = q.reshape(chunks, QUERY_CHUNK, *q.shape[1:])
        seg_q = None if segments is None else segments.reshape(chunks, QUERY_CHUNK)

        def one(args):
            q_chunk, s_chunk = args
            return _attend(q_chunk, k, v, None if segments is None else s_chunk[:, None] == segments[None, :], scale)

        return jax.lax.map(one, (qs, seg_q)).reshape(q.shape)
    mask = None if segments is None else segments[:, None] == segments[None, :]
    return _attend(q, k, v, mask, scale)


def banded_attention(q, k, v, segments, block: int, scale: float):
    """`dense_attention` for segments that are contiguous runs of at most `block` patches (Qwen2.5-VL's
    windows, in window order), N a multiple of `block`: the queries of each block of `block` patches
    see only the keys of that block and its two neighbours (any run reaching the block lies there),
    so the work is N x 3 block instead of N^2. Keys past the ends carry segment -2 (no query's)."""
    n, heads, dim = q.shape
    nb = n // block

    def neighbours(a, fill):
        edge = jnp.full((block,) + a.shape[1:], fill, a.dtype)
        blocks = jnp.concatenate([edge, a, edge]).reshape((nb + 2, block) + a.shape[1:])
        return jnp.concatenate([blocks[:-2], blocks[1:-1], blocks[2:]], axis=1)  # [nb, 3 block, ...]

    seg_k = neighbours(segments, -2)
    mask = segments.reshape(nb, block)[:, :, None] == seg_k[:, None, :]
    out = _attend(q.reshape(nb, block, heads, dim), neighbours(k, 0), neighbours(v, 0), mask, scale)
    return out.reshape(n, heads, dim)


def _attend(q, k, v, mask, scale: float):
    precision = fp32_precision(q.dtype)
    logits = jnp.einsum("...qhd,...khd->...hqk", q, k, precision=precision).astype(jnp.float32) * scale
    if mask is not None:
        logits = jnp.where(mask[..., None, :, :], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("...hqk,...khd->...qhd", probs, v, precision=precision)


def rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rotary(x, cos, sin):
    """x [N, heads, head_dim] rotated in fp32 by cos, sin [N, head_dim] (HF's vision rotary)."""
    x32 = x.astype(jnp.float32)
    return (x32 * cos[:, None, :] + rotate_half(x32) * sin[:, None, :]).astype(x.dtype)


class EncoderStack(nnx.Module, Unrollable):
    """`num_layers` encoder blocks whose weights carry a leading "layers" axis, run by one
    `jax.lax.scan` (one block compiled whatever the depth). A block is called as
    block(x, shared, per_layer): `shared` the same for every layer (masks, rotary tables),
    `per_layer` this layer's row of the arrays given stacked over layers (e.g. Qwen2.5-VL's
    full-attention flag). `unroll` (the loader sets it on a GPU, stacked.unroll_layers_on_gpu):
    unrolled, each block's GEMMs read its weights in place instead of a copy per image batch."""

    def __init__(self, make_block: Callable[[], nnx.Module], num_layers: int):
        self.num_layers = num_layers
        self.unroll = False
        self.block = make_block()
        stack_params(self.block, num_layers)

    def __call__(self, x, shared, per_layer=None):
        graphdef, weights = nnx.split(self.block)

        def one_block(x, scanned):
            layer_weights, row = scanned
            return nnx.merge(graphdef, layer_weights)(x, shared, row), None

        x, _ = jax.lax.scan(one_block, x, (weights, per_layer), unroll=self.scan_unroll())
        return x

    def hf_weights(self, prefix: Callable[[int], str]) -> HFWeights:
        specs = {}
        for i in range(self.num_layers):
            for name, targets in self.block.hf_weights(prefix(i)).items():
                specs[name] = [target._replace(layer=i) for target in targets]
        return specs


def conv_as_linear(linear: Linear, name: str, hf_shape: tuple[int, ...]) -> HFWeights:
    """A convolution whose stride equals its kernel (a patch embedding) is a Linear over the
    flattened patch: its weight [out, in, *kernel] read as [in * prod(kernel), out]."""
    out = hf_shape[0]
    specs = {name: [WeightTarget(linear.kernel, hf_shape, lambda a: a.reshape(out, -1).T)]}
    if linear.bias is not None:
        specs[name.removesuffix("weight") + "bias"] = [WeightTarget(linear.bias, (out,), lambda a: a)]
    return specs


def bucket_size(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket holding n items; ValueError past the largest."""
    for b in sorted(buckets):
        if n <= b:
            return b
    raise ValueError(f"{n} patches exceed the largest vision bucket ({max(buckets)})")


def pad_rows(a: np.ndarray, n: int, value=0) -> np.ndarray:
    """a with rows appended (filled with `value`) up to n rows."""
    pad = [(0, n - a.shape[0])] + [(0, 0)] * (a.ndim - 1)
    return np.pad(a, pad, constant_values=value)
