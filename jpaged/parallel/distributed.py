"""Multi-host serving with jax.distributed: one process per host, all running the same jitted steps.

Process 0 (the driver) runs the scheduler and block manager; before each device operation it
broadcasts the operation's host inputs, and the other processes (followers) run the same
operation on their devices (SPMD). The transport is `broadcast_object`: pickled bytes summed over
the processes by one precompiled collective (process 0's bytes plus the others' zeros), so no
channel besides jax.distributed's own is needed.

Devices: `EngineConfig.devices` holds jax's global device ids, the same list on every process
(the same command runs everywhere); each process must hold the same number of them
(`sharding.resolve_devices`), and the mesh spans them in the order given (default: each process's
first tensor_parallel_size / processes devices). Process-wide whatever the engine's devices:
jax.distributed is joined once per process, and the broadcast collective spans every device of
every process (one BROADCAST_CHUNK buffer each). Each process follows one engine
(`ModelRunner.lead` / `follow`): one engine per process on several hosts.
"""

import functools
import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """Join the distributed job if one is configured: by the arguments, else by the environment
    (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID; jax itself fills what is missing
    on SLURM, Open MPI and Kubernetes). Must run before anything touches a device."""
    coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num_processes = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
    if coordinator_address is None and (num_processes or 1) == 1:
        return  # a single process
    if jax.distributed.is_initialized():
        return
    jax.distributed.initialize(coordinator_address, num_processes, process_id)


def is_driver() -> bool:
    return jax.process_index() == 0


# Bytes per broadcast collective. One fixed shape means one executable, compiled at start-up
# (ModelRunner counts it), whatever the messages' sizes; longer messages take several.
BROADCAST_CHUNK = 1 << 17
_LENGTH_BYTES = 8  # a message starts with its length


@functools.cache
def broadcast_executable():
    """The collective under `broadcast_object`: every process gives one chunk (zeros, but for
    process 0's), summed over the processes. Returns (compiled executable, input sharding)."""
    devices = np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
    mesh = jax.sharding.Mesh(devices, ("processes", "local"))
    rows = NamedSharding(mesh, PartitionSpec("processes"))
    total = jax.jit(lambda chunks: jnp.sum(chunks, axis=0, dtype=jnp.uint8),
                    out_shardings=NamedSharding(mesh, PartitionSpec()))
    chunks = jax.ShapeDtypeStruct((jax.process_count(), BROADCAST_CHUNK), jnp.uint8, sharding=rows)
    return total.lower(chunks).compile(), rows


def _broadcast_chunk(message: bytes, start: int) -> np.ndarray:
    executable, rows = broadcast_executable()
    chunk = np.zeros((1, BROADCAST_CHUNK), np.uint8)
    piece = message[start:start + BROADCAST_CHUNK]
    chunk[0, :len(piece)] = np.frombuffer(piece, np.uint8)
    total = executable(multihost_utils.host_local_array_to_global_array(chunk, rows.mesh, rows.spec))
    return np.asarray(total.addressable_data(0))


def broadcast_object(obj=None):
    """Process 0's `obj` on every process (the others pass anything, e.g. None)."""
    if jax.process_count() == 1:
        return obj
    message = b""  # the followers' chunks are zeros
    if is_driver():
        data = pickle.dumps(obj)
        message = len(data).to_bytes(_LENGTH_BYTES, "little") + data
    chunks = [_broadcast_chunk(message, 0)]
    size = int.from_bytes(chunks[0][:_LENGTH_BYTES].tobytes(), "little")
    for start in range(BROADCAST_CHUNK, _LENGTH_BYTES + size, BROADCAST_CHUNK):
        chunks.append(_broadcast_chunk(message, start))
    return pickle.loads(np.concatenate(chunks)[_LENGTH_BYTES:_LENGTH_BYTES + size].tobytes())


def min_across_processes(value: int) -> int:
    """The smallest of every process's `value` (sizes that must agree, such as the KV pool's)."""
    if jax.process_count() == 1:
        return value
    return int(np.min(multihost_utils.process_allgather(np.int32(value))))


class DriverOps:
    """A runner's device operations in a multi-host job (ModelRunner's base): the driver sends
    each one's name and host inputs to the other processes before running it (`dispatch_op`),
    and they run the same in `follow` until the driver's `lead` ends. Subclasses set `is_driver`
    and `_multihost` and run an operation by name in `_run_op(op, args)`."""

    def dispatch_op(self, op: str, *args):
        """Run device operation `op` on host inputs `args`; in a multi-host job the driver first
        sends it to the other processes, which run it in `follow`."""
        if self._multihost:
            broadcast_object((op, args))
        return self._run_op(op, args)

    def follow(self):
        """On a process other than 0: run the driver's device operations until its `lead` ends,
        then return the driver's result (or raise its error)."""
        while True:
            op, args = broadcast_object()
            if op == "done":
                result, error = args
                if error is not None:
                    raise error
                return result
            self._run_op(op, args)

    def lead(self, drive):
        """Run `drive()` (anything that steps the engine: a generate call, a server) on process 0
        while the other processes follow; every process returns its result. One process: drive()."""
        if not self._multihost:
            return drive()
        if not self.is_driver:
            return self.follow()
        try:
            result = drive()
        except BaseException as e:  # the followers stop too, also on Ctrl-C
            broadcast_object(("done", (None, e)))
            raise
        broadcast_object(("done", (result, None)))
        return result
