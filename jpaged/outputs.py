"""What generate() returns: one RequestOutput per prompt, one CompletionOutput per returned completion."""

import dataclasses


@dataclasses.dataclass(slots=True)  # (built for every request every step: slots make that cheaper)
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


@dataclasses.dataclass(slots=True)  # (built for every request every step: slots make that cheaper)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Per prompt token: None for the first, then {token id: logprob} (its own and the top ones),
    # when SamplingParams.prompt_logprobs asked for them (vLLM's field); else None.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Prompt tokens whose K/V came from the prefix cache when the request was first scheduled
    # (vLLM's field); None until then.
    num_cached_tokens: int | None = None

    def add(self, delta: "RequestOutput"):
        """Merge the request's next RequestOutputKind.DELTA output into this one (vLLM's
        RequestOutput.add, aggregating): text, tokens and logprobs grow; reasons and the
        cumulative logprob are the newest. Extends this output's own lists in place."""
        self.finished = delta.finished
        if delta.num_cached_tokens is not None:
            self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            if self.prompt_logprobs is None:
                self.prompt_logprobs = []
            self.prompt_logprobs.extend(delta.prompt_logprobs)
        mine = {c.index: c for c in self.outputs}
        for new in delta.outputs:
            c = mine.get(new.index)
            if c is None:
                c = CompletionOutput(new.index, "", [], None, None if new.logprobs is None else [])
                self.outputs.append(c)
            c.text += new.text
            c.token_ids.extend(new.token_ids)
            if new.logprobs is not None:
                c.logprobs.extend(new.logprobs)
            c.cumulative_logprob, c.finish_reason, c.stop_reason = \
                new.cumulative_logprob, new.finish_reason, new.stop_reason
