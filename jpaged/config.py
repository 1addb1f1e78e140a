"""EngineConfig: every engine option in one dataclass, named as vLLM names them."""

import dataclasses

from jpaged.models.layers import ATTENTION_BACKENDS


@dataclasses.dataclass
class EngineConfig:
    model: str = "tiny"
    dtype: str = "auto"
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    swap_space: float = 4  # GiB of host memory for swapped-out pages
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = False
    preemption_mode: str | None = None  # "swap" | "recompute" | None (vLLM's default choice)
    tensor_parallel_size: int = 1
    attention_backend: str = "auto"
    seed: int = 0
    # Skip the start-up compilation of every step shape; compile each on first use instead
    # (quick experiments and tests; serving should leave it off).
    enforce_eager: bool = False
    revision: str | None = None
    # Multi-host (jax.distributed): the same command on every host; unset -> JAX_COORDINATOR_ADDRESS,
    # JAX_NUM_PROCESSES, JAX_PROCESS_ID or cluster auto-detection; none of them -> one process.
    coordinator_address: str | None = None  # "host:port" of process 0
    num_processes: int | None = None
    process_id: int | None = None

    def __post_init__(self):
        def check(field, ok, expected):
            if not ok:
                raise ValueError(f"{field}={getattr(self, field)!r}; expected {expected}")

        check("block_size", isinstance(self.block_size, int) and self.block_size in (8, 16, 32, 64, 128),
              "one of 8, 16, 32, 64, 128")
        check("gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1, "a fraction in (0, 1]")
        check("num_gpu_blocks_override", self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
              "None or >= 1")
        check("swap_space", self.swap_space >= 0, ">= 0 (GiB)")
        check("max_num_seqs", self.max_num_seqs >= 1, ">= 1")
        check("max_num_batched_tokens", self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
              "None or >= 1")
        check("max_model_len", self.max_model_len is None or self.max_model_len >= 1, "None or >= 1")
        check("preemption_mode", self.preemption_mode in (None, "swap", "recompute"), "None, 'swap' or 'recompute'")
        check("tensor_parallel_size", isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
              "an integer >= 1")
        check("num_processes", self.num_processes is None or self.num_processes >= 1, "None or >= 1")
        check("process_id", self.process_id is None or self.process_id >= 0, "None or >= 0")
        check("attention_backend", self.attention_backend in ATTENTION_BACKENDS, f"one of {ATTENTION_BACKENDS}")
