"""What the engine's executables need on the device beyond what stays resident (weights, KV pool,
step state): their temporaries, their outputs that are not the donated inputs written in place,
and their per-call inputs. The KV pool is sized after subtracting the largest of these
(engine/memory_plan.py), as vLLM's `determine_available_memory` subtracts a profile run's peak.

XLA says it exactly: a compiled executable's `memory_analysis()` (argument, output, alias and temp
bytes per device). The largest executables are compiled for this on an abstract runner (its pool
and step state shapes only: ModelRunner(abstract=True)) before the pool exists; their temporaries
do not depend on the pool's size, since every step reads the pool in place through block tables
(scripts/gpu_memory_plan.py checks this for an H100 and an H200 without a GPU)."""

import dataclasses
import math

import jax

from jpaged.runner.buckets import BLOCK_OPS


def step_state_bytes(max_num_seqs: int, max_model_len: int, block_size: int = 16) -> int:
    """A ModelRunner's per-row device state: token histories (int32[max_num_seqs, max_model_len]),
    last tokens, and block tables (int32[max_num_seqs + 1, max_model_len / block_size])."""
    return 4 * max_num_seqs * (max_model_len + 1) + 4 * (max_num_seqs + 1) * -(-max_model_len // block_size)


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """One executable's device bytes (per device), from XLA's memory analysis."""

    key: tuple
    argument: int
    output: int
    alias: int  # outputs written into donated inputs (the KV pool, the step state)
    temp: int
    resident: int  # of the arguments: the weights, KV pool and step state, held anyway

    @property
    def transient(self) -> int:
        """What a call adds while it runs: temporaries, new outputs, per-call inputs."""
        return self.temp + max(self.output - self.alias, 0) + max(self.argument - self.resident, 0)


def memory_keys(runner) -> list[tuple]:
    """The executables that bound a step's memory: the largest forward (with the proposer's hidden
    states when it asks for them), the largest multi-step decode, the sampler at its largest row
    bucket (fast and full), each block operation and the widest history upload. Smaller buckets of the
    same function need less."""
    buckets = runner.buckets
    keys = [runner.forward_key(buckets.tokens[-1])]
    if buckets.num_scheduler_steps > 1 and buckets.decode_tokens:
        keys.append(("multi_step", buckets.decode_tokens[-1]))
    keys += [("sample", buckets.rows[-1], full) for full in (False, True)]
    keys += [k for k in buckets.keys() if k[0] in BLOCK_OPS]
    keys += [max((k for k in buckets.keys() if k[0] == "write_history"), key=lambda k: k[2])]  # the widest
    return keys


def _device_bytes(leaf) -> int:
    """A (possibly abstract) array's bytes on each of its devices."""
    sharding = getattr(leaf, "sharding", None)
    shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
    return math.prod(shape) * jax.numpy.dtype(leaf.dtype).itemsize


def measure(runner, keys: list[tuple] | None = None, compile_fn=None) -> list[StepMemory]:
    """Each executable's memory (`keys`, default memory_keys). Compiled through the runner's
    executable cache (a restart loads them); `compile_fn(key)`: compile otherwise (the deviceless
    script compiles for an abstract GPU)."""
    resident = (runner.state, runner.kv_cache, runner.last_tokens, runner.token_history)
    found = []
    for key in keys if keys is not None else memory_keys(runner):
        _, args = runner._jitted_and_args(key)
        compiled = (compile_fn or runner._compile)(key)
        stats = compiled.memory_analysis()
        # (the arguments that are the runner's own arrays, not per-call inputs)
        held = sum(_device_bytes(leaf) for arg in args if any(arg is r for r in resident)
                   for leaf in jax.tree.leaves(arg))
        found.append(StepMemory(key, stats.argument_size_in_bytes, stats.output_size_in_bytes,
                                stats.alias_size_in_bytes, stats.temp_size_in_bytes, held))
    return found


def peak(steps: list[StepMemory]) -> StepMemory | None:
    """The executable that needs the most beyond the resident state."""
    return max(steps, key=lambda s: s.transient, default=None)
