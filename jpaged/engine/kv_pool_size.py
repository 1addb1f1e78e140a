"""How many KV blocks the engine reserves: on the device (the pool) and in host memory (swap space).

- A GPU: planned as vLLM's `determine_available_memory` does (GpuMemoryPlan): of the memory jax
  may use on the device (its `bytes_limit`: XLA_PYTHON_CLIENT_MEM_FRACTION of the device, 0.75 by
  default, preallocated or not), `gpu_memory_utilization` of it, minus what is resident before
  the pool (the weights: `bytes_in_use`), minus the runners' step state (token histories; a
  speculative proposer's runner's too, with an EAGLE head's chain scratch blocks), minus
  the peak transient memory of the executables the engine will run (measured from their
  compiled memory analysis: runner/step_memory.py), minus a stated margin. Swap space
  `swap_space` GiB (default 4).
- A CPU, where the pool and the swap space are the same RAM as everything else, sized as vLLM's CPU
  backend sizes it (VLLM_CPU_KVCACHE_SPACE):
  - $JPAGED_CPU_KVCACHE_SPACE GiB when set (vLLM's $VLLM_CPU_KVCACHE_SPACE is read too);
  - otherwise room for CPU_POOL_TOKENS tokens or CPU_POOL_SEQUENCES sequences of max_model_len,
    whichever is more, but never more than max_num_seqs sequences of max_model_len need, nor more
    than CPU_POOL_RAM_FRACTION of the machine's RAM (of the total, not the free RAM: the same pool,
    so the same compiled step shapes, every start);
  - swap space: `swap_space` GiB when given; otherwise as much as the pool (or the default pool,
    when that is larger), at most 4 GiB: swapping on a CPU copies within the same RAM.
- `num_gpu_blocks_override` sets the pool in blocks on either.
The start-up line says which rule sized the pool (`PoolSize.how`).
"""

import dataclasses
import math
import os

GIB = 2**30
DEFAULT_SWAP_SPACE_GIB = 4
CPU_KVCACHE_SPACE_ENV = ("JPAGED_CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE")
CPU_POOL_TOKENS = 32_768
CPU_POOL_SEQUENCES = 4
CPU_POOL_RAM_FRACTION = 0.05
# Left free on a GPU besides the executables' measured needs: allocator rounding and
# fragmentation, cuBLAS/cuDNN handles, autotuning buffers of compiles during a background warm-up.
GPU_MARGIN_BYTES = 512 * 2**20
GPU_MARGIN_FRACTION = 0.01  # ... plus this much of the memory jax may use
GROWTH_SLACK_BYTES = 64 * 2**20  # a growing allocator's rounding, below its largest piece


@dataclasses.dataclass(frozen=True)
class GpuMemoryPlan:
    """A GPU's memory, planned before the pool is allocated (bytes per device)."""

    limit: int  # what jax may use on the device (memory_stats' bytes_limit)
    utilization: float  # gpu_memory_utilization
    resident: int  # in use before the pool: the weights and what else the process holds
    step_state: int  # the runners' per-row device state (token histories, last tokens; a proposer's scratch)
    peak: int  # the largest executable's transient bytes (temporaries, new outputs, inputs)
    peak_of: str  # which executable
    margin: int
    pool: int  # the KV pool, a whole number of blocks
    contiguous: int | None = None  # a growing allocator's largest piece for the pool (None: preallocated)

    @property
    def free(self) -> int:
        """Left unplanned: the (1 - utilization) share and what the blocks' rounding leaves."""
        return self.limit - self.resident - self.step_state - self.peak - self.margin - self.pool

    def describe(self) -> str:
        g = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
        return (f"gpu_memory_utilization={self.utilization} of the {g(self.limit)} jax may use: weights and other "
                f"resident {g(self.resident)}, step state {g(self.step_state)}, peak step temporaries "
                f"{g(self.peak)} ({self.peak_of}), margin {g(self.margin)}, KV pool {g(self.pool)}"
                + (f" (at most {g(self.contiguous)} in one piece: jax's allocator grows, "
                   f"XLA_PYTHON_CLIENT_PREALLOCATE=false)" if self.contiguous is not None else "")
                + f", {g(self.free)} left free")


