"""LoRA slots in the model: each adaptable projection (a `Linear` named q/k/v/o or gate/up/down
by its checkpoint) gets `lora_a` [layers, slots, in..., rank] and `lora_b` [layers, slots, rank,
out...], the scaling folded into B, zeros where a slot's adapter leaves the module alone.

Per token, `Linear` adds x·A[s]·B[s] for the token's slot s (ForwardContext.lora_slots; -1: the
base model): one matmul over every slot's A at once, the other slots' parts masked to zero, then
one over every slot's B (the Punica idea as two dense matmuls of inner size slots x rank, which
XLA runs well while slots x rank stays small). A and B take their base weight's logical axes, so
tensor parallelism splits them as it splits the weight (column-parallel: B's outputs; row-parallel:
A's inputs, XLA adding the partial sums as it does for the weight).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.lora.peft import SUPPORTED_MODULES, PeftAdapter
from jpaged.models.layers import Linear, kernel_path, linears_of
from jpaged.parallel import sharding


@dataclasses.dataclass
class LoRATarget:
    """Where a checkpoint module's adapter goes: `linear`'s (at `path` in the model) LoRA weights
    at `layer` (None: not stacked), its output stored `out_repeats` times (kv heads replicated for
    tensor parallelism)."""

    path: tuple
    linear: Linear
    layer: int | None
    out_repeats: int


def add_lora_slots(model: nnx.Module, mesh, max_loras: int, max_lora_rank: int) -> dict[str, LoRATarget]:
    """Give every adaptable projection of `model` its (zero) LoRA slots; returns the checkpoint
    module names they answer to ("model.layers.3.self_attn.q_proj" -> its target)."""
    linears = linears_of(model)
    targets = {}
    for name, weights in model.hf_weights().items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or module.rsplit(".", 1)[-1] not in SUPPORTED_MODULES or len(weights) != 1:
            continue
        target = weights[0]
        path = kernel_path(target.param, linears)
        if path is None:
            continue
        n_out = math.prod(linears[path].out_shape)
        targets[module] = LoRATarget(path, linears[path], target.layer, n_out // target.hf_shape[0])
    for linear in {t.path: t.linear for t in targets.values()}.values():
        kernel = linear.kernel
        lead = kernel.ndim - len(linear.in_shape) - len(linear.out_shape)  # 1: stacked over layers
        axes = kernel.logical_axes
        in_axes, out_axes = axes[lead:lead + len(linear.in_shape)], axes[lead + len(linear.in_shape):]
        a_shape = kernel.shape[:lead] + (max_loras,) + linear.in_shape + (max_lora_rank,)
        b_shape = kernel.shape[:lead] + (max_loras, max_lora_rank) + linear.out_shape
        for attr, shape, logical in (("lora_a", a_shape, axes[:lead] + ("lora_slots",) + in_axes + ("lora_rank",)),
                                     ("lora_b", b_shape, axes[:lead] + ("lora_slots", "lora_rank") + out_axes)):
            # Made in place on the mesh (never first on the default device, which may be another engine's).
            zeros = jnp.zeros(shape, linear.dtype, device=sharding.logical_sharding(mesh, logical, shape))
            setattr(linear, attr, nnx.Param(zeros, logical_axes=logical))
    return targets


def slot_weights(adapter: PeftAdapter, targets: dict[str, LoRATarget], max_lora_rank: int,
                 dtype) -> dict[tuple, tuple[np.ndarray, np.ndarray]]:
    """One slot's contents for every adaptable Linear the adapter changes (by its nnx path): (A [layers?, in..., R], B
    [layers?, R, out...]), the adapter's rank zero-padded to R; ValueError for a module the
    model does not have or shapes that do not fit it."""
    out = {}
    for module, (a, b) in adapter.weights.items():
        target = targets.get(module)
        if target is None:
            raise ValueError(f"lora_path={adapter.path!r}: the model has no adaptable module {module!r}")
        linear, rank = target.linear, a.shape[0]
        n_in, n_out = math.prod(linear.in_shape), math.prod(linear.out_shape) // target.out_repeats
        if a.shape[1] != n_in or b.shape[0] != n_out:
            raise ValueError(f"lora_path={adapter.path!r}: {module!r} has lora_A {a.shape} and lora_B {b.shape}; "
                             f"the model's module maps {n_in} inputs to {n_out} outputs")
        if target.path not in out:
            kernel = linear.kernel
            lead = kernel.shape[:kernel.ndim - len(linear.in_shape) - len(linear.out_shape)]
            out[target.path] = (np.zeros(lead + linear.in_shape + (max_lora_rank,), dtype),
                               np.zeros(lead + (max_lora_rank,) + linear.out_shape, dtype))
        slot_a, slot_b = out[target.path]
        index = () if target.layer is None else (target.layer,)
        hf_out = (linear.out_shape[0] // target.out_repeats,) + linear.out_shape[1:]
        b_out = b.T.reshape((rank,) + hf_out)
        if target.out_repeats > 1:
            b_out = np.repeat(b_out, target.out_repeats, axis=1)
        slot_a[index + (Ellipsis, slice(0, rank))] = a.T.reshape(linear.in_shape + (rank,))
        slot_b[index + (slice(0, rank),)] = b_out
    return out


def abstract_slot(linears, sharding) -> list:
    """One slot's contents for each of `linears` as shapes: (A, B) without the slot axis."""
    def without_slot(param, lead):
        return jax.ShapeDtypeStruct(param.shape[:lead] + param.shape[lead + 1:], param.dtype, sharding=sharding)

    out = []
    for linear in linears:
        lead = linear.kernel.ndim - len(linear.in_shape) - len(linear.out_shape)
        out.append((without_slot(linear.lora_a, lead), without_slot(linear.lora_b, lead)))
    return out
