"""How many KV blocks the engine reserves: on the device (the pool) and in host memory (swap space).

- A GPU: what `gpu_memory_utilization` leaves after the weights (vLLM's rule); swap space
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


@dataclasses.dataclass(frozen=True)
class PoolSize:
    num_gpu_blocks: int
    num_cpu_blocks: int
    how: str  # the rule that sized the pool, for the start-up line


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
              memory_stats: dict | None, ram_bytes: int, environ=os.environ) -> PoolSize:
    """The pool and swap space in blocks. `memory_stats`: the device's (a GPU's bytes_limit and
    bytes_in_use), None on a CPU; `ram_bytes`: the machine's RAM."""
    blocks_per_seq = math.ceil(max_model_len / block_size)
    on_gpu = bool(memory_stats and "bytes_limit" in memory_stats)
    wanted = max(math.ceil(CPU_POOL_TOKENS / block_size), CPU_POOL_SEQUENCES * blocks_per_seq)
    ram_cap = int(CPU_POOL_RAM_FRACTION * ram_bytes // bytes_per_block)
    cpu_default = max(min(wanted, max_num_seqs * blocks_per_seq, ram_cap), 1)
    if num_gpu_blocks_override:
        num_blocks, how = num_gpu_blocks_override, "num_gpu_blocks_override"
    elif on_gpu:
        # Weights are already resident; leave (1 - utilization) of the device for activations.
        budget = memory_stats["bytes_limit"] * gpu_memory_utilization - memory_stats["bytes_in_use"]
        num_blocks, how = int(budget // bytes_per_block), f"gpu_memory_utilization={gpu_memory_utilization}"
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
    return PoolSize(num_blocks, int(swap_bytes // bytes_per_block), how)


def _env_name(environ) -> str:
    return next(name for name in CPU_KVCACHE_SPACE_ENV if environ.get(name, "").strip())
