"""What the engine decides once at start-up, from the loaded model, its options and its devices:
the context length, the KV pool's size, an fp8 pool's scales, the executable cache's directory and
key, and the start-up line that says all of it."""

import dataclasses
import gc
import logging
import math
import os
import weakref

import jax

from jpaged import devices as device_platform
from jpaged.config import HOST_ONLY_OPTIONS, EngineConfig
from jpaged.engine.kv_pool_size import GIB, PoolSize, pool_size
from jpaged.models.kv_cache import KVCacheSpec
from jpaged.models.stacked import layers_form
from jpaged.runner.step_memory import step_state_bytes

logger = logging.getLogger("jpaged.engine.llm_engine")  # the engine's own lines


_froze_a_heap = False  # an engine's start-up has frozen the heap in this process


def freeze_heap(engine=None):
    """Collect, then freeze what is left out of the cyclic collector's passes (an engine's start-up
    heap). Unfreezing first lets an earlier, dropped engine go; a process's first engine walks only
    what nobody froze yet (`jpaged serve` freezes its imports: a full pass was 0.15 s of its start).
    Frozen objects are freed by reference counting alone: what of `engine` sits in a reference
    cycle would stay until the next engine's start-up (its KV pool sized meanwhile). So once
    `engine` is dropped (`engine_dropped`), the heap is unfrozen: gc.collect() then frees the rest
    of it. (A runner and its KV pool are kept out of cycles and go at once.)"""
    global _froze_a_heap
    if _froze_a_heap:
        gc.unfreeze()
    gc.collect()
    gc.freeze()
    _froze_a_heap = True
    if engine is not None:
        weakref.finalize(engine, engine_dropped, engine.runner.warmup).atexit = False


def engine_dropped(warmup=None):
    """An engine is gone (garbage): stop its background warm-up after the compile under way (the
    warm-up thread holds the runner until it ends) and unfreeze the heap (`freeze_heap`)."""
    if warmup is not None:
        warmup.abandon()
    gc.unfreeze()


def derive_max_model_len(hf_config, requested: int | None) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)
    if requested is None:
        if limit is None:
            raise ValueError("max_model_len must be given: the model config has no max_position_embeddings")
        return limit
    if limit is not None and requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's limit of {limit} positions")
    return requested


