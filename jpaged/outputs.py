"""What generate() returns: one RequestOutput per prompt, one CompletionOutput per returned completion."""

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    index: int  # which of the request's n completions
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per generated token: {token id: logprob}; None unless asked for
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while unfinished
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, if any

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Per prompt token: None for the first, then {token id: logprob} (its own and the top ones),
    # when SamplingParams.prompt_logprobs asked for them (vLLM's field); else None.
    prompt_logprobs: list[dict[int, float] | None] | None = None
