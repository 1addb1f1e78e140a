"""EngineConfig: every engine option in one dataclass, named as vLLM names them."""

import dataclasses
import os

from jpaged.core.kv_allocation import KV_ALLOCATIONS
from jpaged.json_option import parsed
from jpaged.kv_events.config import KVEventsConfig
from jpaged.multimodal.chat_parts import parse_limit_mm_per_prompt
from jpaged.spec_decode.config import SpeculativeConfig

DEVICES = ("cuda", "cpu")
# pallas_kernels.BACKENDS (tests/test_platform.py checks they agree), spelled out here so that this module,
# and with it `jpaged serve --help`, imports no jax. pallas: Triton kernels; mosaic: Mosaic GPU (sm_90+).
ATTENTION_BACKENDS = ("auto", "pallas", "mosaic", "xla")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# KV cache dtypes (vLLM's names): "auto" stores K/V in the model's dtype; "fp8" is e4m3.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# Weight quantization (vLLM's names): quantized while loading ("fp8", "int8") or a checkpoint's format.
QUANTIZATION_METHODS = ("fp8", "int8", "compressed-tensors", "awq", "gptq")
# Top logprobs a request may ask for (OpenAI's and vLLM's maximum): every step computes this many.
MAX_LOGPROBS = 20
# The server's /v1/responses results kept for previous_response_id and GET (--responses-store-size).
RESPONSES_STORE_SIZE = 1000
# vLLM's runner and convert: generation, or pooling (embeddings, classification, scores, rewards).
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify", "reward")


def _option(default, help: str, **metadata):
    """A field with its --help text (and argparse extras such as choices) for the command line."""
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


# Options that change nothing a compiled step computes: left out of the executable cache's key
# (runner and convert: a generation engine compiles the same steps whatever they say).
HOST_ONLY_OPTIONS = ("executable_cache", "grammar_compile_timeout", "grammar_compile_memory", "max_cpu_loras",
                     "enable_sleep_mode", "kv_events_config", "data_parallel_size", "data_parallel_rank",
                     "dp_routing", "dp_restart", "runner", "convert", "background_warmup", "limit_mm_per_prompt",
                     "allowed_local_media_path", "allowed_media_domains", "disable_chunked_mm_input")
# --dp-routing (jpaged/data_parallel/router.py).
DP_ROUTINGS = ("prefix", "least-loaded", "round-robin")


