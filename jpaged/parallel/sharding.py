"""Tensor parallelism: the device mesh and the rules that place every array on it.

Megatron-LM-style SPMD (paper §4.6): attention is split by heads, MLPs by columns then rows,
and XLA inserts the all-reduce after each row-parallel projection. Models never mention
devices: every weight carries logical axis names (layers.py) and `LOGICAL_AXIS_RULES` maps
them to the mesh axis `tp`. The KV pages are split on their kv-head axis, so each device
holds its heads' part of every page and one block table serves all shards.
"""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

TP_AXIS = "tp"

# Logical axis name -> mesh axis (None: replicated). Axes not listed are replicated.
LOGICAL_AXIS_RULES = {
    "q_heads": TP_AXIS,   # column-parallel q projection, row-parallel output projection
    "kv_heads": TP_AXIS,  # k/v projections and the KV pages
    "mlp": TP_AXIS,       # column-parallel up/gate, row-parallel down
    "vocab": TP_AXIS,     # vocabulary-parallel embedding and LM head; logits gathered for sampling
    "embed": None,
    "head_dim": None,
    "norm": None,
    "positions": None,
    "layers": None,       # the stacked decoder layers' leading axis (scanned, never split)
}


def make_mesh(tensor_parallel_size: int, devices: list | None = None) -> Mesh:
    """A 1-D mesh of `tensor_parallel_size` devices: `devices` (ids or jax Devices, in mesh order;
    checked by `resolve_devices`), else the first ones. Multi-host: every process runs every step,
    so each contributes the same number of its devices (by default its first ones)."""
    if devices is not None:
        chosen = resolve_devices(devices, tensor_parallel_size)
        # Auto axes: XLA propagates the weights' shardings through the model (GSPMD).
        return Mesh(np.array(chosen), (TP_AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
    devices, processes = jax.devices(), jax.process_count()
    if tensor_parallel_size > len(devices):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} exceeds the {len(devices)} available "
                         f"{devices[0].platform} device(s)")
    if tensor_parallel_size % processes:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} is not a multiple of the {processes} processes")
    per_process = tensor_parallel_size // processes
    by_process = [[d for d in devices if d.process_index == p] for p in range(processes)]
    chosen = [d for local in by_process for d in local[:per_process]]
    if len(chosen) < tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs {per_process} device(s) on each of the "
                         f"{processes} processes; some have fewer")
    return Mesh(np.array(chosen), (TP_AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def resolve_devices(devices: list, tensor_parallel_size: int) -> list:
    """The jax Devices that `devices` names (ids are jax's global device ids, looked up among the
    default backend's devices): tensor_parallel_size of them, distinct, on jax's default
    platform, and with several processes the same number on each. ValueError naming `devices`."""
    available = {d.id: d for d in jax.devices()}

    def refuse(why: str):
        raise ValueError(f"devices={devices!r}: {why}")

    if len(devices) != tensor_parallel_size:
        refuse(f"{len(devices)} device(s) for tensor_parallel_size={tensor_parallel_size}")
    resolved = []
    for device in devices:
        if isinstance(device, int) and not isinstance(device, bool):
            if device not in available:
                refuse(f"no device {device}; jax has {sorted(available)} ({jax.default_backend()})")
            device = available[device]
        elif not isinstance(device, jax.Device):
            refuse(f"{device!r} is neither a device id nor a jax Device")
        resolved.append(device)
    if len({d.id for d in resolved}) != len(resolved):
        refuse("a device is named twice")
    platforms = {d.platform for d in resolved}
    if platforms != {jax.default_backend()}:
        refuse(f"devices on {sorted(platforms)}; the engine runs on jax's default platform, "
               f"{jax.default_backend()!r} (one platform for all)")
    per_process = [sum(d.process_index == p for d in resolved) for p in range(jax.process_count())]
    if len(set(per_process)) != 1:
        refuse(f"every process must hold the same number of them (each runs every step); they hold {per_process}")
    return resolved


def tp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[TP_AXIS]


def kv_head_replicas(num_heads: int, num_kv_heads: int, tp: int) -> int:
    """How many times each kv head is stored so that every shard has whole kv heads: 1 when `tp`
    divides the kv heads; tp / num_kv_heads when tp exceeds them (vLLM replicates them too)."""
    if num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide num_attention_heads={num_heads}")
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide num_key_value_heads={num_kv_heads}")
        return 1
    if tp % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} is neither a divisor nor a multiple of "
                         f"num_key_value_heads={num_kv_heads}")
    return tp // num_kv_heads


def logical_sharding(mesh: Mesh, logical_axes: tuple[str, ...], shape: tuple[int, ...]) -> NamedSharding:
    """The sharding of an array with these logical axes. An axis whose size the mesh axis does not
    divide (e.g. a vocabulary of 259) is replicated instead: correct, just not split. Head axes
    always divide (checked by `kv_head_replicas` when the model is built)."""
    spec = []
    for name, size in zip(logical_axes, shape):
        axis = LOGICAL_AXIS_RULES.get(name)
        spec.append(axis if axis is not None and size % mesh.shape[axis] == 0 else None)
    return NamedSharding(mesh, P(*spec))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """Page arrays [num_kv_heads, num_pages, page_size, head_dim]: split on the kv heads."""
    return NamedSharding(mesh, P(LOGICAL_AXIS_RULES["kv_heads"]))


def put(array, sharding: NamedSharding) -> jax.Array:
    """Place a host array on the mesh: each device receives only its own slice (a jax array
    moves between devices, never through the host, and is copied: the caller keeps its own)."""
    if isinstance(array, jax.Array):
        return jax.device_put(array, sharding, may_alias=False)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])
