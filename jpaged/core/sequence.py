"""Sequences and sequence groups: the host-side state of requests.

A request is one SequenceGroup. It starts with one Sequence (the prompt); when the prompt has
been computed the engine forks it into `best_of` sequences that share the prompt's KV blocks.
With beam search the group holds the live beams (at most `best_of`), forked and dropped every
step, plus the best finished ones. The sequences of a group advance in lockstep: all unfinished
ones have the same length and the same number of computed tokens.
"""

import copy
import enum

from jpaged.core.request_needs import RequestNeeds
from jpaged.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()  # no KV blocks: not admitted yet, or preempted by recompute
    RUNNING = enum.auto()  # KV blocks on the device
    SWAPPED = enum.auto()  # KV blocks in host memory
    FINISHED_STOPPED = enum.auto()  # EOS, a stop token id or a stop string
    FINISHED_LENGTH_CAPPED = enum.auto()  # max_tokens or max_model_len
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()  # could never be scheduled (too long for the model or the KV pool)
    FINISHED_ERROR = enum.auto()  # its grammar engine failed (stop_reason: the message), vLLM's ERROR

    # Members are singletons compared by identity: hash them so too (Enum's own hash is Python
    # code, and statuses are looked up several times per sampled token).
    __hash__ = object.__hash__

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "length",
    SequenceStatus.FINISHED_ERROR: "error",
}


class Sequence:
    def __init__(self, seq_id: int, prompt_token_ids: list[int]):
        if not prompt_token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.seq_id = seq_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.status = SequenceStatus.WAITING
        # Tokens whose K/V are in the KV pages. The tokens after them are what the next steps
        # compute: the prompt in chunks, then one sampled token per step.
        self.num_computed_tokens = 0
        # Tokens sampled by a dispatched step and not read yet (async scheduling): they count in
        # the length (the next step computes the last one, taken on the device) until appended.
        self.num_pending_tokens = 0
        self.cumulative_logprob = 0.0
        self.output_logprobs: list[dict[int, float]] = []  # per output token, when logprobs are asked for
        self.stop_reason: int | str | None = None  # the stop token id or stop string that finished it
        # Prefix caching: the chained hash of each full block of tokens, filled in by the block manager.
        self.block_hashes: list[bytes] = []
        # What the first block's prefix-cache hash starts from (LoRA: the adapter), so that K/V
        # computed under another adapter is never found.
        self.cache_salt: bytes | None = None
        # Incremental detokenization state, owned by the engine.
        self.output_text = ""
        self.tokens: list[str] | None = None
        self.prefix_offset = 0
        self.read_offset = 0
        self.decode_stream = None  # fast tokenizers' tokenizers.decoders.DecodeStream
        # Text made off the engine thread instead (pending_output.py): never detokenized above,
        # its TextView written only by the thread that completes its outputs.
        self.detokenize_later = False
        self.text_view = None
        # Output tokens and characters already sent (RequestOutputKind.DELTA).
        self.num_sent_tokens = 0
        self.num_sent_chars = 0

    def get_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    def get_prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def get_output_len(self) -> int:
        return len(self.output_token_ids) + self.num_pending_tokens

    def get_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_last_token_id(self) -> int:
        """The last token id; PENDING_TOKEN (-1) when it is still on the device."""
        if self.num_pending_tokens:
            return -1
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def get_num_uncomputed_tokens(self) -> int:
        return self.get_len() - self.num_computed_tokens

    def is_prefill(self) -> bool:
        # A single uncomputed token is computed exactly like a decode step, whatever it is.
        return self.get_num_uncomputed_tokens() > 1

    def is_finished(self) -> bool:
        return self.status in _FINISH_REASONS  # (not the status's property: one dict lookup, no call)

    def append_token_id(self, token_id: int, logprob: float, top_logprobs: dict[int, float] | None = None):
        """Append a sampled token: the oldest pending one, if any, now read."""
        if self.num_pending_tokens:
            self.num_pending_tokens -= 1
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob
        if top_logprobs is not None:
            self.output_logprobs.append(top_logprobs)

    def get_beam_search_score(self, length_penalty: float = 1.0, seq_len: int | None = None,
                              eos_token_id: int | None = None) -> float:
        """vLLM v0.4's (and HF's) length-penalized score: cumulative logprob / length ** penalty, where
        the length counts the prompt but not a final EOS."""
        if seq_len is None:
            seq_len = self.get_len()
            if eos_token_id is not None and self.get_last_token_id() == eos_token_id:
                seq_len -= 1
        return self.cumulative_logprob / (seq_len ** length_penalty)

    def fork(self, new_seq_id: int) -> "Sequence":
        child = copy.deepcopy(self)
        child.seq_id = new_seq_id
        return child

    def reset_for_recompute(self):
        """After preemption by recompute: prompt and outputs so far are prefilled again."""
        self.num_computed_tokens = 0

    def __repr__(self):
        return (f"Sequence(seq_id={self.seq_id}, status={self.status.name}, len={self.get_len()}, "
                f"num_computed_tokens={self.num_computed_tokens})")