@dataclasses.dataclass
class EngineConfig:
    model: str = _option("tiny", "the built-in 'tiny' model, a local Hugging Face directory or a hub id")
    runner: str = _option("auto", "'generate' (text generation) or 'pooling' (embeddings, classification, "
                          "scores, rewards; prefill only); 'auto': pooling for encoder and sequence-classification "
                          "checkpoints", choices=RUNNERS)
    convert: str = _option("auto", "with runner='pooling', what the model gives: 'embed', 'classify' (its "
                           "classification head) or 'reward' (per token); 'auto': classify for a classifier "
                           "checkpoint, else embed", choices=CONVERTS)
    hf_overrides: dict | str | None = _option(
        None, "fields set on the checkpoint's config.json as it is read, vLLM's (a JSON object on the command "
        'line): e.g. {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
        '"is_original_qwen3_reranker": true} serves Qwen3-Reranker as a cross-encoder')
    dtype: str = _option("auto", "weights and KV dtype ('auto': the checkpoint's)", choices=DTYPES)
    quantization: str | None = _option(None, "weights in 8 bits: 'fp8' or 'int8' quantizes a float checkpoint "
                                       "while loading (per output channel, computed at the activation dtype); "
                                       "compressed-tensors, AWQ and GPTQ checkpoints are detected from their "
                                       "config.json without it", choices=QUANTIZATION_METHODS)
    block_size: int = _option(16, "tokens per KV block (page)", choices=(8, 16, 32, 64, 128))
    kv_cache_dtype: str = _option("auto", "KV cache storage: 'auto' (the model's dtype) or fp8 ('fp8' = 'fp8_e4m3', "
                                  "'fp8_e5m2'): half the bytes of bf16 per block, so twice the tokens",
                                  choices=KV_CACHE_DTYPES)
    calculate_kv_scales: bool = _option(False, "fp8 KV cache without scales in the checkpoint: compute each "
                                        "layer's K and V scales from the first step's keys and values "
                                        "(default: scale 1.0)")
    kv_cache_v_transposed: bool = _option(False, "fp8 KV cache: V blocks stored transposed ([head_dim, "
                                          "block_size], FlashAttention-3's fp8 layout: the kernels' V operand "
                                          "K-major); a variant not yet measured faster (docs/PERF.md)")
    gpu_memory_utilization: float = _option(0.9, "fraction of GPU memory the engine may use (weights + KV pool)")
    num_gpu_blocks_override: int | None = _option(None, "KV pool size in blocks, instead of sizing it from memory")
    swap_space: float | None = _option(None, "GiB of host memory per device for swapped-out KV blocks (default: 4 "
                                       "on a GPU; on a CPU, where both are the same RAM, as much as the KV pool, "
                                       "at most 4). A CPU's pool: $JPAGED_CPU_KVCACHE_SPACE GiB, else room for "
                                       "max(32768 tokens, 4 x max_model_len)")
    max_num_seqs: int = _option(256, "most sequences in one step")
    max_num_batched_tokens: int | None = _option(None, "token budget of one step (default: max(2048, max_num_seqs))")
    max_model_len: int | None = _option(None, "context length, prompt + output (default: the model's)")
    enable_prefix_caching: bool = _option(False, "keep full KV blocks for reuse by later prompts with the same prefix")
    preemption_mode: str | None = _option(None, "how to preempt when KV blocks run out (default: recompute a "
                                          "single sequence, swap a group)", choices=("swap", "recompute"))
    kv_allocation: str = _option("paged", "benchmarks only: the paper's baselines reserve KV slots at admission "
                                 "('orca-max', 'orca-pow2', 'orca-oracle') or also batch per request ('static', "
                                 "FasterTransformer-like)", choices=KV_ALLOCATIONS)
    tensor_parallel_size: int = _option(1, "devices to split the model over (Megatron-style)")
    devices: list | str | None = _option(None, "the devices this engine runs on, as jax device ids (--devices 2,3) "
                                         "or, in Python, jax Devices: tensor_parallel_size of them, distinct, on "
                                         "one platform; the mesh, weights, KV pool and compiled steps live there "
                                         "(default: the first tensor_parallel_size devices)")
    data_parallel_size: int = _option(1, "engine replicas, each in its own process on its own "
                                      "tensor_parallel_size devices, behind one front end (data parallelism)")
    data_parallel_rank: int = _option(0, "this replica's rank (set by the front end for each replica; it "
                                      "offsets the KV events' ports and stamps their batches)")
    dp_routing: str = _option("prefix", "which replica takes a request: 'prefix' (the one whose prefix cache holds "
                              "the longest cached prefix, unless it has 8 more requests than the least loaded), "
                              "'least-loaded' or 'round-robin'", choices=DP_ROUTINGS)
    dp_restart: bool = _option(True, "restart a replica process that died, loading its executables from the "
                               "cache (--no-dp-restart: it stays down and the others serve)")
    attention_backend: str = _option("auto", "attention kernels: 'pallas' (Triton), 'mosaic' (Mosaic GPU, sm_90+), "
                                     "'xla' ('auto': on a GPU the family measured faster per phase and page dtype on "
                                     "sm_90, pallas_kernels/choice.py; Triton below sm_90; XLA elsewhere)",
                                     choices=ATTENTION_BACKENDS)
    device: str | None = _option(None, "device platform ('cuda' or 'cpu'): that one or a clear error at start-up "
                                 "(default: jax's default backend)", choices=DEVICES)
    seed: int = _option(0, "seed of unseeded sampling")
    batch_invariant: bool = _option(
        False, "a request's tokens and logprobs are bitwise the same whatever shares its steps (batch, chunk "
        "boundaries, prefix hits, preemption): matmuls in fixed row tiles, attention in fixed key chunks "
        "(vLLM's VLLM_BATCH_INVARIANT=1, also read here); XLA attention only")
    optimization_level: int | None = _option(
        None, "XLA's backend optimization level for the compiled steps (vLLM's -O): 0 compiles fastest and "
        "runs slowest (quick experiments, small models on a CPU), 3 the reverse (default: XLA's, 2 unless "
        "$XLA_FLAGS says otherwise)", choices=(0, 1, 2, 3))
    enforce_eager: bool = _option(False, "compile each step shape on first use instead of all at start-up "
                                  "(quick experiments; serving should leave it off)")
    background_warmup: bool = _option(True, "serve (and return from LLM(...)) once the weights are loaded, "
                                      "compiling the step shapes in the background, smallest first; steps run "
                                      "on the shapes compiled so far (--no-background-warmup: compile all first)")
    async_scheduling: bool | None = _option(
        None, "schedule and dispatch the next decode step before reading the last one's sampled ids, so host and "
        "device overlap (outputs come a step later). Default: on, unless num_scheduler_steps > 1 (a multi-step "
        "decode starts from tokens the host has read); --no-async-scheduling: each step read before the next")
    num_scheduler_steps: int = _option(1, "multi-step decode: when every running request decodes, run this many "
                                       "steps in one device call, sampling on the device (1: off)")
    speculative_config: dict | str | None = _option(
        None, "speculative decoding, vLLM's dict (a JSON object on the command line): "
        '{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m, '
        '"disable_by_batch_size": b}, {"method": "draft_model", "model": PATH_OR_ID, "num_speculative_tokens": k}, '
        '{"method": "eagle3", "model": EAGLE3_HEAD_DIR, "num_speculative_tokens": k}, or {"method": "eagle", '
        '"model": EAGLE_HEAD_DIR, "num_speculative_tokens": k} (EAGLE-1/2 heads)')
    kv_events_config: dict | str | None = _option(
        None, "publish the prefix cache's stores and evictions for KV-aware routers, vLLM's KVEventsConfig (a "
        'JSON object on the command line): {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": '
        '"tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "", "buffer_steps": 10000, "hwm": 100000}, '
        'and jpaged\'s "encoding": "array" (default: what llm-d and Dynamo decode), "map_events" (vLLM after '
        '#42892) or "map" (docs/fleet.md); needs enable_prefix_caching')
    enable_lora: bool = _option(False, "serve LoRA adapters (PEFT format) over the model: LoRARequest offline, "
                                "--lora-modules or a request's model name on the server")
    max_loras: int = _option(1, "LoRA adapters one step can run (device slots)")
    max_lora_rank: int = _option(16, "the largest LoRA rank an adapter may have")
    max_cpu_loras: int | None = _option(None, "LoRA adapters kept read in host memory (default: max_loras)")
    enable_sleep_mode: bool = _option(False, "allow sleep(level) / wake_up (RL rollouts: free the KV pool and the "
                                      "weights between generations); on the server, the /sleep, /wake_up, "
                                      "/is_sleeping and /reset_prefix_cache routes")
    executable_cache: bool = _option(True, "keep compiled steps on disk ($JPAGED_CACHE_DIR, else "
                                     "~/.cache/jpaged/xla) and load them at the next start, each file verified "
                                     "first (--no-executable-cache: compile every step, read and write nothing)")
    grammar_compile_timeout: float = _option(10.0, "seconds a structured-output grammar (JSON schema, regex, "
                                             "choice) may take to compile; longer: the request is refused")
    grammar_compile_memory: int = _option(2048, "MiB of memory a grammar's compile may use; more: the request "
                                          "is refused")
    limit_mm_per_prompt: dict | str | None = _option(
        None, 'most images (or other items) one prompt may hold, vLLM\'s (a JSON object on the command line): '
        '{"image": 2}; a modality not named: 999 (vLLM\'s default); more is refused, naming this option')
    allowed_local_media_path: str | None = _option(
        None, "chat image_url parts may name local files (file:///...) under this directory (symlinks and '..' "
        "resolved, regular files only); unset: local files are refused")
    allowed_media_domains: list | str | None = _option(
        None, "chat image_url parts may fetch http(s) URLs only from these hosts (comma-separated on the command "
        "line; each redirect's host is checked too); unset: any host")
    disable_chunked_mm_input: bool = _option(
        False, "never end a prefill chunk inside an image: an image's tokens are computed in one step (vLLM's); "
        "always on for models whose image tokens attend to each other both ways (Gemma 3), where an image "
        "larger than max_num_batched_tokens is refused")
    revision: str | None = _option(None, "hub revision (branch, tag or commit) of the model")
    tokenizer: str | None = _option(None, "tokenizer directory or hub id, when not the model's")
    # Multi-host (jax.distributed): the same command on every host; unset -> JAX_COORDINATOR_ADDRESS,
    # JAX_NUM_PROCESSES, JAX_PROCESS_ID or cluster auto-detection; none of them -> one process.
    coordinator_address: str | None = _option(None, "multi-host: host:port of process 0")
    num_processes: int | None = _option(None, "multi-host: number of processes")
    process_id: int | None = _option(None, "multi-host: this process's index")

    def __post_init__(self):
        def check(field, ok, expected):
            if not ok:
                raise ValueError(f"{field}={getattr(self, field)!r}; expected {expected}")

        check("block_size", isinstance(self.block_size, int) and self.block_size in (8, 16, 32, 64, 128),
              "one of 8, 16, 32, 64, 128")
        check("optimization_level", self.optimization_level in (None, 0, 1, 2, 3), "one of 0, 1, 2, 3")
        check("gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1, "a fraction in (0, 1]")
        check("num_gpu_blocks_override", self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
              "None or >= 1")
        check("swap_space", self.swap_space is None or self.swap_space >= 0, "None or >= 0 (GiB)")
        check("max_num_seqs", self.max_num_seqs >= 1, ">= 1")
        check("max_num_batched_tokens", self.max_num_batched_tokens is None
              or self.max_num_batched_tokens >= self.max_num_seqs, f"None or >= max_num_seqs={self.max_num_seqs}")
        check("num_scheduler_steps", isinstance(self.num_scheduler_steps, int) and self.num_scheduler_steps >= 1,
              "an integer >= 1")
        check("max_model_len", self.max_model_len is None or self.max_model_len >= 1, "None or >= 1")
        check("preemption_mode", self.preemption_mode in (None, "swap", "recompute"), "None, 'swap' or 'recompute'")
        check("kv_allocation", self.kv_allocation in KV_ALLOCATIONS, f"one of {KV_ALLOCATIONS}")
        check("kv_allocation", self.kv_allocation == "paged" or not self.enable_prefix_caching,
              "'paged' with enable_prefix_caching (the baselines share no blocks)")
        check("tensor_parallel_size", isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
              "an integer >= 1")
        check("data_parallel_size", isinstance(self.data_parallel_size, int) and not isinstance(
            self.data_parallel_size, bool) and self.data_parallel_size >= 1, "an integer >= 1")
        check("data_parallel_rank", isinstance(self.data_parallel_rank, int) and self.data_parallel_rank >= 0,
              "an integer >= 0")
        check("dp_routing", self.dp_routing in DP_ROUTINGS, f"one of {DP_ROUTINGS}")
        self.devices = _device_list(self.devices)
        num_devices = self.tensor_parallel_size * self.data_parallel_size
        check("devices", self.devices is None or len(self.devices) == num_devices,
              f"None or tensor_parallel_size={self.tensor_parallel_size} devices" if self.data_parallel_size == 1 else
              f"None or tensor_parallel_size={self.tensor_parallel_size} x data_parallel_size="
              f"{self.data_parallel_size} = {num_devices} devices")
        check("data_parallel_size", self.data_parallel_size == 1 or not self.num_processes or self.num_processes == 1,
              "1 with multi-host (num_processes > 1): replicas run on one host")
        check("devices", self.devices is None or len({_device_id(d) for d in self.devices}) == len(self.devices),
              "distinct devices")
        check("num_processes", self.num_processes is None or self.num_processes >= 1, "None or >= 1")
        check("process_id", self.process_id is None or self.process_id >= 0, "None or >= 0")
        check("attention_backend", self.attention_backend in ATTENTION_BACKENDS, f"one of {ATTENTION_BACKENDS}")
        check("runner", self.runner in RUNNERS, f"one of {RUNNERS}")
        check("convert", self.convert in CONVERTS, f"one of {CONVERTS}")
        if self.hf_overrides is not None:
            self.hf_overrides = parsed(self.hf_overrides, "hf_overrides")
        check("dtype", self.dtype in DTYPES, f"one of {DTYPES}")
        check("quantization", self.quantization in (None,) + QUANTIZATION_METHODS,
              f"None or one of {QUANTIZATION_METHODS}")
        check("kv_cache_dtype", self.kv_cache_dtype in KV_CACHE_DTYPES, f"one of {KV_CACHE_DTYPES}")
        check("kv_cache_v_transposed", not self.kv_cache_v_transposed or self.kv_cache_dtype != "auto",
              "False unless kv_cache_dtype is fp8 (the layout is fp8's)")
        check("device", self.device in (None,) + DEVICES, f"None or one of {DEVICES}")
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        check("num_scheduler_steps", self.num_scheduler_steps == 1 or self.speculative_config is None,
              "1 with speculative_config (a step verifies drafts, or decodes several tokens on the device)")
        self.kv_events_config = KVEventsConfig.of(self.kv_events_config)
        check("kv_events_config", self.kv_events_config is None or not self.kv_events_config.enabled
              or self.enable_prefix_caching, "events only with enable_prefix_caching (they report the prefix cache)")
        if self.kv_events_config is not None and self.kv_events_config.enabled:
            self.kv_events_config.check_ranks(self.data_parallel_size)  # each replica's ports and paths
        check("max_loras", isinstance(self.max_loras, int) and self.max_loras >= 1, "an integer >= 1")
        check("max_lora_rank", isinstance(self.max_lora_rank, int) and self.max_lora_rank >= 1, "an integer >= 1")
        check("max_cpu_loras", self.max_cpu_loras is None or (isinstance(self.max_cpu_loras, int)
                                                              and self.max_cpu_loras >= self.max_loras),
              f"None or an integer >= max_loras={self.max_loras}")
        check("grammar_compile_timeout", self.grammar_compile_timeout > 0, "> 0 (seconds)")
        check("grammar_compile_memory", self.grammar_compile_memory >= 64, ">= 64 (MiB)")
        self.limit_mm_per_prompt = parse_limit_mm_per_prompt(self.limit_mm_per_prompt)
        check("allowed_local_media_path", self.allowed_local_media_path is None
              or os.path.isdir(os.path.realpath(self.allowed_local_media_path)), "None or an existing directory")
        if isinstance(self.allowed_media_domains, str):
            self.allowed_media_domains = [d.strip() for d in self.allowed_media_domains.split(",") if d.strip()]
        check("allowed_media_domains", self.allowed_media_domains is None or (
            isinstance(self.allowed_media_domains, (list, tuple)) and self.allowed_media_domains
            and all(isinstance(d, str) and d for d in self.allowed_media_domains)), "None or a list of host names")
        if os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0"):  # vLLM's switch
            self.batch_invariant = True
        if self.batch_invariant:
            self._check_batch_invariant(check)

    def _check_batch_invariant(self, check):
        """The options whose arithmetic is not (yet) batch-invariant: refused, never run silently."""
        check("attention_backend", self.attention_backend in ("auto", "xla"),
              "'auto' or 'xla' with batch_invariant (the Pallas kernels choose their splits from the batch); "
              "'auto' runs the invariant XLA attention on every platform with it")
        check("quantization", self.quantization is None, "None with batch_invariant (quantized matmuls are not tiled)")
        check("kv_cache_dtype", self.kv_cache_dtype == "auto",
              "'auto' with batch_invariant (fp8 scales are computed from the first step's batch)")
        check("enable_lora", not self.enable_lora, "False with batch_invariant (LoRA's matmuls are not tiled)")
        # (Speculation of every method: a draft model or an EAGLE head is built batch-invariant too.)


def _device_id(device) -> int:
    return device if isinstance(device, int) else device.id


def _device_list(devices) -> list | None:
    """`devices` as a list of ints and jax Devices: "2,3" (the command line) and a single id or
    Device are accepted too. Whether they exist is checked when the engine starts (jax's backend
    is not started here): sharding.resolve_devices."""
    if devices is None:
        return None
    if isinstance(devices, str):
        try:
            return [int(part) for part in devices.replace(" ", "").split(",")] if devices.strip() else []
        except ValueError:
            raise ValueError(f"devices={devices!r}; expected device ids separated by commas, e.g. '2,3'") from None
    if isinstance(devices, int) or hasattr(devices, "platform"):
        devices = [devices]
    try:
        devices = list(devices)
    except TypeError:
        raise ValueError(f"devices={devices!r}; expected a list of device ids or jax Devices") from None
    for device in devices:
        if isinstance(device, bool) or not (isinstance(device, int) and device >= 0 or hasattr(device, "platform")):
            raise ValueError(f"devices={devices!r}; expected a list of device ids (ints >= 0) or jax Devices")
    return devices
