"""`jpaged.LLM` and `jpaged.generate`: the offline entry points (vLLM's names and arguments).

For now a minimal generation path: requests run one at a time, each taking pages 0, 1, 2...
in order, with host-side sampling. The engine issue replaces the loop with the block
manager, the continuous-batching scheduler and in-jit sampling behind the same API.
"""

import dataclasses
import itertools
import logging
import math

import jax
import numpy as np
from tqdm.auto import tqdm

from jpaged.config import EngineConfig
from jpaged.models.layers import AttentionMetadata
from jpaged.models.loader import load_model
from jpaged.outputs import CompletionOutput, RequestOutput
from jpaged.runner.model_runner import ModelRunner
from jpaged.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _bucket(n: int, minimum: int = 16) -> int:
    """Round up to a power of two so a handful of shapes cover every request."""
    return max(minimum, 1 << (n - 1).bit_length())


def derive_max_model_len(hf_config, requested: int | None) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)
    # Sliding-window attention (Mistral) is not implemented: never attend past the window.
    window = getattr(hf_config, "sliding_window", None) if getattr(hf_config, "use_sliding_window", True) else None
    limit = min(x for x in (limit, window) if x) if (limit or window) else None
    if requested is None:
        if limit is None:
            raise ValueError("max_model_len must be given: the model config has no max_position_embeddings")
        return limit
    if limit is not None and requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's limit of {limit} positions")
    return requested


class LLM:
    """An LLM with its KV pages, ready to generate. See DESIGN.md for the arguments."""

    def __init__(self, model: str = "tiny", **engine_kwargs):
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(engine_kwargs) - fields)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; known: {sorted(fields - {'model'})}")
        self.config = EngineConfig(model=model, **engine_kwargs)
        loaded = load_model(model, dtype=self.config.dtype, attention_backend=self.config.attention_backend,
                            revision=self.config.revision)
        self.tokenizer, self.hf_config = loaded.tokenizer, loaded.hf_config
        self.max_model_len = derive_max_model_len(loaded.hf_config, self.config.max_model_len)
        bs = self.config.block_size
        num_blocks = self.config.num_gpu_blocks_override or math.ceil(self.max_model_len / bs)
        self.runner = ModelRunner(loaded, block_size=bs, num_blocks=num_blocks)
        self._request_counter = itertools.count()
        logger.info("jpaged: %s (%s) on %s, %d KV blocks of %d tokens", model, loaded.dtype.name,
                    jax.default_backend(), num_blocks, bs)

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | None = None, use_tqdm: bool = True
                 ) -> list[RequestOutput]:
        sampling_params = sampling_params or SamplingParams()
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        requests = [self._tokenize(p, sampling_params) for p in prompts]
        return [self._run(text, ids, sampling_params) for text, ids in tqdm(requests, disable=not use_tqdm,
                                                                              desc="Processed prompts")]

    def _tokenize(self, prompt, sp: SamplingParams) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        vocab = self.hf_config.vocab_size
        if not ids:
            raise ValueError("prompt is empty")
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token id {min(ids) if min(ids) < 0 else max(ids)} is outside the vocabulary "
                             f"[0, {vocab})")
        if len(ids) + sp.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({sp.max_tokens}) = "
                             f"{len(ids) + sp.max_tokens} exceeds max_model_len={self.max_model_len}")
        return text, ids

    def _run(self, prompt, prompt_ids: list[int], sp: SamplingParams) -> RequestOutput:
        bs = self.runner.block_size
        rng = np.random.default_rng(self.config.seed if sp.seed is None else sp.seed)
        eos = None if sp.ignore_eos else getattr(self.tokenizer, "eos_token_id", None)
        stop_ids = set(sp.stop_token_ids or []) | ({eos} if eos is not None else set())
        tokens, output, finish_reason = list(prompt_ids), [], "length"
        new = len(tokens)  # tokens whose K/V are not yet in the pages
        while len(output) < sp.max_tokens:
            # One sequence, pages in order: token at position p lives in slot p.
            num_tokens = _bucket(new) if new > 1 else 1
            positions = np.zeros(num_tokens, np.int32)
            positions[:new] = np.arange(len(tokens) - new, len(tokens))
            slots = np.full(num_tokens, -1, np.int32)
            slots[:new] = positions[:new]
            input_ids = np.zeros(num_tokens, np.int32)
            input_ids[:new] = tokens[-new:]
            width = _bucket(math.ceil(len(tokens) / bs), minimum=4)
            meta = AttentionMetadata(slot_mapping=slots, block_tables=np.arange(width, dtype=np.int32)[None],
                                     context_lens=np.array([len(tokens)], np.int32),
                                     query_start_loc=np.array([0, new], np.int32), is_decode=num_tokens == 1)
            logits = self.runner.forward(input_ids, positions, meta, [new - 1])[0]
            token = _sample(logits, sp, rng)
            tokens.append(token)
            output.append(token)
            new = 1
            if token in stop_ids and len(output) > sp.min_tokens:
                finish_reason = "stop"
                break
        text = self.tokenizer.decode(output, skip_special_tokens=True) if self.tokenizer is not None else ""
        completion = CompletionOutput(index=0, text=text, token_ids=output, cumulative_logprob=None, logprobs=None,
                                      finish_reason=finish_reason)
        return RequestOutput(request_id=str(next(self._request_counter)), prompt=prompt, prompt_token_ids=prompt_ids,
                             outputs=[completion], finished=True)


def _sample(logits: np.ndarray, sp: SamplingParams, rng: np.random.Generator) -> int:
    if sp.temperature == 0:
        return int(np.argmax(logits))
    logits = logits.astype(np.float64) / sp.temperature
    if sp.top_k > 0:
        logits[logits < np.sort(logits)[-sp.top_k]] = -np.inf
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    if sp.top_p < 1:
        order = np.argsort(-probs)
        keep = np.cumsum(probs[order]) - probs[order] < sp.top_p
        mask = np.zeros_like(probs, bool)
        mask[order[keep]] = True
        probs = np.where(mask, probs, 0)
        probs /= probs.sum()
    return int(rng.choice(len(probs), p=probs))


def generate(prompts, sampling_params: SamplingParams | None = None, *, model: str = "tiny", **engine_kwargs
             ) -> list[RequestOutput]:
    """One-shot convenience: build an LLM and generate."""
    return LLM(model, **engine_kwargs).generate(prompts, sampling_params)
