"""`jpaged.LLM` and `jpaged.generate`: the offline entry points (vLLM's names and arguments)."""

import dataclasses
import functools
import itertools
import operator

from tqdm.auto import tqdm

from jpaged.config import EngineConfig
from jpaged.data_parallel.engine import DataParallelLLMEngine
from jpaged.engine import sleep_mode
from jpaged.engine.llm_engine import LLMEngine
from jpaged.outputs import RequestOutput
from jpaged.pooling.engine import PoolingEngine, resolve_runner
from jpaged.pooling.llm_methods import PoolingMethods
from jpaged.sampling_params import RequestOutputKind, SamplingParams


class LLM(PoolingMethods):
    """An LLM with its KV pages, ready to generate. Arguments: see DESIGN.md.
    runner="pooling": an embedding / classification model instead (embed, classify, score, reward:
    jpaged/pooling/llm_methods.py).

    It returns once the weights are loaded: the step shapes compile in the background, smallest
    first, and `generate` starts on those compiled so far (same outputs, fewer tokens per step
    until the larger shapes are in). `wait_for_warmup()` waits for all of them (benchmarks);
    background_warmup=False compiles them all before returning, as vLLM's LLM does."""

    def __init__(self, model: str = "tiny", **engine_kwargs):
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(engine_kwargs) - fields)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; known: {sorted(fields - {'model'})}")
        config = EngineConfig(model=model, **engine_kwargs)
        pooling = resolve_runner(config) == "pooling"
        # data_parallel_size > 1: replica processes behind a router (jpaged/data_parallel)
        self.llm_engine = PoolingEngine(config) if pooling else \
            DataParallelLLMEngine(config) if config.data_parallel_size > 1 else LLMEngine(config)
        self._request_ids = itertools.count()

    def _lead(self, fn):
        """Multi-host: process 0 leads, the others follow its steps (replicas run on one host)."""
        return fn() if isinstance(self.llm_engine, DataParallelLLMEngine) else self.llm_engine.runner.lead(fn)

    def _on_engines(self, fn):
        """fn(engine) on the engine, or on every replica (the first one's answer)."""
        if isinstance(self.llm_engine, DataParallelLLMEngine):
            return self.llm_engine.call_all(fn)[0]
        return fn(self.llm_engine)

    def shutdown(self):
        """Stop the replica processes (data_parallel_size > 1) and close the KV events' sockets."""
        self.llm_engine.shutdown()

    def wait_for_warmup(self, timeout: float | None = None) -> bool:
        """Wait until every step shape is compiled (True), or `timeout` seconds (False)."""
        return self._on_engines(operator.methodcaller("wait_for_warmup", timeout)) \
            if hasattr(self.llm_engine, "wait_for_warmup") or isinstance(self.llm_engine, DataParallelLLMEngine) else True

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; results in input order.
        `lora_request`: a LoRARequest for every prompt, or a list with one (or None) per prompt
        (enable_lora). Multi-host: every process calls this; process 0 schedules (its arguments
        count), the others run the same device steps, and all return process 0's results."""
        if isinstance(self.llm_engine, PoolingEngine):
            raise ValueError("LLM.generate() needs runner='generate'; this LLM was started with runner='pooling' "
                             "(embed, classify, score, reward)")
        return self._lead(lambda: self._generate(prompts, sampling_params, use_tqdm, lora_request))

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request=None, chat_template: str | None = None,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of messages) or a list of them, through the
        chat template; content parts may carry images (image_url with a data:, http(s) or allowed
        local URL; image_pil), loaded by jpaged/multimodal/media.py."""
        from jpaged.multimodal.chat_prompt import chat_prompt

        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [chat_prompt(self.llm_engine, conversation, chat_template=chat_template,
                               add_generation_prompt=add_generation_prompt, chat_template_kwargs=chat_template_kwargs)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _generate(self, prompts, sampling_params, use_tqdm: bool, lora_request=None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if isinstance(prompts, dict):  # vLLM's dict prompt (multi_modal_data: LLMEngine.add_request takes it)
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_request for {len(prompts)} prompts")
        # Only the final outputs are kept: the engine builds no others (vLLM does the same). The
        # caller's params are theirs: copies, one per run of the same object (one for all prompts
        # when a single one is given).
        final_only = []
        for i, sp in enumerate(params):
            if i and sp is params[i - 1]:
                final_only.append(final_only[-1])
            else:
                final_only.append(dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
                                  if isinstance(sp, SamplingParams) else sp)
        params = final_only
        engine = self.llm_engine
        order = {}
        try:
            for prompt, sp, lora in zip(prompts, params, loras):
                request_id = str(next(self._request_ids))
                engine.add_request(request_id, prompt, sp, lora_request=lora)
                order[request_id] = len(order)
        except ValueError:  # a bad prompt: nothing of this call stays queued
            for request_id in order:
                engine.abort_request(request_id)
            raise
        results: list[RequestOutput | None] = [None] * len(order)
        with tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm) as bar:
            try:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished and out.request_id in order:
                            results[order[out.request_id]] = out
                            bar.update(1)
            except BaseException:  # a failed step or Ctrl-C: this call leaves nothing queued
                for request_id in order:
                    engine.abort_request(request_id)
                raise
        return results

    def stats(self) -> dict:
        return self.llm_engine.stats()

    # RL rollouts (jpaged/engine/sleep_mode.py): between generate calls, in the trainer's process.
    def load_weights(self, weights):
        """New weights from memory: a dict or (name, array) pairs in Hugging Face naming, numpy,
        torch (CPU) or jax arrays (jax ones stay on the devices). Partial updates are fine; all
        names, shapes and dtypes are checked before anything changes. Nothing recompiles; the
        prefix cache is reset."""
        if isinstance(self.llm_engine, DataParallelLLMEngine) and not isinstance(weights, dict):
            weights = list(weights)  # sent to every replica: a generator would be used up by the first
        self._on_engines(functools.partial(sleep_mode.load_weights, named_weights=weights))

    def sleep(self, level: int = 1):
        """Free the KV pool and the weights on the devices (level 1: weights kept in host memory;
        level 2: dropped, load_weights or wake_up brings them back). Generating asleep is an error."""
        self._on_engines(functools.partial(sleep_mode.sleep, level=level))

    def wake_up(self):
        self._on_engines(sleep_mode.wake_up)

    def is_sleeping(self) -> bool:
        return self._on_engines(sleep_mode.is_sleeping)

    def reset_prefix_cache(self):
        self._on_engines(sleep_mode.reset_prefix_cache)

    def policy(self):
        """The engine's model for a trainer (jpaged/policy.py): `.params` (the live weights),
        `.apply(params, tokens)` and `.token_logprobs(params, sequences)`, pure JAX (jax.grad
        works). With batch_invariant=True, token_logprobs is bitwise the engine's logprobs."""
        from jpaged.policy import Policy

        return Policy(self.llm_engine.runner)

    def kv_map(self):
        """A picture of the KV pool now (a KVMap: `.save("kv.svg")`, shown inline by Jupyter)."""
        return self._on_engines(LLMEngine.kv_map)


def generate(prompts, sampling_params: SamplingParams | None = None, *, model: str = "tiny", use_tqdm: bool = True,
             **engine_kwargs) -> list[RequestOutput]:
    """One-shot convenience: build an LLM and generate."""
    return LLM(model, **engine_kwargs).generate(prompts, sampling_params, use_tqdm=use_tqdm)
