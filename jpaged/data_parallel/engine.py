"""What the front end holds instead of an engine: `FrontEngine`, the limits and tokenizer every
request is checked against before it is routed (the replicas' own, read from the first one
ready), and `DataParallelLLMEngine`, the offline engine over the replicas (jpaged.LLM with
data_parallel_size > 1): the same add_request / step / abort_request as an LLMEngine."""

import collections
import operator

from jpaged.config import EngineConfig
from jpaged.core.block_manager import BlockManager
from jpaged.core.structured_output import StructuredOutputManager
from jpaged.data_parallel.fleet import Fleet, ReplicaDiedError
from jpaged.engine.request_validator import RequestValidator
from jpaged.outputs import RequestOutput
from jpaged.sampling_params import SamplingParams

# Stats that add up over the replicas (the others are the same everywhere, or the first's).
SUMMED_STATS = ("num_gpu_blocks", "num_free_gpu_blocks", "num_cpu_blocks", "num_free_cpu_blocks", "num_running",
                "num_waiting", "num_swapped", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits",
                "num_gpu_blocks_in_use", "num_gpu_blocks_without_sharing", "num_cached_gpu_blocks",
                "num_compilations", "model_memory_bytes", "kv_cache_bytes", "spec_decode_num_drafts",
                "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


class FrontEngine:
    """The replicas' tokenizer, model config and request limits, for checks in the front end
    (each replica checks again when it adds the request)."""

    def __init__(self, config: EngineConfig, info: dict):
        self.config, self.tokenizer, self.hf_config = config, info["tokenizer"], info["hf_config"]
        self.max_model_len, self.platform = info["max_model_len"], info["platform"]
        limits = BlockManager(config.block_size, info["num_gpu_blocks"], info["num_cpu_blocks"],
                              enable_caching=config.enable_prefix_caching, kv_allocation=config.kv_allocation,
                              max_model_len=self.max_model_len, sliding_window=info["sliding_window"])
        self.request_validator = RequestValidator(self.hf_config.vocab_size, self.max_model_len, config, limits)
        self.structured_output = StructuredOutputManager(self.tokenizer, self.hf_config.vocab_size,
                                                         config.grammar_compile_timeout, config.grammar_compile_memory)
        # Adapters are read and kept by every replica; the front end only needs to know they can be.
        self.lora_manager = "in every replica" if config.enable_lora else None

    def check_request(self, prompt_token_ids: list[int], sp: SamplingParams):
        self.request_validator.check(prompt_token_ids, sp)

    def prompt_ids(self, prompt) -> list[int]:
        """A prompt as token ids (what LLMEngine.add_request accepts), ValueError otherwise."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise ValueError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")


def sum_stats(stats: list[dict | None]) -> dict:
    """The replicas' stats as one engine's (replicas down count nothing)."""
    live = [s for s in stats if s is not None]
    if not live:
        return {}
    total = dict(live[0])
    for key in SUMMED_STATS:
        if key in total:
            total[key] = sum(s.get(key, 0) for s in live)
    if "step_phase_seconds" in total:  # every replica's steps (step_clock.py)
        total["num_steps_timed"] = sum(s.get("num_steps_timed", 0) for s in live)
        total["step_phase_seconds"] = {phase: sum(s.get("step_phase_seconds", {}).get(phase, 0.0) for s in live)
                                       for phase in total["step_phase_seconds"]}
    if "spec_decode_num_accepted_tokens_per_pos" in total:
        total["spec_decode_num_accepted_tokens_per_pos"] = [
            sum(p) for p in zip(*(s["spec_decode_num_accepted_tokens_per_pos"] for s in live))]
    return total


def warmup_health(stats: list[dict | None]) -> dict:
    """/health's warm-up fields over replicas (from their stats; those down count nothing):
    executables compiled of all, and "ready" once every live replica has all of its own."""
    live = [s for s in stats if s is not None]
    total = sum(s.get("warmup_executables_total", 0) for s in live)
    remaining = sum(s.get("warmup_executables_remaining", 0) for s in live)
    return {"ready": bool(live) and remaining == 0, "compiled": total - remaining, "total": total}


class DataParallelLLMEngine:
    """Offline engine over `config.data_parallel_size` replicas: requests are routed as the
    server routes them; `step` returns whatever outputs the replicas sent since the last call."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.fleet = Fleet(config)
        self.fleet.start()
        self.front = FrontEngine(config, self.fleet.info)
        self.tokenizer = self.front.tokenizer
        self._outputs: list[RequestOutput] = []
        self._errors: collections.deque = collections.deque()  # refused adds, failed steps, lost requests
        self._answers: dict[int, dict] = {}
        self.fleet.on_step = self._on_step
        self.fleet.on_added = self._on_added
        self.fleet.on_lost = lambda request_ids, error: self._errors.append(error)
        self.fleet.on_call_done = self._answers.__setitem__

    def _on_step(self, rank, outputs, failed):
        self._outputs.extend(outputs)
        if failed:
            self._errors.append(RuntimeError(f"replica {rank}: {failed[1]}"))

    def _on_added(self, request_id, error):
        if error is not None:
            self._errors.append(ValueError(error))

    def add_request(self, request_id: str, prompt, sampling_params: SamplingParams, lora_request=None):
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        if request_id in self.fleet.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = self.front.prompt_ids(prompt)
        self.front.check_request(ids, sampling_params)
        if lora_request is not None and self.front.lora_manager is None:
            raise ValueError("lora_request needs an engine with enable_lora=True")
        self.fleet.submit(request_id, ids, sampling_params, lora_request)

    def abort_request(self, request_id: str):
        self.fleet.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.fleet.requests)

    def step(self) -> list[RequestOutput]:
        """The outputs the replicas sent since the last call (waits for at least one message)."""
        self.fleet.pump(timeout=1.0)
        if self._errors:
            raise self._errors.popleft()
        outputs, self._outputs = self._outputs, []
        return outputs

    def call_all(self, fn) -> list:
        """fn(engine) in every replica that is up, in rank order; a refusal raises its ValueError."""
        call_id = self.fleet.call_all(fn)
        while call_id not in self._answers:
            self.fleet.pump(timeout=1.0)
        answers = self._answers.pop(call_id)
        if not answers:
            raise ReplicaDiedError(f"no replica is up: {self.fleet.health()}")
        for error_type, value in answers.values():
            if error_type == "ValueError":
                raise ValueError(value)
            if error_type is not None:
                raise RuntimeError(f"{error_type}: {value}")
        return [value for _, (_, value) in sorted(answers.items())]

    def stats(self) -> dict:
        self.fleet.pump(timeout=0)
        return sum_stats(self.fleet.stats)

    def replica_stats(self) -> list[dict | None]:
        self.fleet.pump(timeout=0)
        return list(self.fleet.stats)

    def kv_usage(self):
        return self.call_all(operator.methodcaller("kv_usage"))

    def shutdown(self):
        self.fleet.shutdown()
