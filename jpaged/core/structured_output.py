"""Structured output: the grammar a request's completion must follow (a JSON schema, a regular
expression, a choice of strings), enforced token by token with llguidance.

Each guided sequence has a matcher that knows which tokens may come next; before a step, the
engine asks for the row's allowed-token bitmask (the sampler masks the others inside the jitted
step), after it, the matcher consumes the sampled token. A grammar is compiled once and cached;
each sequence starts from a copy of the compiled matcher, and forks copy their parent's.

A grammar is checked before it is compiled, in three stages, each a ValueError naming the field
(a 400 over HTTP): fixed limits on its size (MAX_GRAMMAR_BYTES, MAX_ALTERNATIVES, MAX_PATTERNS,
MAX_SCHEMA_DEPTH, as the prompt length is checked); what llguidance would silently get wrong
(integer bounds past 64 bits, which it clamps; a `$ref` cycle with no way out, which has no finite
instance; a grammar only the empty completion satisfies); then a compile in a worker process
under a time budget and a memory bound (grammar_worker.py). `prepare` does all that, and blocks:
the server calls it in a thread, so the event loop and the engine thread never wait on a grammar.
A grammar that errors during generation ends its sequence with finish_reason "error" and the
message as stop_reason, never with text that breaks the grammar. A JSON schema's numbers get a
default range and precision where it sets none (number_bounds.py), so they end.
"""

import collections
import functools
import json
import math
import threading

import numpy as np

from jpaged.core.grammar_worker import GrammarWorker, clean_error
from jpaged.core.number_bounds import bound_numbers
from jpaged.sampling_params import SamplingParams

MAX_GRAMMAR_BYTES = 128 * 1024  # a JSON schema's text, a regex, or all choices together (OpenAI: ~120k)
MAX_ALTERNATIVES = 1024  # choices, enum values and anyOf/oneOf branches in one grammar
MAX_PATTERNS = 32  # regexes inside one JSON schema (pattern, patternProperties keys)
MAX_SCHEMA_DEPTH = 64  # nesting of a JSON schema's objects and arrays
MAX_CACHED_GRAMMAR_BYTES = 512 * 2**20  # compiled grammars kept, by the memory their compile took
MAX_CACHED_GUIDES = 64  # guides kept by their request's grammar text (StructuredOutputManager.guide)
_INT64 = (-2**63, 2**63 - 1)
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def guide_of(sp: SamplingParams) -> tuple[str, object] | None:
    """(the field that asked for it, its value as the worker compiles it) of a guided request:
    a JSON schema as compact text, strict (below); a regex; a tuple of choices. Worked out afresh
    on each call (a schema is walked and dumped): the engine asks its StructuredOutputManager's
    `guide`, which keeps the last ones by the request's grammar text."""
    if sp.guided_json is not None:
        schema = sp.guided_json
        if isinstance(schema, str):
            _check_size("guided_json", schema, len(schema.encode()))
            try:
                schema = json.loads(schema)
            except RecursionError:
                raise GuideError("guided_json", sp.guided_json, f"nests deeper than MAX_SCHEMA_DEPTH="
                                 f"{MAX_SCHEMA_DEPTH}") from None
            except ValueError as e:
                raise GuideError("guided_json", sp.guided_json, f"not valid JSON: {str(e)[:100]}") from None
        _check_schema(sp.guided_json, schema)
        try:  # numbers of bounded length unless the schema says otherwise (number_bounds.py)
            schema = bound_numbers(_strict(schema))
        except ValueError as e:
            raise GuideError("guided_json", sp.guided_json, str(e)) from None
        if isinstance(schema, dict) and "x-guidance" not in schema:
            # Compact JSON: with free whitespace a model can pad forever instead of closing the object.
            schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
        # Keys in the schema's order: llguidance writes an object's properties in that order.
        text = json.dumps(schema)
        _check_size("guided_json", sp.guided_json, len(text))
        return "guided_json", text
    if sp.guided_regex is not None:
        _check_size("guided_regex", sp.guided_regex, len(sp.guided_regex.encode()))
        return "guided_regex", sp.guided_regex
    if sp.guided_choice is not None:
        if len(sp.guided_choice) > MAX_ALTERNATIVES:
            raise GuideError("guided_choice", sp.guided_choice, f"{len(sp.guided_choice)} choices; at most "
                             f"MAX_ALTERNATIVES={MAX_ALTERNATIVES}")
        _check_size("guided_choice", sp.guided_choice, sum(len(c.encode()) for c in sp.guided_choice))
        return "guided_choice", tuple(sp.guided_choice)
    return None


