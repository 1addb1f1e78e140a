"""LLMEngine.stats(): the engine's counters, read after every step by the server (/metrics, the
data-parallel replicas' reports) and by the benchmarks. Cheap: nothing here visits every block
table entry (LLMEngine.kv_usage does, when asked)."""


def engine_stats(engine) -> dict:
    bm, sched = engine.block_manager, engine.scheduler
    return {
        "num_gpu_blocks": bm.num_gpu_blocks, "num_free_gpu_blocks": bm.get_num_free_gpu_blocks(),
        "num_cpu_blocks": bm.num_cpu_blocks, "num_free_cpu_blocks": bm.get_num_free_cpu_blocks(),
        "num_running": len(sched.running), "num_waiting": len(sched.waiting), "num_swapped": len(sched.swapped),
        "num_preemptions": sched.num_preemptions,
        # Prefix caching, counted in TOKENS (as vLLM v1): tokens of admitted sequences looked
        # up, and those found cached (not computed).
        "prefix_cache_queries": bm.prefix_cache_queries, "prefix_cache_hits": bm.prefix_cache_hits,
        # Sharing (forks, beams, cached prefixes): device blocks held now, and how many the same
        # block tables would hold if no block were shared; cached = free blocks still holding a prefix.
        "num_gpu_blocks_in_use": bm.get_num_gpu_blocks_in_use(),
        "num_gpu_blocks_without_sharing": bm.get_num_gpu_blocks_without_sharing(),
        "num_cached_gpu_blocks": bm.get_num_cached_gpu_blocks(),
        "num_compilations": engine.runner.num_compilations,
        "warmup_executables_remaining": 0 if engine.runner.warmup is None else engine.runner.warmup.remaining,
        "warmup_executables_total": 0 if engine.runner.warmup is None else engine.runner.warmup.total,
        "kv_cache_dtype": engine.kv_cache_dtype,
        "model_memory_bytes": engine.model_memory_bytes,
        "kv_cache_bytes": 0 if engine.runner.kv_cache is None else engine.runner.kv_cache_spec.bytes_per_block
        * engine.runner.num_gpu_blocks * engine.config.tensor_parallel_size,
        **(sched.speculator.stats() if sched.speculator else {}),
        # Seconds each phase of the steps took, since the start (step_clock.py), and the steps.
        **engine.clock.snapshot(),
    }
