"""Multi-host serving with jax.distributed: one process per host, all running the same jitted steps.

Process 0 (the driver) runs the scheduler and block manager; before each device operation it
broadcasts the operation's host inputs, and the other processes (followers) run the same
operation on their devices (SPMD). The transport is `broadcast_object`: pickled bytes sent with
`multihost_utils.broadcast_one_to_all`, so no channel besides jax.distributed's own is needed.
"""

import os
import pickle

import jax
import numpy as np
from jax.experimental import multihost_utils


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


def broadcast_object(obj=None):
    """Process 0's `obj` on every process (the others pass anything, e.g. None)."""
    if jax.process_count() == 1:
        return obj
    data = np.frombuffer(pickle.dumps(obj), np.uint8) if is_driver() else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))
    # Pad to a power of two: each distinct shape compiles its own broadcast.
    buffer = np.zeros(1 << max(size - 1, 0).bit_length(), np.uint8)
    buffer[:data.size] = data
    buffer = multihost_utils.broadcast_one_to_all(buffer)
    return pickle.loads(buffer[:size].tobytes())


def min_across_processes(value: int) -> int:
    """The smallest of every process's `value` (sizes that must agree, such as the KV pool's)."""
    if jax.process_count() == 1:
        return value
    return int(np.min(multihost_utils.process_allgather(np.int32(value))))
