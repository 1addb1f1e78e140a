"""Guided JSON numbers end: a schema's number and integer values get a default range and
precision where the schema sets none (jpaged/core/number_bounds.py), what the schema says is kept,
and `"x-jpaged": {"bound_numbers": false}` turns the defaults off."""

import json
import random

import llguidance
import llguidance.hf
import pytest

from jpaged.core.number_bounds import INTEGER_LIMIT, NUMBER_DECIMALS, NUMBER_LIMIT, bound_numbers
from jpaged.core.structured_output import guide_of
from jpaged.models.tiny import tiny_tokenizer
from jpaged.sampling_params import SamplingParams

CITY = {"type": "object", "title": "City", "required": ["name", "population", "area_km2"], "properties": {
    "name": {"type": "string"}, "population": {"type": "integer"}, "area_km2": {"type": "number"}}}


@pytest.fixture(scope="module")
def accepts():
    tokenizer = tiny_tokenizer()
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)

    def accepts(schema, text: str) -> bool:
        """Whether the grammar jpaged compiles for `schema` takes `text` whole."""
        matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_json_schema(
            guide_of(SamplingParams(guided_json=schema))[1]), log_level=0)
        assert not matcher.get_error()
        return all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) \
            and matcher.is_accepting()
    return accepts


def city(population, area) -> str:
    return f'{{"name":"Paris","population":{population},"area_km2":{area}}}'


def test_city_numbers_are_bounded_by_default(accepts):
    rng = random.Random()
    for _ in range(20):
        digits = rng.randint(1, 15)
        area = f"{rng.randint(10 ** (digits - 1), 10 ** digits - 1)}.{rng.randint(0, 999999):06d}"
        population = rng.randint(0, INTEGER_LIMIT)
        assert accepts(CITY, city(population, area))
        assert accepts(CITY, city(-population, "-" + area))
    # What a model wrote until max_tokens: endless integer digits, endless decimals.
    assert not accepts(CITY, city("2" * 17, "1.5"))
    assert not accepts(CITY, city(1, "1" * 17))
    assert not accepts(CITY, city(1, "1." + "5" * (NUMBER_DECIMALS + 1)))
    assert not accepts(CITY, city(1, "1.5e300"))  # no exponent: a bounded number has its digits written out
    # The properties come in the schema's order (as OpenAI writes them), not sorted.
    assert not accepts(CITY, '{"area_km2":1.5,"name":"Paris","population":1}')


def test_what_the_schema_says_is_kept(accepts):
    schema = {"type": "object", "required": ["n", "x", "e", "c"], "properties": {
        "n": {"type": "integer", "minimum": 0},  # a pydantic Field(ge=0): keeps its 0, gets an upper bound
        "x": {"type": "number", "multipleOf": 0.5, "maximum": 1e14},
        "e": {"enum": [1e30, 2]}, "c": {"type": "number", "const": 1e30}}}
    bounded = bound_numbers(schema)["properties"]
    assert bounded["n"] == {"type": "integer", "minimum": 0, "maximum": INTEGER_LIMIT}
    assert bounded["x"] == {"type": "number", "multipleOf": 0.5, "maximum": 1e14, "minimum": -NUMBER_LIMIT}
    assert bounded["e"] == schema["properties"]["e"] and bounded["c"] == schema["properties"]["c"]
    big = "1" + "0" * 30  # 1e30, as the grammar writes the const
    assert accepts(schema, f'{{"n":0,"x":99999999999999.5,"e":2,"c":{big}}}')
    assert not accepts(schema, f'{{"n":-1,"x":1,"e":2,"c":{big}}}')
    assert not accepts(schema, f'{{"n":0,"x":0.25,"e":2,"c":{big}}}')
    # A lower bound past the default upper one: the default upper bound moves past it.
    far = bound_numbers({"type": "number", "minimum": 1e16})
    assert far["minimum"] < far["maximum"] and accepts(far, "10500000000000000")
    # Nested: arrays, anyOf (Optional[float]), $defs; data (defaults, examples) is not rewritten.
    nested = bound_numbers({"$defs": {"P": {"type": "number"}}, "type": "array", "default": [{"type": "number"}],
                            "items": {"anyOf": [{"type": "number"}, {"type": "null"}, {"$ref": "#/$defs/P"}]}})
    assert nested["$defs"]["P"]["maximum"] == nested["items"]["anyOf"][0]["maximum"] == NUMBER_LIMIT
    assert nested["default"] == [{"type": "number"}] and nested["items"]["anyOf"][1] == {"type": "null"}


def test_bounds_can_be_turned_off(accepts):
    off = {**CITY, "x-jpaged": {"bound_numbers": False}}
    assert "x-jpaged" not in json.loads(guide_of(SamplingParams(guided_json=off))[1])
    assert accepts(off, city("2" * 30, "1." + "5" * 30)) and accepts(off, city(1, "1.5e300"))
    with pytest.raises(ValueError, match=r"^guided_json=.*x-jpaged=.*expected \{'bound_numbers': true or false\}"):
        guide_of(SamplingParams(guided_json={**CITY, "x-jpaged": {"bound_numbers": "no"}}))
    with pytest.raises(ValueError, match="x-jpaged"):
        guide_of(SamplingParams(guided_json={**CITY, "x-jpaged": {"digits": 3}}))
