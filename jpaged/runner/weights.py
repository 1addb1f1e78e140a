"""The runner's weights and KV pool outside serving: new weights from memory (RL), sleep and wake.

`load_weights` takes Hugging Face-named tensors (numpy, torch on the CPU, or jax arrays, which
stay on the devices), checks every name, shape and dtype before anything changes, and writes them
into the runner's state with the loader's own conversions (models' weight mappings, tensor
parallel placement, on-the-fly quantization), each stacked layer's slice in place. Shapes,
dtypes and shardings stay what the compiled steps were built for, so nothing recompiles.

`sleep(1)` copies the weights to host memory and frees them and the KV pool on the devices;
`sleep(2)` frees them without a copy (load_weights or the checkpoint brings them back);
`wake_up` puts them back and allocates a zeroed pool.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.models.layers import kernel_path, linears_of
from jpaged.models.loader import check_finite, place


def as_array(name: str, tensor):
    """numpy or jax as they are; a torch tensor (on the CPU) as numpy, bf16 through float32."""
    if isinstance(tensor, (np.ndarray, jax.Array)):
        return tensor
    if type(tensor).__module__.startswith("torch"):
        import torch

        if tensor.device.type != "cpu":
            raise ValueError(f"load_weights: {name!r} is a torch tensor on {tensor.device}; pass CPU tensors")
        tensor = tensor.detach()
        return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()
    raise ValueError(f"load_weights: {name!r} is a {type(tensor).__name__}; expected a numpy, torch or jax array")


def check_weights(model: nnx.Module, weights, require_all: bool = False) -> list:
    """[(name, array)] of `weights` (a dict or (name, array) pairs), every name, shape and dtype
    checked against the model's checkpoint layout; ValueError naming the first bad one."""
    specs = model.hf_weights()
    items = list(weights.items() if isinstance(weights, dict) else weights)
    if not items:
        raise ValueError("load_weights: no tensors given")
    seen, checked = set(), []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(f"load_weights: expected (name, array) pairs, got {type(item).__name__}")
        name, tensor = item[0], as_array(*item)
        if rename := getattr(model, "rename_hf_weight", None):  # (a multimodal checkpoint's name variants)
            name = rename(name)
        if name not in specs:
            close = [n for n in specs if n.rsplit(".", 2)[-2:] == name.rsplit(".", 2)[-2:]][:1]
            raise ValueError(f"load_weights: the model has no tensor {name!r}"
                             + (f" (did you mean {close[0]!r}?)" if close else ""))
        if name in seen:
            raise ValueError(f"load_weights: {name!r} is given twice")
        expected = specs[name][0].hf_shape
        if tuple(tensor.shape) != expected:
            raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
        if not jnp.issubdtype(tensor.dtype, jnp.floating):
            raise ValueError(f"load_weights: {name!r} has dtype {tensor.dtype}; expected a floating-point array")
        seen.add(name)
        checked.append((name, tensor))
    try:
        check_finite(checked)
    except ValueError as e:
        raise ValueError(f"load_weights: {e}") from None
    if require_all and (missing := [n for n in specs if n not in seen]):
        raise ValueError(f"load_weights: the weights were dropped (sleep level 2): every tensor is needed; "
                         f"{len(missing)} missing, e.g. {missing[0]!r}")
    return checked


def write_weights(runner, checked: list, dtype, mesh):
    """Write checked (name, array) pairs into the runner's state."""
    model = nnx.merge(runner.graphdef, runner.state)
    specs = model.hf_weights()
    quantized = {path: node for path, node in linears_of(model).items() if node.kernel_scale is not None}
    for name, tensor in checked:
        for target in specs[name]:
            place(target, tensor, quantized.get(kernel_path(target.param, quantized)), dtype, mesh)
    runner.state = nnx.split(model)[1]
    if getattr(runner, "mm", None) is not None:  # images encoded with the old weights: encoded again
        runner.mm.reset()


def free(tree):
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


def model_of(runner) -> nnx.Module:
    """The runner's model (shapes only while its weights are dropped), for its checkpoint layout."""
    return nnx.merge(runner.graphdef, runner.state if runner.state is not None else runner.slept.avals)


class Slept:
    """What sleep keeps to wake up with: the weights' shapes and shardings, their host copy
    (level 1), the KV pool's fp8 scales."""

    def __init__(self, runner, level: int):
        self.level = level
        self.avals = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), runner.state)
        self.host_state = jax.device_get(runner.state) if level == 1 else None
        cache = runner.kv_cache
        self.kv_sharding = cache.k_pages.sharding
        self.kv_scales = None if cache.k_scale is None else (np.asarray(cache.k_scale), np.asarray(cache.v_scale))
        self.scales_pending = cache.scales_pending is not None and bool(np.asarray(cache.scales_pending))


def sleep(runner, level: int):
    runner.slept = Slept(runner, level)
    if getattr(runner, "mm", None) is not None and level > 1:  # (the encoder cache goes with the weights)
        runner.mm.reset()
    free(runner.kv_cache)
    free(runner.state)
    runner.kv_cache = runner.state = None


def restore_weights(runner, state=None):
    """Weights on the devices again: `state` (read from the checkpoint), else the host copy, else
    zeros (level 2; load_weights fills them)."""
    slept = runner.slept
    if state is None and slept.host_state is not None:
        state = jax.tree.map(lambda host, aval: jax.device_put(host, aval.sharding), slept.host_state, slept.avals)
    elif state is None:
        state = jax.tree.map(lambda aval: jnp.zeros(aval.shape, aval.dtype, device=aval.sharding), slept.avals)
    runner.state, slept.host_state = state, None


def check_like_slept(runner, state):
    """`state` (the checkpoint read again) has the shapes and dtypes the weights had when they
    were dropped, which the compiled steps were built for; ValueError otherwise."""
    avals = runner.slept.avals
    if jax.tree.structure(state) != jax.tree.structure(avals):
        raise ValueError("the checkpoint no longer has the model's structure (was it replaced by another model?)")
    for (path, new), old in zip(jax.tree.leaves_with_path(state), jax.tree.leaves(avals)):
        if (new.shape, new.dtype) != (old.shape, old.dtype):
            raise ValueError(f"the checkpoint's {jax.tree_util.keystr(path)} is {new.dtype}{list(new.shape)}; "
                             f"the model was started with {old.dtype}{list(old.shape)}")


def wake_up(runner, state=None):
    if state is not None:
        check_like_slept(runner, state)
    if runner.state is None:
        restore_weights(runner, state)
    slept = runner.slept
    runner.kv_cache = runner.kv_cache_spec.allocate(runner.num_gpu_blocks, slept.kv_sharding, slept.kv_scales,
                                                    slept.scales_pending)
    runner.slept = None
