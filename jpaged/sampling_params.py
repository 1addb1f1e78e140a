"""SamplingParams: how to sample the completions of one request (vLLM's names, defaults and ranges)."""

import dataclasses
import enum

# Temperatures below this are treated as 0: dividing logits by them would overflow.
_GREEDY_TEMPERATURE = 1e-5


class SamplingType(enum.Enum):
    GREEDY = enum.auto()
    RANDOM = enum.auto()
    RANDOM_SEED = enum.auto()  # random, from the request's own generator
    BEAM = enum.auto()


@dataclasses.dataclass
class SamplingParams:
    n: int = 1  # completions returned
    best_of: int | None = None  # completions generated (the n most likely are returned); None means n
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables it
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop_token_ids are ignored until this many tokens are out
    stop: str | list[str] | None = None  # normalized to a list
    stop_token_ids: list[int] | None = None  # normalized to a list
    ignore_eos: bool = False
    logprobs: int | None = None  # how many top logprobs to return per token (the sampled one is added)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Beam search (vLLM v0.4): best_of beams, the n best finished ones returned; temperature 0 only.
    use_beam_search: bool = False
    length_penalty: float = 1.0  # beam score = cumulative logprob / (prompt + output len) ** length_penalty
    # When beam search stops once best_of beams have finished: True at once; False when the best
    # live beam scores no better at its current length (HF's heuristic); "never" at any length.
    early_stopping: bool | str = False

    def __post_init__(self):
        if self.best_of is None:
            self.best_of = self.n
        if self.top_k == 0:
            self.top_k = -1
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        self._verify()
        if self.temperature < _GREEDY_TEMPERATURE:
            # Greedy ignores the truncation knobs; reset them so nobody applies them by mistake.
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    def _verify(self):
        def check(field, ok, expected):
            if not ok:
                raise ValueError(f"{field}={getattr(self, field)!r}; expected {expected}")

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        def is_number(x):
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        check("n", is_int(self.n) and self.n >= 1, "an int >= 1")
        check("best_of", is_int(self.best_of) and self.best_of >= self.n, f"None or an int >= n ({self.n})")
        check("temperature", is_number(self.temperature) and self.temperature >= 0, ">= 0")
        check("top_p", is_number(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]")
        check("top_k", is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "-1 or 0 (disabled), or >= 1")
        check("min_p", is_number(self.min_p) and 0 <= self.min_p <= 1, "in [0, 1]")
        check("seed", self.seed is None or is_int(self.seed), "None or an int")
        check("max_tokens", is_int(self.max_tokens) and self.max_tokens >= 1, "an int >= 1")
        check("min_tokens", is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
              f"an int in [0, max_tokens={self.max_tokens}]")
        check("stop", all(isinstance(s, str) and s for s in self.stop), "None, a non-empty str or a list of them")
        check("stop_token_ids", all(is_int(t) and t >= 0 for t in self.stop_token_ids),
              "None or a list of token ids (ints >= 0)")
        check("logprobs", self.logprobs is None or (is_int(self.logprobs) and self.logprobs >= 0), "None or >= 0")
        check("presence_penalty", is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
              "in [-2, 2]")
        check("frequency_penalty", is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
              "in [-2, 2]")
        check("repetition_penalty", is_number(self.repetition_penalty) and self.repetition_penalty > 0, "> 0")
        check("length_penalty", is_number(self.length_penalty), "a number")
        check("use_beam_search", isinstance(self.use_beam_search, bool), "a bool")
        if self.use_beam_search:
            check("temperature", self.temperature < _GREEDY_TEMPERATURE, "0 with use_beam_search")
            check("top_p", self.top_p == 1, "1 with use_beam_search")
            check("top_k", self.top_k == -1, "-1 with use_beam_search")
            check("min_p", self.min_p == 0, "0 with use_beam_search")
            check("early_stopping", self.early_stopping is True or self.early_stopping is False
                  or self.early_stopping == "never", "True, False or 'never'")
            return
        check("early_stopping", self.early_stopping is False, "False without use_beam_search")
        check("length_penalty", self.length_penalty == 1, "1.0 without use_beam_search")
        if self.temperature < _GREEDY_TEMPERATURE:
            # vLLM's rule: greedy completions are all the same, so asking for several is a mistake.
            check("best_of", self.best_of == 1, f"1 with greedy sampling (temperature={self.temperature})")

    @property
    def sampling_type(self) -> SamplingType:
        if self.use_beam_search:
            return SamplingType.BEAM
        if self.temperature < _GREEDY_TEMPERATURE:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED
