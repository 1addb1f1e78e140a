"""Quantized Linear weights: how one is stored, and how a checkpoint's tensor becomes it.

A quantized `Linear` keeps its kernel's layout (in_shape + out_shape, stacked over layers) in 8
or 4 bits, with `kernel_scale` (and `kernel_zero` for asymmetric schemes) of the same rank, each
dimension dividing the kernel's: W = (kernel - zero) * scale broadcast over tiles (qwix's QArray).
4-bit values are stored two per byte (uint8, the low nibble first) along the kernel's last axis
and bitcast back to int4 inside the step: real 4-bit storage on every backend, without relying on
how each lays out a jnp.int4 array. Per output channel, the scale has 1 on every input axis; with groups of G input columns, the
input axes are tiled so each tile holds G consecutive columns (o_proj's [heads, head_dim] input
with G = 2 * head_dim: scale [heads / 2, 1, ...]). Scale and zero take the kernel's logical axes,
so tensor parallelism splits them with it.

Checkpoint readers (formats.py) hand over `QuantizedTensor`s in Hugging Face's [out, in] layout;
each `WeightTarget.convert` (transpose, head reshape, kv-head repeats, fused rows) applies to the
values as to a float weight, and to the scales expanded to [out, in], which are then read back
one per tile. So every model's own weight mapping serves its quantized checkpoints unchanged.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jpaged.models.layers import Linear, kernel_path, linears_of

QTYPES = {"float8_e4m3fn": 448.0, "int8": 127.0, "int4": 7.0}
BITS = {"float8_e4m3fn": 8, "int8": 8, "int4": 4}


@dataclasses.dataclass(frozen=True)
class WeightScheme:
    """qtype: the stored values' type; group_size: input columns per scale (None: one scale per
    output channel); zero_point: asymmetric (a zero per scale); activations: the type the
    checkpoint rounds each token's inputs to (dynamic per-token scales, W8A8), or None (W8A16)."""

    qtype: str
    group_size: int | None = None
    zero_point: bool = False
    activations: str | None = None

    def describe(self) -> str:
        parts = [self.qtype, f"groups of {self.group_size}" if self.group_size else "per channel"]
        return " ".join(parts + (["asymmetric"] if self.zero_point else [])
                        + ([f"inputs {self.activations} per token"] if self.activations else []))


@dataclasses.dataclass
class QuantizedTensor:
    """A checkpoint's quantized [out, in] weight: `values` int8 (4-bit values in int8) or fp8,
    `scale` [out, groups] float32, `zero` [out, groups] int8 or None."""

    values: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None = None
    scale_name: str = "weight_scale"  # the scale's tensor in the checkpoint, for errors

    @property
    def shape(self):
        return self.values.shape


def check_scales(name: str, scale, reach: float, dtype) -> None:
    """Scales (weight or KV cache) must be finite and > 0, and `reach` (the largest magnitude a
    stored value times its scale stands for) times the largest scale must be finite in `dtype`, the
    dtype the model computes in (3e38 is refused: 448 * 3e38 overflows float32), and the smallest
    must not round to 0 in it; ValueError naming tensor `name` and its first bad value otherwise."""
    scale = np.asarray(scale, np.float32)
    limit = float(jnp.finfo(dtype).max) / reach
    tiny = float(jnp.finfo(dtype).smallest_subnormal)
    checks = (("not finite", ~np.isfinite(scale)), ("not > 0", ~(scale > 0)),
              (f"larger than {limit:.3g} (x {reach:g} overflows {jnp.dtype(dtype).name})", scale > limit),
              (f"rounds to 0 in {jnp.dtype(dtype).name}", scale < tiny / 2))
    for problem, bad in checks:
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"tensor {name!r} has scale {float(scale[where])!r} at {where}: {problem}; scales "
                             "must be finite and > 0")


def reach(scheme: WeightScheme) -> float:
    """The largest |value - zero| a stored weight of `scheme` can take."""
    if scheme.qtype == "float8_e4m3fn":
        return QTYPES[scheme.qtype]
    bound = 1 << (BITS[scheme.qtype] - 1)  # int: [-bound, bound - 1]
    return 2 * bound - 1 if scheme.zero_point else bound


def tile_scale_shape(in_shape: tuple[int, ...], group_size: int | None) -> tuple[int, ...]:
    """The scale's input axes for groups of `group_size` consecutive (flattened) input columns."""
    if group_size is None:
        return (1,) * len(in_shape)
    n_in = math.prod(in_shape)
    if group_size <= 0 or n_in % group_size:
        raise ValueError(f"group_size={group_size} does not divide the {n_in} input columns of a layer")
    out, remaining = [], group_size
    for dim in reversed(in_shape):  # the innermost axes take the group first
        if remaining >= dim:
            if remaining % dim:
                raise ValueError(f"group_size={group_size} does not tile an input of shape {in_shape}")
            out.append(1)
            remaining //= dim
        else:
            if dim % remaining:
                raise ValueError(f"group_size={group_size} does not tile an input of shape {in_shape}")
            out.append(dim // remaining)
            remaining = 1
    return tuple(reversed(out))


def quantize_linear(linear: Linear, scheme: WeightScheme):
    """Turn an abstract (not yet loaded) Linear into a quantized one of `scheme`."""
    kernel = linear.kernel
    lead = kernel.ndim - len(linear.in_shape) - len(linear.out_shape)  # 1 when stacked over layers
    scale_shape = kernel.shape[:lead] + tile_scale_shape(linear.in_shape, scheme.group_size) + linear.out_shape
    if scheme.qtype == "int4":
        if kernel.shape[-1] % 2:
            raise ValueError(f"4-bit weights pack two values per byte along the last axis; {kernel.shape} is odd")
        kernel.set_value(jax.ShapeDtypeStruct(kernel.shape[:-1] + (kernel.shape[-1] // 2,), jnp.uint8))
    else:
        kernel.set_value(jax.ShapeDtypeStruct(kernel.shape, jnp.dtype(scheme.qtype)))
    linear.kernel_scale = nnx.Param(jax.ShapeDtypeStruct(scale_shape, linear.dtype), logical_axes=kernel.logical_axes)
    if scheme.zero_point:
        linear.kernel_zero = nnx.Param(jax.ShapeDtypeStruct(scale_shape, jnp.int8), logical_axes=kernel.logical_axes)
    linear.scheme = scheme


def quantize_values(w: np.ndarray, n_in: int, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel quantization of a kernel-layout weight (its first `n_in` axes
    are inputs): (values, scale), the scale of shape [1]*n_in + out, absmax mapped to the type's
    largest value (vLLM's fp8 and int8 on-the-fly schemes)."""
    w = np.asarray(w, np.float32)
    absmax = np.max(np.abs(w), axis=tuple(range(n_in)), keepdims=True)
    scale = np.where(absmax > 0, absmax / QTYPES[qtype], 1.0).astype(np.float32)
    scaled = w / scale
    if qtype == "float8_e4m3fn":
        return np.clip(scaled, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn), scale
    return np.clip(np.rint(scaled), -QTYPES[qtype], QTYPES[qtype]).astype(np.int8), scale


def layout(linear: Linear, target, tensor) -> list[tuple[nnx.Param, np.ndarray]]:
    """(param, value) pairs filling `linear`'s quantized weights from one checkpoint tensor for
    `target` (a WeightTarget of its kernel): a float tensor is quantized here (on the fly), a
    QuantizedTensor is laid out as it is."""
    scheme, n_in = linear.scheme, len(linear.in_shape)
    scale_shape = linear.kernel_scale.shape[linear.kernel.ndim - n_in - len(linear.out_shape):]
    if not isinstance(tensor, QuantizedTensor):  # a float tensor: quantized here, per output channel
        if scheme.group_size or scheme.zero_point or scheme.qtype == "int4":
            raise ValueError(f"float weights cannot be written into {scheme.describe()} weights; jpaged "
                             "quantizes float tensors per output channel in 8 bits (fp8, int8)")
        values, scale = quantize_values(target.convert(np.asarray(tensor, np.float32)), n_in, scheme.qtype)
        return [(linear.kernel, values), (linear.kernel_scale, scale.astype(linear.dtype))]

    def per_tile(per_group: np.ndarray, dtype) -> np.ndarray:
        """[out, groups] -> the scale's layout: expanded to [out, in], converted as the weight is,
        then one value per tile."""
        full = np.asarray(target.convert(np.repeat(per_group.astype(np.float32), tensor.shape[1] // per_group.shape[1],
                                                   axis=1)))
        tiles = tuple(k // s for k, s in zip(full.shape, scale_shape))
        return full[tuple(slice(None, None, t) for t in tiles)].astype(dtype)

    check_scales(tensor.scale_name, tensor.scale, reach(scheme), linear.dtype)
    if tensor.zero is not None:
        bound = 1 << (BITS[scheme.qtype] - 1)
        if (bad := (tensor.zero < -bound) | (tensor.zero >= bound)).any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"the checkpoint's quantized {tensor.scale_name.rpartition('.')[0]!r} has zero point "
                             f"{int(tensor.zero[where])} at {where}, outside [{-bound}, {bound - 1}]")
    values = np.asarray(target.convert(tensor.values))
    out = [(linear.kernel, pack_int4(values) if scheme.qtype == "int4" else values),
           (linear.kernel_scale, per_tile(tensor.scale, linear.dtype))]
    if scheme.zero_point:
        out.append((linear.kernel_zero, per_tile(tensor.zero, np.int8)))
    return out


def pack_int4(values: np.ndarray) -> np.ndarray:
    """int8 values in [-8, 7] -> uint8, two per byte along the last axis, the first in the low nibble
    (Linear bitcasts them back to int4)."""
    nibbles = values.astype(np.uint8) & 0xF
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def array_device_bytes(array: jax.Array) -> int:
    """Bytes of `array` on this process's devices, summed (a replicated array counts on each). From
    the sharding: reading addressable_shards would make a jax.Array per shard, which
    jax.live_arrays() then counts twice."""
    shard = math.prod(array.sharding.shard_shape(array.shape)) * array.dtype.itemsize
    return shard * len(array.sharding.addressable_devices)


def device_bytes(tree) -> int:
    """Bytes of a pytree's (not deleted) jax arrays on the devices."""
    return sum(array_device_bytes(x) for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) and not x.is_deleted())


def model_memory_bytes(model: nnx.Module) -> int:
    """The weights' bytes on the devices, summed over devices (replicated weights count on each)."""
    return device_bytes(nnx.state(model, nnx.Param))


def quantize_model(model: nnx.Module, quantization) -> tuple[dict[tuple, Linear], dict[str, WeightScheme]]:
    """Quantize the abstract model's Linear layers as `quantization` (formats.Quantization) says,
    by their checkpoint module names. Returns the quantized Linears by their nnx path and the
    schemes of the modules whose tensors the checkpoint reader must assemble, by name."""
    linears = linears_of(model)
    chosen, modules = {}, {}  # chosen: path -> (scheme, the first module naming it, its Linear)
    for name, targets in model.hf_weights().items():
        module, _, leaf = name.rpartition(".")
        for target in targets if leaf == "weight" else ():
            path = kernel_path(target.param, linears)
            if path is None:
                continue
            scheme = quantization.scheme_for(module)
            first = chosen.setdefault(path, (scheme, module, linears[path]))
            if first[0] != scheme:
                raise ValueError(f"the checkpoint quantizes {module!r} as {scheme} but {first[1]!r} as {first[0]}: "
                                 "jpaged stacks the layers, so a projection must be quantized alike in every layer")
            if scheme is not None:
                modules[module] = scheme
    for scheme, _, linear in chosen.values():
        if scheme is not None:
            quantize_linear(linear, scheme)
    return {path: linear for path, (scheme, _, linear) in chosen.items() if scheme is not None}, modules