def executable_cache_dir() -> str:
    """Where compiled steps are kept (~/.cache/jpaged/xla, or $JPAGED_CACHE_DIR), so a restart with
    the same model and limits loads them instead of compiling (runner/executable_cache.py)."""
    return os.environ.get("JPAGED_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "jpaged", "xla"))


def engine_devices(loaded) -> list:
    """The engine's devices: its mesh's, in mesh order (EngineConfig.devices, else the first
    tensor_parallel_size). Everything the engine places or sizes is on these."""
    return list(loaded.mesh.devices.flat)


def tightest_memory_stats(devices: list) -> dict | None:
    """The memory stats of this process's device with the least room (every device holds its
    shard of every block), or None off a GPU."""
    stats = [d.memory_stats() for d in devices if d.platform == "gpu" and d.process_index == jax.process_index()]
    stats = [s for s in stats if s and "bytes_limit" in s]
    return min(stats, key=lambda s: s["bytes_limit"] - s["bytes_in_use"]) if stats else None


# The abstract pool the memory probe compiles with (its executables' temporaries do not depend on
# the pool's size; a fixed size keeps the probe's executables in the on-disk cache across starts).
PROBE_BLOCKS = 256


def measure_step_memory(loaded, kv_cache_spec, shape: dict, num_scheduler_steps: int, executable_cache):
    """The largest executables' memory (runner/step_memory.py), compiled on an abstract runner of
    the engine's shapes before the pool exists: (peak transient bytes, its executable). Without a proposer: a draft's or an EAGLE head's executables are not measured
    (their weights are resident already, so counted)."""
    from jpaged.multimodal.runner import encoder_memory
    from jpaged.runner import step_memory
    from jpaged.runner.model_runner import ModelRunner

    probe = ModelRunner(loaded, kv_cache_spec, **{**shape, "num_gpu_blocks": PROBE_BLOCKS, "num_cpu_blocks": 0},
                        num_scheduler_steps=num_scheduler_steps, executable_cache=executable_cache, abstract=True)
    top = step_memory.peak(step_memory.measure(probe) + encoder_memory(loaded, probe))  # (images: their encoder's)
    return top.transient, " ".join(map(str, top.key))


def kv_pool_size(config: EngineConfig, max_model_len: int, bytes_per_block: int, devices: list,
                 measure=None, proposer_state: int = 0) -> PoolSize:
    """The KV pool and swap space in blocks (kv_pool_size.py: a GPU's memory plan, a CPU's rule),
    sized on the engine's devices. `measure()`: (peak transient bytes, its executable) of the
    engine's executables, called only when a GPU's memory sizes the pool. `proposer_state`: the
    bytes per device a speculative proposer's runner holds besides its share of every block (its
    own step state, an EAGLE head's chain scratch blocks: `device_state_bytes` in spec_decode),
    planned as step state."""
    stats = tightest_memory_stats(devices)
    peak, peak_of = 0, "not measured"
    if stats is not None and not config.num_gpu_blocks_override and measure is not None:
        peak, peak_of = measure()
        stats = tightest_memory_stats(devices)  # after the probe's compiles (their autotuning may grow the allocator)
    pool = pool_size(bytes_per_block=bytes_per_block, block_size=config.block_size, max_model_len=max_model_len,
                     max_num_seqs=config.max_num_seqs, num_gpu_blocks_override=config.num_gpu_blocks_override,
                     gpu_memory_utilization=config.gpu_memory_utilization, swap_space=config.swap_space,
                     memory_stats=stats, ram_bytes=os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
                     step_state=step_state_bytes(config.max_num_seqs, max_model_len, config.block_size) + proposer_state
                     if stats else 0,
                     peak=peak, peak_of=peak_of)
    if pool.num_gpu_blocks < math.ceil(max_model_len / config.block_size):
        logger.warning("only %d KV blocks fit: fewer than one max_model_len sequence needs", pool.num_gpu_blocks)
    return pool


def reserve_device_memory(devices: list, nbytes: int) -> None:
    """Make room for `nbytes` (the KV pool, per device) in one piece before the pool's arrays are
    allocated, and free it again. Under jax's growing allocator (XLA_PYTHON_CLIENT_PREALLOCATE=false)
    the BFC allocator takes memory in regions whose sizes double up to the request's power of two: a
    47 GiB K array took a 64 GiB region of an H200's 104.9 GiB, and the V array's 47 GiB then fitted
    nowhere (the first GPU run's out-of-memory error, reported late by the first sampler call).
    One region of the whole pool's size, freed, holds both. With preallocation (jax's default) the
    one region exists already and this costs a fill. An allocation that fails here is a clear error."""
    for device in devices:
        if device.platform != "gpu" or device.process_index != jax.process_index():
            continue
        rows = -(-nbytes // 2**20)
        try:
            room = jax.numpy.zeros((rows, 2**20), jax.numpy.uint8, device=device)
            room.block_until_ready()
        except Exception as e:  # jax raises JaxRuntimeError (RESOURCE_EXHAUSTED) for a failed allocation
            raise _pool_error(nbytes, device, e, device.memory_stats()) from e
        room.delete()


def check_allocated(pools: list, nbytes: int, devices: list) -> None:
    """Wait for the KV pools' allocation (jax allocates asynchronously: a failure would otherwise
    surface at the first request, from whichever executable reads the pool first)."""
    try:
        jax.block_until_ready(pools)
    except Exception as e:
        raise _pool_error(nbytes, devices, e) from e


def _pool_error(nbytes: int, where, cause: Exception, stats=None) -> ValueError:
    return ValueError(f"the KV pool ({nbytes / GIB:.2f} GiB per device) could not be allocated on {where}: "
                      f"{str(cause).splitlines()[0]}. Lower gpu_memory_utilization or set num_gpu_blocks_override"
                      + (f"; {stats}" if stats else ""))


def kv_scales(config: EngineConfig, loaded, spec: KVCacheSpec):
    """An fp8 cache's per-layer scales from the checkpoint (None: 1.0 or calculated), and
    where they come from, for the start-up line (vLLM's order: calculate_kv_scales, the
    checkpoint, 1.0)."""
    if not spec.quantized:
        return None, ""
    if config.calculate_kv_scales:
        return None, ", scales calculated from the first step"
    if loaded.kv_scales is None:
        return None, ", scales 1.0 (none in the checkpoint; calculate_kv_scales computes them)"
    if len(loaded.kv_scales[0]) != spec.num_layers:
        raise ValueError(f"the checkpoint has KV cache scales for {len(loaded.kv_scales[0])} layers; the model "
                         f"has {spec.num_layers}")
    return loaded.kv_scales, ", scales from the checkpoint"


def model_fingerprint(config: EngineConfig, loaded, max_model_len: int) -> str:
    """What shapes the compiled steps besides their arguments' shapes, jpaged's source and the
    devices (the executable cache keys those itself): the model's config (constants such as
    rope_theta and eps are baked in), dtype, the engine's options and the derived max_model_len
    (LongRoPE picks its factors by it), and whether its stacked layers are unrolled ($JPAGED_SCAN_LAYERS
    on a GPU: models/stacked.py)."""
    options = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
               if f.name not in HOST_ONLY_OPTIONS and f.name != "devices"}
    return "\n".join([loaded.hf_config.to_json_string(), loaded.dtype.name, repr(options), str(max_model_len),
                      layers_form(loaded.model)])


def log_start_up(config: EngineConfig, loaded, devices: list, pool: PoolSize, num_gpu_blocks: int,
                 bytes_per_block: int, kv_cache_dtype: str, scales: str):
    logger.info("jpaged: %s (%s%s) on %s; weights %.1f MiB; KV pool: %d device blocks (%.1f MiB), %d host "
                "blocks of %d tokens (%.1f KiB each; pool sized by %s); KV cache %s%s", config.model,
                loaded.dtype.name, f", weights {loaded.quantization.describe()}" if loaded.quantization else "",
                device_platform.describe(config.attention_backend, devices), loaded.model_memory_bytes / 2**20,
                num_gpu_blocks, num_gpu_blocks * bytes_per_block / 2**20, pool.num_cpu_blocks, config.block_size,
                bytes_per_block / 1024, pool.how, kv_cache_dtype, scales)
