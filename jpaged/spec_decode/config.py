"""SpeculativeConfig: vLLM's `speculative_config` dict (or JSON string), checked."""

import dataclasses

from jpaged.json_option import option_fields

METHODS = ("ngram", "draft_model", "eagle", "eagle3")
EAGLE_METHODS = ("eagle", "eagle3")  # a head over the target's hidden states (EAGLE-1/2's layout, EAGLE-3's)
MODEL_METHODS = ("draft_model", *EAGLE_METHODS)  # methods that read speculative_config.model
# Bounds on the integers. Drafts per step: each is a row of every decoding sequence in the step (and
# a draft model's step per draft); acceptance falls geometrically with the position, so beyond a
# few tens a draft is almost never accepted. The n-gram lookup tries each n from prompt_lookup_max
# down, each a pass over the context: the work per step grows with the context times the bound squared.
MAX_SPECULATIVE_TOKENS = 32
MAX_PROMPT_LOOKUP = 32  # a 4,096-token context with no repeat: 4.5 ms a sequence a step (64: 12 ms, 512: 0.5 s)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None  # ngram: the longest suffix looked up (default: 4)
    prompt_lookup_min: int | None = None  # ngram: the shortest (default: 1)
    # draft_model: a smaller checkpoint (path or hub id) with the target's vocabulary;
    # eagle3 / eagle: an EAGLE-3 / EAGLE-1/2 head's directory (spec_decode/eagle_head.py)
    model: str | None = None
    # No speculation while more than this many sequences run (large batches are compute bound:
    # verifying drafts that may be rejected costs more than it saves).
    disable_by_batch_size: int | None = None

    @classmethod
    def of(cls, value) -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, a dict or a JSON object string (the CLI's); ValueError
        naming the field otherwise."""
        if value is None or isinstance(value, cls):
            return value
        value = option_fields(value, "speculative_config", cls)
        if "method" not in value:
            value["method"] = "draft_model" if value.get("model") is not None else \
                "ngram" if "prompt_lookup_max" in value or "prompt_lookup_min" in value else None
        for field in ("method", "num_speculative_tokens"):
            if value.get(field) is None:
                raise ValueError(f"speculative_config.{field} is required")
        return cls(**value)

    def __post_init__(self):
        def check(field, ok, expected):
            if not ok:
                raise ValueError(f"speculative_config.{field}={getattr(self, field)!r}; expected {expected}")

        def positive_int(x):
            return isinstance(x, int) and not isinstance(x, bool) and x >= 1

        check("method", self.method in METHODS, f"one of {METHODS}")
        def at_most(x, bound):
            return positive_int(x) and x <= bound

        check("num_speculative_tokens", at_most(self.num_speculative_tokens, MAX_SPECULATIVE_TOKENS),
              f"an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        check("prompt_lookup_max", self.prompt_lookup_max is None or at_most(self.prompt_lookup_max, MAX_PROMPT_LOOKUP),
              f"an integer in [1, {MAX_PROMPT_LOOKUP}]")
        check("prompt_lookup_min", self.prompt_lookup_min is None or at_most(self.prompt_lookup_min, MAX_PROMPT_LOOKUP),
              f"an integer in [1, {MAX_PROMPT_LOOKUP}]")
        check("prompt_lookup_min", self.lookup_min <= self.lookup_max,
              f"<= prompt_lookup_max={self.lookup_max}")
        check("model", (self.model is None) == (self.method not in MODEL_METHODS),
              f"a checkpoint path or hub id with method in {MODEL_METHODS} (and only then)")
        check("model", self.model is None or (isinstance(self.model, str) and self.model.strip() != ""),
              "a non-empty string")
        check("disable_by_batch_size", self.disable_by_batch_size is None or positive_int(self.disable_by_batch_size),
              "None or an integer >= 1")

    @property
    def lookup_max(self) -> int:
        return 4 if self.prompt_lookup_max is None else self.prompt_lookup_max

    @property
    def lookup_min(self) -> int:
        return 1 if self.prompt_lookup_min is None else self.prompt_lookup_min
