"""SamplingParams: how to sample the completions of one request (vLLM's names, defaults and ranges)."""

import dataclasses
import enum
import math

# Temperatures below this are treated as 0: dividing logits by them would overflow.
_GREEDY_TEMPERATURE = 1e-5
# What the device code can represent: token ids, top_k and counters travel as int32.
INT32_MAX = 2**31 - 1
# Stop strings are searched in every new piece of text (and held back while streaming): bound the work.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
# Beam scores divide by length ** length_penalty: beyond this float64 over- or underflows at long lengths.
MAX_ABS_LENGTH_PENALTY = 10.0
# Logits are divided (or multiplied) by it in fp32: outside this range they overflow to inf.
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
# logit_bias: OpenAI's range of a bias, and the entries one request may bias (a fixed device width).
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_LOGIT_BIAS = 64


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's names)."""

    CUMULATIVE = 0  # every step: the whole completion so far
    DELTA = 1  # every step: only what is new since the last output (tokens, text, logprobs)
    FINAL_ONLY = 2  # nothing until the request finishes, then the whole completion


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
    logit_bias: dict[int, float] | None = None  # OpenAI's: token id -> bias added to its logit
    # Structured output (vLLM's names), at most one: the completion follows a JSON schema (a dict
    # or its JSON text), matches a regular expression, or is one of the given strings.
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    prompt_logprobs: int | None = None  # top logprobs of every prompt token after the first (its own is added)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        if self.best_of is None:
            self.best_of = self.n
        if self.top_k == 0:
            self.top_k = -1
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        self._verify()
        if self.temperature < _GREEDY_TEMPERATURE:
            # Greedy ignores the truncation knobs; reset them so nobody applies them by mistake.
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    def _verify(self):
        def check(field, ok, expected):
            if not ok:
                raise ValueError(f"{field}={getattr(self, field)!r:.80}; expected {expected}")

        def is_int(x, low=-INT32_MAX - 1, high=INT32_MAX):
            return isinstance(x, int) and not isinstance(x, bool) and low <= x <= high

        def is_number(x, low=-math.inf, high=math.inf):  # finite: NaN and infinities never pass
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and low <= x <= high

        check("n", is_int(self.n, 1), "an int >= 1")
        check("best_of", is_int(self.best_of, self.n), f"None or an int >= n ({self.n})")
        check("temperature", is_number(self.temperature, 0), "a finite number >= 0")
        check("top_p", is_number(self.top_p, 0, 1) and self.top_p > 0, "in (0, 1]")
        check("top_k", is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
              f"-1 or 0 (disabled), or an int in [1, {INT32_MAX}]")
        check("min_p", is_number(self.min_p, 0, 1), "in [0, 1]")
        check("seed", self.seed is None or isinstance(self.seed, int) and not isinstance(self.seed, bool),
              "None or an int")
        check("max_tokens", is_int(self.max_tokens, 1), f"an int in [1, {INT32_MAX}]")
        check("min_tokens", is_int(self.min_tokens, 0, self.max_tokens), f"an int in [0, max_tokens={self.max_tokens}]")
        check("stop", isinstance(self.stop, list) and len(self.stop) <= MAX_STOP_STRINGS and all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
              f"None, a non-empty str or a list of at most {MAX_STOP_STRINGS} of them, each at most "
              f"{MAX_STOP_STRING_CHARS} characters")
        check("stop_token_ids", isinstance(self.stop_token_ids, list) and all(
            is_int(t, 0) for t in self.stop_token_ids), f"None or a list of token ids (ints in [0, {INT32_MAX}])")
        check("ignore_eos", isinstance(self.ignore_eos, bool), "a bool")
        check("logprobs", self.logprobs is None or is_int(self.logprobs, 0), "None or an int >= 0")
        check("prompt_logprobs", self.prompt_logprobs is None or is_int(self.prompt_logprobs, 0), "None or an int >= 0")
        check("presence_penalty", is_number(self.presence_penalty, -2, 2), "in [-2, 2]")
        check("frequency_penalty", is_number(self.frequency_penalty, -2, 2), "in [-2, 2]")
        check("repetition_penalty", is_number(self.repetition_penalty, *REPETITION_PENALTY_RANGE),
              "in [{:g}, {:g}]".format(*REPETITION_PENALTY_RANGE))
        check("length_penalty", is_number(self.length_penalty, -MAX_ABS_LENGTH_PENALTY, MAX_ABS_LENGTH_PENALTY),
              f"a number in [-{MAX_ABS_LENGTH_PENALTY:g}, {MAX_ABS_LENGTH_PENALTY:g}]")
        check("logit_bias", self.logit_bias is None or isinstance(self.logit_bias, dict) and len(
            self.logit_bias) <= MAX_LOGIT_BIAS and all(is_int(t, 0) and is_number(b, *LOGIT_BIAS_RANGE)
                                                       for t, b in self.logit_bias.items()),
              f"None or a dict of at most {MAX_LOGIT_BIAS} token ids (ints >= 0) to biases in "
              "[{:g}, {:g}]".format(*LOGIT_BIAS_RANGE))
        check("guided_json", self.guided_json is None or isinstance(self.guided_json, (dict, str)),
              "None, a JSON schema (dict) or its JSON text")
        check("guided_regex", self.guided_regex is None or isinstance(self.guided_regex, str), "None or a str")
        check("guided_choice", self.guided_choice is None or isinstance(self.guided_choice, list) and self.guided_choice
              and all(isinstance(c, str) and c for c in self.guided_choice), "None or a list of non-empty strs")
        guides = [name for name in ("guided_json", "guided_regex", "guided_choice") if getattr(self, name) is not None]
        if len(guides) > 1:
            raise ValueError(f"{guides[1]}={getattr(self, guides[1])!r:.80}; expected at most one of {guides}")
        check("use_beam_search", isinstance(self.use_beam_search, bool), "a bool")
        check("output_kind", isinstance(self.output_kind, RequestOutputKind), "a RequestOutputKind")
        # Deltas of completions that are picked only at the end (the best n of best_of, the best
        # beams) would send text that may never be returned.
        check("output_kind", self.output_kind is not RequestOutputKind.DELTA
              or (self.best_of == self.n and not self.use_beam_search), "not DELTA with best_of > n or beam search")
        if self.use_beam_search:
            check("temperature", self.temperature < _GREEDY_TEMPERATURE, "0 with use_beam_search")
            check("top_p", self.top_p == 1, "1 with use_beam_search")
            check("top_k", self.top_k == -1, "-1 with use_beam_search")
            check("min_p", self.min_p == 0, "0 with use_beam_search")
            check("early_stopping", self.early_stopping is True or self.early_stopping is False
                  or self.early_stopping == "never", "True, False or 'never'")
            for name in guides:
                check(name, False, "None with use_beam_search (structured output does not run with beams)")
            return
        check("early_stopping", self.early_stopping is False, "False without use_beam_search")
        check("length_penalty", self.length_penalty == 1, "1.0 without use_beam_search")
        if self.temperature < _GREEDY_TEMPERATURE:
            # vLLM's rule: greedy completions are all the same, so asking for several is a mistake.
            check("best_of", self.best_of == 1, f"1 with greedy sampling (temperature={self.temperature})")

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def guided(self) -> bool:
        return self.guided_json is not None or self.guided_regex is not None or self.guided_choice is not None

    @property
    def sampling_type(self) -> SamplingType:
        if self.use_beam_search:
            return SamplingType.BEAM
        if self.temperature < _GREEDY_TEMPERATURE:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED
