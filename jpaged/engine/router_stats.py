"""What fleet routers read from a replica besides LLMEngine.stats(), under vLLM's names: the LoRA
adapters of the requests running and waiting (vLLM's `vllm:lora_requests_info`) and the KV cache's
layout (`vllm:cache_config_info`). Read on the engine's thread, with stats() (serving/async_engine.py,
the data-parallel replica loop); rendered by serving/metrics.py."""


def router_stats(engine) -> dict:
    """`max_lora` None when LoRA is off (vLLM then has no lora_requests_info); adapter names sorted,
    each once; requests swapped out wait to run again, so they count as waiting."""
    sched, config = engine.scheduler, engine.config

    def adapters(groups) -> list[str]:
        return sorted({g.lora_request.lora_name for g in groups if g.lora_request is not None})

    return {"block_size": engine.block_manager.block_size,
            "max_lora": config.max_loras if config.enable_lora else None,
            "running_lora_adapters": adapters(sched.running),
            "waiting_lora_adapters": adapters([*sched.waiting, *sched.swapped])}
