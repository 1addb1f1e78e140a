"""Request validation, in one place for the offline API and the server: a request is refused up
front (a ValueError naming the field and the limit; the server turns it into a 400) unless it can
run to completion here, so it is never cut short or crashes a step later.
"""

from jpaged.config import EngineConfig
from jpaged.core.block_manager import BlockManager
from jpaged.core.structured_output import guide_of
from jpaged.config import MAX_LOGPROBS
from jpaged.runner.input_batch import MAX_BANNED_TOKENS
from jpaged.sampling_params import SamplingParams


class RequestValidator:
    def __init__(self, vocab_size: int, max_model_len: int, config: EngineConfig, block_manager: BlockManager):
        self.vocab_size, self.max_model_len, self.config, self.block_manager = \
            vocab_size, max_model_len, config, block_manager

    def check_images(self, num_images: int):
        """ValueError naming limit_mm_per_prompt when a prompt brings more images than it allows
        (vLLM's option: {"image": N}; unset, no limit here)."""
        limits = getattr(self.config, "limit_mm_per_prompt", None) or {}
        if isinstance(limits, str):  # (vLLM's JSON form, as the CLI passes it)
            import json

            limits = json.loads(limits)
        limit = limits.get("image")
        if limit is not None and num_images > limit:
            raise ValueError(f"limit_mm_per_prompt: the prompt has {num_images} images, more than the "
                             f"{limit} allowed (limit_mm_per_prompt={{'image': {limit}}})")

    def check_whole_images(self, lengths: list[int], budget: int):
        """ValueError naming max_num_batched_tokens when an image that must be computed in one step
        (disable_chunked_mm_input; always for Gemma 3, whose image tokens attend to each other
        both ways) has more tokens than a step may compute (`budget`: the scheduler's)."""
        largest = max(lengths, default=0)
        if largest > budget:
            raise ValueError(f"max_num_batched_tokens: an image of {largest} tokens must be computed in one step "
                             f"(its tokens attend to each other both ways, or disable_chunked_mm_input is set), "
                             f"more than max_num_batched_tokens={budget}; raise max_num_batched_tokens")

    def check(self, prompt_token_ids: list[int], sp: SamplingParams):
        """ValueError (naming the field and the limit) unless the request can run to completion
        here: ids in the vocabulary, within max_model_len, and all its sequences at full length
        fitting in the KV pool, so it is never cut short. Cheap, reads only fixed limits: the
        server calls it before it builds anything for the request."""
        vocab = self.vocab_size
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in sp.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids={sp.stop_token_ids!r:.80}; token id {bad} is outside the vocabulary "
                             f"[0, {vocab})")
        bad = next((t for t in sp.logit_bias or () if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias={sp.logit_bias!r:.80}; token id {bad} is outside the vocabulary [0, {vocab})")
        if sp.guided:  # the grammar's fixed limits; add_request compiles it
            guide_of(sp)
        if sp.top_k > vocab:
            raise ValueError(f"top_k={sp.top_k}; expected -1 (disabled) or at most the vocabulary size {vocab}")
        if sp.best_of > self.config.max_num_seqs:
            # The group's sequences run together: more than max_num_seqs could never be scheduled.
            field = "n" if sp.best_of == sp.n else "best_of"
            raise ValueError(f"{field}={getattr(sp, field)}; a request's sequences run together, so best_of "
                             f"({sp.best_of}) must not exceed max_num_seqs={self.config.max_num_seqs}")
        if sp.best_of > 1 and self.config.kv_allocation != "paged":
            raise ValueError(f"best_of={sp.best_of}; kv_allocation={self.config.kv_allocation!r} (a baseline "
                             "without block sharing) runs one sequence per request")
        if sp.use_beam_search and 2 * sp.best_of > MAX_LOGPROBS:
            # Each beam's candidates are its 2 * best_of most likely tokens, from the step's top logprobs.
            raise ValueError(f"best_of={sp.best_of}; beam search supports at most {MAX_LOGPROBS // 2} beams")
        for field in ("logprobs", "prompt_logprobs"):
            if (getattr(sp, field) or 0) > MAX_LOGPROBS:
                raise ValueError(f"{field}={getattr(sp, field)}; at most {MAX_LOGPROBS} are supported")
        if len(sp.stop_token_ids) >= MAX_BANNED_TOKENS:
            raise ValueError(f"stop_token_ids has {len(sp.stop_token_ids)} entries; "
                             f"at most {MAX_BANNED_TOKENS - 1} are supported")
        prompt_len = len(prompt_token_ids)
        if prompt_len + sp.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({sp.max_tokens}) = "
                             f"{prompt_len + sp.max_tokens} exceeds max_model_len={self.max_model_len}")
        bm = self.block_manager
        needed = bm.max_blocks_needed(prompt_len, prompt_len + sp.max_tokens, sp.best_of)
        if needed > bm.max_blocks_per_group:
            raise ValueError(f"max_tokens={sp.max_tokens}; the request's {sp.best_of} sequence(s) of up to "
                             f"{prompt_len} + {sp.max_tokens} tokens need up to {needed} KV blocks, but the pool "
                             f"holds {bm.max_blocks_per_group}: lower max_tokens, n or best_of")