class SequenceGroup:
    def __init__(self, request_id: str, seqs: list[Sequence], sampling_params: SamplingParams,
                 arrival_time: float, prompt: str | None = None, lora_request=None):
        self.request_id = request_id
        self.lora_request = lora_request  # a LoRARequest: the adapter every sequence of it runs with
        self.seqs = seqs
        self.sampling_params = sampling_params
        self.needs = RequestNeeds.of(sampling_params)  # once: the params do not change once added
        self.arrival_time = arrival_time
        self.prompt = prompt
        # Prompt logprobs, when asked for: None for the first token, then one dict per prompt token,
        # filled as the prompt is computed (a recompute after that does not collect them again).
        self.prompt_logprobs: list[dict[int, float] | None] | None = \
            [None] if sampling_params.prompt_logprobs is not None else None
        self.num_sent_prompt_logprobs = 0  # RequestOutputKind.DELTA: entries already sent
        self.num_cached_tokens: int | None = None  # prefix-cache hits at the first admission
        # A pooling request (jpaged/pooling/): prefill only, no KV pages kept; its pooled output
        # lands in `pooled` (Scheduler.update_from_output) and it finishes with that step.
        self.pooling = None
        self.pooled = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids

    def reset_prompt_logprobs_if_partial(self):
        """Preempted by recompute in the middle of its prompt: the prompt is computed again from its
        start, and its logprobs collected again with it."""
        if self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids):
            self.prompt_logprobs = [None]

    def prompt_logprob_rows(self, start: int, end: int) -> int:
        """Logits rows that computing positions [start, end) adds for prompt logprobs: one per
        position before the prompt's last whose next token's logprob is not collected yet."""
        if self.prompt_logprobs is None or len(self.prompt_logprobs) - 1 != start:
            return 0
        return max(0, min(end, len(self.prompt_token_ids) - 1) - start)

    def add(self, seq: Sequence):
        self.seqs.append(seq)

    def remove(self, seq: Sequence):
        self.seqs.remove(seq)

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs)
        return [seq for seq in self.seqs if seq.status is status]

    def get_unfinished_seqs(self) -> list[Sequence]:
        return [seq for seq in self.seqs if seq.status not in _FINISH_REASONS]

    def num_seqs(self, status: SequenceStatus | None = None) -> int:
        return len(self.get_seqs(status))

    def num_unfinished_seqs(self) -> int:
        seqs = self.seqs
        if len(seqs) == 1:  # (most groups: no list built)
            return 0 if seqs[0].status in _FINISH_REASONS else 1
        return len(self.get_unfinished_seqs())

    def is_finished(self) -> bool:
        for seq in self.seqs:  # (a loop: called for every group several times a step)
            if seq.status not in _FINISH_REASONS:
                return False
        return True

    def _first_unfinished(self) -> Sequence:
        """The first unfinished sequence (IndexError if none), without building a list."""
        for seq in self.seqs:
            if seq.status not in _FINISH_REASONS:
                return seq
        raise IndexError("the group has no unfinished sequence")

    def get_num_uncomputed_tokens(self) -> int:
        """Per sequence (the unfinished ones are in lockstep)."""
        return self._first_unfinished().get_num_uncomputed_tokens()

    def is_prefill(self) -> bool:
        seq = self._first_unfinished()
        # Sequence.is_prefill, inlined: every running group asks every step.
        return (len(seq.prompt_token_ids) + len(seq.output_token_ids) + seq.num_pending_tokens
                - seq.num_computed_tokens) > 1

    def get_max_num_running_seqs(self) -> int:
        """Sequences this group will run at once: best_of from the start, since the engine forks
        the single prompt sequence into best_of sequences as soon as the prompt is computed (and
        beam search may keep up to best_of beams alive until it stops)."""
        seqs, sp = self.seqs, self.sampling_params
        if sp.use_beam_search:
            return sp.best_of
        if len(seqs) == 1:  # (num_unfinished_seqs inlined: every running group, every step)
            return sp.best_of if not seqs[0].output_token_ids else 0 if seqs[0].status in _FINISH_REASONS else 1
        return self.num_unfinished_seqs()

    def __repr__(self):
        return f"SequenceGroup(request_id={self.request_id!r}, seqs={self.seqs})"
