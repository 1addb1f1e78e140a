"""Structured output: the grammar a request's completion must follow (a JSON schema, a regular
expression, a choice of strings), enforced token by token with llguidance.

Each guided sequence has a matcher that knows which tokens may come next; before a step, the
engine asks for the row's allowed-token bitmask (the sampler masks the others inside the jitted
step), after it, the matcher consumes the sampled token. A grammar is compiled once and cached;
each sequence starts from a copy of the compiled matcher, and forks copy their parent's.
"""

import collections
import json
import math

import numpy as np

from jpaged.sampling_params import SamplingParams

MAX_CACHED_GRAMMARS = 256


def grammar_of(sp: SamplingParams) -> tuple[str, str] | None:
    """(the field that asked for it, the llguidance grammar) of a guided request, else None."""
    import llguidance

    if sp.guided_json is not None:
        schema = _strict(json.loads(sp.guided_json) if isinstance(sp.guided_json, str) else sp.guided_json)
        if isinstance(schema, dict) and "x-guidance" not in schema:
            # Compact JSON: with free whitespace a model can pad forever instead of closing the object.
            schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
        return "guided_json", llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    if sp.guided_regex is not None:
        return "guided_regex", llguidance.LLMatcher.grammar_from_regex(sp.guided_regex)
    if sp.guided_choice is not None:  # one of the strings, as a Lark grammar of JSON-quoted literals
        return "guided_choice", llguidance.grammar_from("lark", "start: " + " | ".join(
            json.dumps(choice) for choice in sp.guided_choice))
    return None


def _strict(schema):
    """Objects with listed properties take no others unless the schema says so (xgrammar's strict
    mode, vLLM's default): a model is not free to invent keys that the caller cannot parse."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: _strict(value) for key, value in schema.items()}
    if "properties" in strict and "additionalProperties" not in strict:
        strict["additionalProperties"] = False
    return strict


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int):
        self._hf_tokenizer, self.vocab_size = tokenizer, vocab_size
        self._tokenizer = None  # llguidance's view of the vocabulary, built on first use
        self._compiled: collections.OrderedDict = collections.OrderedDict()  # grammar -> matcher, LRU
        self._matchers: dict[int, object] = {}  # seq_id -> its matcher
        self.bitmask_words = math.ceil(vocab_size / 32)

    def _ll_tokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
        return self._tokenizer

    def _compile(self, grammar: str):
        import llguidance

        matcher = self._compiled.pop(grammar, None)
        if matcher is None:
            matcher = llguidance.LLMatcher(self._ll_tokenizer(), grammar)
        self._compiled[grammar] = matcher
        while len(self._compiled) > MAX_CACHED_GRAMMARS:
            self._compiled.popitem(last=False)
        return matcher

    def validate(self, sp: SamplingParams):
        """ValueError naming the field when the grammar cannot be compiled."""
        if self._hf_tokenizer is None:
            raise ValueError("structured output needs a tokenizer")
        try:
            field, grammar = grammar_of(sp)
        except Exception as e:  # llguidance rejects the schema or the regex while translating it
            raise ValueError(f"{_guided_field(sp)}={_guide(sp)!r:.80}; not a valid grammar: {e}") from None
        matcher = self._compile(grammar)
        if matcher.is_error():
            self._compiled.pop(grammar, None)
            raise ValueError(f"{field}={_guide(sp)!r:.80}; not a valid grammar: {matcher.get_error()}")

    def bitmask(self, seq_id: int, sp: SamplingParams) -> np.ndarray:
        """i32[bitmask_words]: the tokens the sequence may sample next (bit t % 32 of word t // 32)."""
        import llguidance.numpy

        matcher = self._matchers.get(seq_id)
        if matcher is None:
            matcher = self._matchers[seq_id] = self._compile(grammar_of(sp)[1]).deep_copy()
        row = np.zeros((1, self.bitmask_words), np.int32)
        llguidance.numpy.fill_next_token_bitmask(matcher, row, 0)
        return row[0]

    def fork(self, parent_id: int, child_id: int):
        if parent_id in self._matchers:
            self._matchers[child_id] = self._matchers[parent_id].deep_copy()

    def accept(self, seq_id: int, token_id: int) -> bool:
        """Advance the sequence's matcher by its new token; True once the grammar is complete."""
        matcher = self._matchers[seq_id]
        matcher.consume_token(token_id)
        return matcher.is_stopped() or matcher.is_error()

    def free(self, seq_id: int):
        self._matchers.pop(seq_id, None)


def _guided_field(sp: SamplingParams) -> str:
    return next(name for name in ("guided_json", "guided_regex", "guided_choice") if getattr(sp, name) is not None)


def _guide(sp: SamplingParams):
    return getattr(sp, _guided_field(sp))