def plan_gpu_memory(*, bytes_per_block: int, gpu_memory_utilization: float, memory_stats: dict, step_state: int = 0,
                    peak: int = 0, peak_of: str = "not measured") -> tuple[int, GpuMemoryPlan]:
    """The pool in blocks on a GPU, and the plan that gave it. A pool of no block is a ValueError
    that gives the numbers and the options to change."""
    limit, resident = int(memory_stats["bytes_limit"]), int(memory_stats["bytes_in_use"])
    margin = GPU_MARGIN_BYTES + int(GPU_MARGIN_FRACTION * limit)
    room = int(limit * gpu_memory_utilization) - resident - step_state - peak - margin
    contiguous = None
    if memory_stats.get("pool_bytes") is not None and memory_stats["pool_bytes"] < limit:
        # A growing allocator (no preallocation): the pool is reserved in one piece (start_up.
        # reserve_device_memory), from a new region within what the allocator has not taken yet,
        # or from the largest free piece of the regions it holds; that piece keeps room for the
        # peak temporaries and the margin too (what the older regions hold free may be in bits).
        contiguous = max(limit - int(memory_stats["pool_bytes"]), int(memory_stats.get("largest_free_block_bytes", 0)))
        contiguous -= GROWTH_SLACK_BYTES
        room = min(room, contiguous - peak - margin)
    num_blocks = max(room, 0) // bytes_per_block
    plan = GpuMemoryPlan(limit, gpu_memory_utilization, resident, step_state, peak, peak_of, margin,
                         num_blocks * bytes_per_block, contiguous)
    if num_blocks < 1:
        raise ValueError(f"no room for the KV cache: {plan.describe()}; the pool needs {bytes_per_block} bytes "
                         f"per block. Raise gpu_memory_utilization (--gpu-memory-utilization), lower max_num_seqs or "
                         f"max_num_batched_tokens (smaller steps), use a smaller model or dtype, or give "
                         f"jax more of the device (XLA_PYTHON_CLIENT_MEM_FRACTION)")
    return num_blocks, plan


@dataclasses.dataclass(frozen=True)
class PoolSize:
    num_gpu_blocks: int
    num_cpu_blocks: int
    how: str  # the rule that sized the pool, for the start-up line
    plan: GpuMemoryPlan | None = None  # a GPU's, when the pool was planned from its memory


def cpu_kvcache_space(environ=os.environ) -> float | None:
    """GiB from $JPAGED_CPU_KVCACHE_SPACE (else $VLLM_CPU_KVCACHE_SPACE); None when neither is set
    (vLLM's 0 means "the default" too). Anything but a number >= 0 is an error naming the variable."""
    for name in CPU_KVCACHE_SPACE_ENV:
        value = environ.get(name, "").strip()
        if not value:
            continue
        try:
            gib = float(value)
        except ValueError:
            gib = -1.0
        if not (math.isfinite(gib) and gib >= 0):
            raise ValueError(f"${name}={value!r}; expected the KV cache's size in GiB (a number >= 0)")
        return gib or None
    return None


def pool_size(*, bytes_per_block: int, block_size: int, max_model_len: int, max_num_seqs: int,
              num_gpu_blocks_override: int | None, gpu_memory_utilization: float, swap_space: float | None,
              memory_stats: dict | None, ram_bytes: int, environ=os.environ, step_state: int = 0,
              peak: int = 0, peak_of: str = "not measured") -> PoolSize:
    """The pool and swap space in blocks. `memory_stats`: the device's (a GPU's bytes_limit and
    bytes_in_use), None on a CPU; `ram_bytes`: the machine's RAM. On a GPU, `step_state` and
    `peak` (the largest executable's transient bytes, `peak_of` names it) come off the pool."""
    blocks_per_seq = math.ceil(max_model_len / block_size)
    on_gpu = bool(memory_stats and "bytes_limit" in memory_stats)
    wanted = max(math.ceil(CPU_POOL_TOKENS / block_size), CPU_POOL_SEQUENCES * blocks_per_seq)
    ram_cap = int(CPU_POOL_RAM_FRACTION * ram_bytes // bytes_per_block)
    cpu_default = max(min(wanted, max_num_seqs * blocks_per_seq, ram_cap), 1)
    plan = None
    if num_gpu_blocks_override:
        num_blocks, how = num_gpu_blocks_override, "num_gpu_blocks_override"
    elif on_gpu:
        num_blocks, plan = plan_gpu_memory(bytes_per_block=bytes_per_block, gpu_memory_utilization=gpu_memory_utilization,
                                           memory_stats=memory_stats, step_state=step_state, peak=peak, peak_of=peak_of)
        how = plan.describe()
    elif (gib := cpu_kvcache_space(environ)) is not None:
        num_blocks, how = int(gib * GIB // bytes_per_block), f"${_env_name(environ)}={gib:g} GiB"
    else:
        num_blocks = cpu_default
        how = f"the CPU default, {num_blocks * block_size} tokens; ${CPU_KVCACHE_SPACE_ENV[0]}=GiB sets it"
    num_blocks = max(num_blocks, 1)
    if swap_space is not None:
        swap_bytes = swap_space * GIB
    elif on_gpu:
        swap_bytes = DEFAULT_SWAP_SPACE_GIB * GIB
    else:
        swap_bytes = min(DEFAULT_SWAP_SPACE_GIB * GIB, max(num_blocks, cpu_default) * bytes_per_block)
    return PoolSize(num_blocks, int(swap_bytes // bytes_per_block), how, plan)


def _env_name(environ) -> str:
    return next(name for name in CPU_KVCACHE_SPACE_ENV if environ.get(name, "").strip())