class GuideError(ValueError):
    """A grammar refused: the message names the field, shows the start of its value, says why."""

    def __init__(self, field: str, value, reason: str):
        super().__init__(f"{field}={_short(value)}; {reason}")


def _short(value) -> str:
    try:
        text = value if isinstance(value, str) else json.dumps(value, default=str)
    except (RecursionError, ValueError):  # nested past Python's stack: the depth check says so
        text = "..."
    return repr(text if len(text) <= 80 else text[:77] + "...")


def _check_size(field: str, value, size: int):
    if size > MAX_GRAMMAR_BYTES:
        raise GuideError(field, value, f"{size} bytes; at most MAX_GRAMMAR_BYTES={MAX_GRAMMAR_BYTES}")


def _check_schema(value, schema):
    """The fixed limits and the bounds llguidance would clamp, in one pass without recursion."""
    patterns = alternatives = 0
    has_ref = False
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise GuideError("guided_json", "...", f"nests deeper than MAX_SCHEMA_DEPTH={MAX_SCHEMA_DEPTH}")
        if isinstance(node, list):
            stack.extend((item, depth + 1) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        has_ref = has_ref or "$ref" in node
        patterns += isinstance(node.get("pattern"), str)
        if isinstance(node.get("patternProperties"), dict):
            patterns += len(node["patternProperties"])
        for key in ("enum", "anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                alternatives += len(node[key])
        if patterns > MAX_PATTERNS:
            raise GuideError("guided_json", value, f"more than MAX_PATTERNS={MAX_PATTERNS} regex patterns")
        if alternatives > MAX_ALTERNATIVES:
            raise GuideError("guided_json", value, f"more than MAX_ALTERNATIVES={MAX_ALTERNATIVES} enum values "
                             "and anyOf/oneOf branches")
        if _types(node) == {"integer"}:
            for key in _BOUNDS:
                bound = node.get(key)
                if isinstance(bound, (int, float)) and not isinstance(bound, bool) and \
                        not (math.isfinite(bound) and _INT64[0] <= bound <= _INT64[1]):
                    raise GuideError("guided_json", value, f"integer bound {key}={bound!r} is outside the "
                                     "64-bit range the grammar engine supports")
        stack.extend((child, depth + 1) for child in node.values() if isinstance(child, (dict, list)))
    if has_ref and not _has_finite_instance(schema):
        raise GuideError("guided_json", value, "no finite value matches: its $ref recursion has no way out "
                         "(each branch requires itself again)")


def _types(node: dict) -> set:
    kind = node.get("type")
    return {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()


def _has_finite_instance(root) -> bool:
    """False when every value the schema allows would nest forever through `$ref`s (an object
    that requires itself, an array of at least one of itself): llguidance compiles those, and
    generation can never finish. Only clear cases count as infinite: a schema without a type,
    an unresolvable or external $ref, any keyword not understood here counts as finite."""
    if not isinstance(root, dict):
        return True

    def target(ref):
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        node = root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    # A $ref's text -> its target known finite (a target is a function of the text); absent: not yet.
    finite: dict[str, bool] = {}

    def check(node, depth=0) -> bool:
        if depth > MAX_SCHEMA_DEPTH or not isinstance(node, dict):
            return node is not False
        if "$ref" in node:
            if target(node["$ref"]) is not None and not finite.get(node["$ref"], False):
                return False
        if isinstance(node.get("allOf"), list) and not all(check(s, depth + 1) for s in node["allOf"]):
            return False
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and node[key] and not any(check(s, depth + 1) for s in node[key]):
                return False
        types = _types(node)
        if not types or types - {"object", "array"}:
            return True  # some type with no children (or any type) satisfies it
        ok = False
        if "object" in types:
            properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            required = node.get("required") if isinstance(node.get("required"), list) else []
            ok = all(check(properties.get(name, True), depth + 1) for name in required if isinstance(name, str))
        if "array" in types and not ok:
            items = node.get("items", True)
            min_items = node.get("minItems", 0)
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            needed = prefix[:min_items] if isinstance(min_items, int) else prefix
            ok = all(check(s, depth + 1) for s in needed) and \
                (not isinstance(min_items, int) or min_items <= len(prefix) or check(items, depth + 1))
        return ok

    # Least fixpoint: a target is finite once its schema is, given the targets known finite so far.
    refs = {}  # each resolvable $ref's text -> its target
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            goal = target(node.get("$ref"))
            if goal is not None:
                refs[node["$ref"]] = goal
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    changed = True
    while changed:
        changed = False
        for ref, goal in refs.items():
            if not finite.get(ref) and check(goal):
                finite[ref] = changed = True
    return check(root)


def _strict(schema):
    """Objects with listed properties take no others unless the schema says so (xgrammar's strict
    mode, vLLM's default): a model is not free to invent keys that the caller cannot parse.
    Recursion is safe: _check_schema bounded the depth."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: _strict(value) for key, value in schema.items()}
    if "properties" in strict and "additionalProperties" not in strict:
        strict["additionalProperties"] = False
    return strict


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, compile_timeout: float = 10.0, compile_memory_mib: int = 2048):
        self._hf_tokenizer, self.vocab_size = tokenizer, vocab_size
        self.compile_timeout, self.compile_memory_mib = compile_timeout, compile_memory_mib
        self._tokenizer = None  # llguidance's view of the vocabulary, built on first use
        self._worker = None
        self._lock = threading.RLock()  # prepare runs in the server's threads, the rest in the engine's
        # guide -> (matcher, bytes its compile took), least recently used first; bounded in bytes.
        self._compiled: collections.OrderedDict = collections.OrderedDict()
        self._compiled_bytes = 0
        # (field, the request's grammar as text) -> its guide_of, least recently used first.
        self._guides: collections.OrderedDict = collections.OrderedDict()
        self._matchers: dict[int, object] = {}  # seq_id -> its matcher
        self._errors: dict[int, str] = {}  # seq_id -> the grammar engine's error that ended it
        self.bitmask_words = math.ceil(vocab_size / 32)

    @functools.cached_property
    def _tokenizer_args(self) -> tuple:
        """(tokenizer.json text, vocabulary size, EOS) for llguidance.LLTokenizer, as llguidance.hf
        builds them, so the worker needs no transformers. Built once (a 150k vocabulary's JSON:
        megabytes) for the worker and the serving process alike."""
        import copy

        if not hasattr(self._hf_tokenizer, "backend_tokenizer"):
            raise ValueError("structured output needs a fast (Rust) tokenizer")
        backend = copy.copy(self._hf_tokenizer.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        return backend.to_str(), self.vocab_size, self._hf_tokenizer.eos_token_id

    def _ll_tokenizer(self):
        if self._tokenizer is None:
            import llguidance

            text, n_vocab, eos = self._tokenizer_args
            self._tokenizer = llguidance.LLTokenizer(text, n_vocab=n_vocab, eos_token=eos)
        return self._tokenizer

    def prepare(self, sp: SamplingParams) -> tuple[str, str]:
        """Check and compile the request's grammar (ValueError naming the field when it is not
        acceptable), so the engine finds it compiled. Blocks up to the compile budget: call it
        off the event loop."""
        if self._hf_tokenizer is None:
            raise ValueError(f"{_guided_field(sp)}: structured output needs a tokenizer")
        key = self.guide(sp)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return key
            if self._worker is None:
                self._worker = GrammarWorker(self._tokenizer_args, self.compile_timeout, self.compile_memory_mib)
        try:  # outside the lock: may take the whole budget
            grammar, cost, only_empty = self._worker.check(*key)
        except ValueError as e:
            raise GuideError(key[0], _guide(sp), str(e)) from None
        if only_empty:
            raise GuideError(key[0], _guide(sp), "the grammar allows only an empty completion")
        self._add(key, grammar, cost)
        return key

    def guide(self, sp: SamplingParams) -> tuple[str, object] | None:
        """guide_of(sp), kept by the grammar's text: the server's thread, add_request and each new
        sequence ask for the same request's (a large schema takes milliseconds to walk)."""
        if not sp.guided:
            return None
        field = _guided_field(sp)
        value = getattr(sp, field)
        try:  # a schema object by its JSON text (in its key order, which the guide keeps)
            text = json.dumps(value) if field == "guided_json" and not isinstance(value, str) else value
        except (TypeError, ValueError, RecursionError):  # not JSON: guide_of says why
            return guide_of(sp)
        raw = (field, tuple(text) if isinstance(text, list) else text)
        with self._lock:
            guide = self._guides.get(raw)
            if guide is not None:
                self._guides.move_to_end(raw)
                return guide
        guide = guide_of(sp)
        with self._lock:
            self._guides[raw] = guide
            while len(self._guides) > MAX_CACHED_GUIDES:
                self._guides.popitem(last=False)
        return guide

    def _add(self, key, grammar: str, cost: int):
        import llguidance

        # Known to compile within the budget (the worker just did); drops the GIL while it runs.
        matcher = llguidance.LLMatcher(self._ll_tokenizer(), grammar, log_level=0,
                                       limits=llguidance.LLParserLimits(verbose_errors=False))
        if matcher.is_error():  # the worker compiled the same grammar: not expected
            raise GuideError(key[0], key[1], f"not a valid grammar: {clean_error(matcher.get_error())}")
        # The first mask here too: the lexer states it builds (1.4 s for `a{1000}{1000}`) are kept
        # by every copy, so the engine thread's first mask of a sequence is quick (0.14 s there).
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask(matcher, np.zeros((1, self.bitmask_words), np.int32), 0)
        with self._lock:
            if key not in self._compiled:
                self._compiled[key] = (matcher, cost)
                self._compiled_bytes += cost
            while self._compiled_bytes > MAX_CACHED_GRAMMAR_BYTES and len(self._compiled) > 1:
                _, (_, freed) = self._compiled.popitem(last=False)
                self._compiled_bytes -= freed

    def _matcher(self, seq_id: int, sp: SamplingParams):
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            key = self.prepare(sp)  # compiled when the request was added; again if evicted since
            with self._lock:
                matcher = self._matchers[seq_id] = self._compiled[key][0].deep_copy()
        return matcher

    def _fill(self, matcher) -> np.ndarray:
        """The matcher's next-token mask; empty when it is in error or allows nothing."""
        import llguidance.numpy

        row = np.zeros((1, self.bitmask_words), np.int32)
        if not matcher.is_error():
            llguidance.numpy.fill_next_token_bitmask(matcher, row, 0)
        return row[0]

    def _eos_only(self) -> np.ndarray:
        row = np.zeros(self.bitmask_words, np.int32)
        eos = self._hf_tokenizer.eos_token_id or 0
        row.view(np.uint32)[eos // 32] = 1 << (eos % 32)
        return row

    def bitmask(self, seq_id: int, sp: SamplingParams) -> np.ndarray:
        """i32[bitmask_words]: the tokens the sequence may sample next (bit t % 32 of word t // 32).
        A matcher in error allows only EOS (or token 0): `accept` then ends the sequence."""
        matcher = self._matcher(seq_id, sp)
        row = self._fill(matcher)
        if matcher.is_error() or not row.any():
            self._errors.setdefault(seq_id, clean_error(matcher.get_error()) if matcher.is_error()
                                    else "the grammar allows no next token")
            return self._eos_only()
        return row

    def valid_drafts(self, seq_id: int, sp: SamplingParams, drafts: list[int]) -> int:
        """Speculative decoding: how many leading drafts the grammar accepts from the sequence's
        state (none once it is in error)."""
        matcher = self._matcher(seq_id, sp)
        if seq_id in self._errors or matcher.is_error() or not drafts:
            return 0
        return matcher.validate_tokens(drafts)

    def draft_bitmasks(self, seq_id: int, sp: SamplingParams, drafts: list[int]) -> list[np.ndarray]:
        """The masks of the rows that verify `drafts` (all valid: `valid_drafts`): before the first
        draft, then after each one, the matcher rolled back after. A state past a draft that
        allows nothing (the grammar complete) gets EOS alone, recording no error: the run ends
        there when that draft is accepted."""
        rows = [self.bitmask(seq_id, sp)]
        matcher = self._matchers[seq_id]
        for token in drafts:
            matcher.consume_token(token)
            row = self._fill(matcher)
            rows.append(row if row.any() else self._eos_only())
        matcher.rollback(len(drafts))
        return rows

    def fork(self, parent_id: int, child_id: int):
        if parent_id in self._matchers:
            self._matchers[child_id] = self._matchers[parent_id].deep_copy()
        if parent_id in self._errors:
            self._errors[child_id] = self._errors[parent_id]

    def accept(self, seq_id: int, token_id: int) -> str | None:
        """Advance the sequence's matcher by its new token: None while the grammar goes on, "stop"
        once it is complete, "error" when the grammar engine failed (see `error`)."""
        matcher = self._matchers[seq_id]
        if seq_id not in self._errors:
            matcher.consume_token(token_id)
            if matcher.is_error():
                self._errors[seq_id] = clean_error(matcher.get_error())
        if seq_id in self._errors:
            return "error"
        return "stop" if matcher.is_stopped() else None

    def error(self, seq_id: int) -> str | None:
        return self._errors.get(seq_id)

    def free(self, seq_id: int):
        self._matchers.pop(seq_id, None)
        self._errors.pop(seq_id, None)


def _guided_field(sp: SamplingParams) -> str:
    return next(name for name in ("guided_json", "guided_regex", "guided_choice") if getattr(sp, name) is not None)


def _guide(sp: SamplingParams):
    return getattr(sp, _guided_field(sp))
