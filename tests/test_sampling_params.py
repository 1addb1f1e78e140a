import dataclasses

import pytest

from jpaged.sampling_params import SamplingParams, SamplingType


def test_defaults_and_field_order():
    names = [f.name for f in dataclasses.fields(SamplingParams)]
    assert names == ["n", "best_of", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
                     "stop", "stop_token_ids", "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "use_beam_search", "length_penalty", "early_stopping", "logit_bias",
                     "guided_json", "guided_regex", "guided_choice", "prompt_logprobs", "output_kind"]
    sp = SamplingParams()
    assert (sp.n, sp.best_of, sp.max_tokens, sp.stop, sp.stop_token_ids, sp.top_k) == (1, 1, 16, [], [], -1)
    assert sp.sampling_type is SamplingType.RANDOM


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 1.5),
    ("temperature", -0.1),
    ("top_p", 0.0), ("top_p", 1.01),
    ("top_k", -2), ("top_k", 2.5),
    ("min_p", -0.01), ("min_p", 1.5),
    ("seed", 1.0), ("seed", "1"),
    ("max_tokens", 0), ("max_tokens", None),
    ("min_tokens", -1), ("min_tokens", 17),  # above max_tokens=16
    ("stop", ""), ("stop", ["ok", 3]),
    ("stop_token_ids", [1, "2"]), ("stop_token_ids", [-1]),
    ("logprobs", -1), ("prompt_logprobs", -1), ("prompt_logprobs", 1.5), ("output_kind", "delta"),
    ("logit_bias", {1: 101}), ("logit_bias", {"1": 1}), ("guided_choice", []), ("guided_regex", 5),
    ("presence_penalty", 2.5), ("presence_penalty", -2.1),
    ("frequency_penalty", 2.01), ("frequency_penalty", -3),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1),
    ("length_penalty", "1"), ("length_penalty", 0.5),  # only beam search uses it
    ("early_stopping", True),  # likewise
    ("use_beam_search", 1),
])
def test_invalid_field_names_it_and_its_value(field, value):
    with pytest.raises(ValueError, match=f"^{field}=") as error:
        SamplingParams(**{field: value})
    assert repr(value) in str(error.value)


def test_best_of():
    assert SamplingParams(n=3).best_of == 3
    assert SamplingParams(n=2, best_of=5).best_of == 5
    with pytest.raises(ValueError, match="best_of=1"):
        SamplingParams(n=2, best_of=1)


def test_stop_normalization():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(7, 9)).stop_token_ids == [7, 9]
    stop = ["x"]
    assert SamplingParams(stop=stop).stop is not stop  # a copy: the caller's list stays theirs


def test_top_k_zero_means_disabled():
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(top_k=5).top_k == 5


def test_ranges_accept_their_bounds():
    SamplingParams(temperature=0, top_p=1, min_p=1, presence_penalty=-2, frequency_penalty=2, min_tokens=16,
                   logprobs=0, seed=0, max_tokens=16)


def test_greedy():
    sp = SamplingParams(temperature=0, top_p=0.5, top_k=3, min_p=0.2)
    assert sp.sampling_type is SamplingType.GREEDY
    assert (sp.top_p, sp.top_k, sp.min_p) == (1.0, -1, 0.0)
    assert SamplingParams(temperature=1e-6).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=0.5, seed=3).sampling_type is SamplingType.RANDOM_SEED
    with pytest.raises(ValueError, match="best_of"):  # greedy completions would all be the same
        SamplingParams(temperature=0, n=2)


def test_beam_search():
    sp = SamplingParams(use_beam_search=True, n=2, best_of=4, temperature=0, length_penalty=0.5,
                        early_stopping="never")
    assert sp.sampling_type is SamplingType.BEAM and sp.best_of == 4
    assert SamplingParams(use_beam_search=True, temperature=0).best_of == 1  # width 1: greedy
    for early_stopping in (True, False):
        SamplingParams(use_beam_search=True, temperature=0, n=3, early_stopping=early_stopping)
    # vLLM v0.4's rules: deterministic, no truncation.
    for field, value in (("temperature", 1.0), ("top_p", 0.9), ("top_k", 5), ("min_p", 0.1),
                         ("early_stopping", "sometimes"), ("early_stopping", 1)):
        with pytest.raises(ValueError, match=f"^{field}="):
            SamplingParams(use_beam_search=True, **{"temperature": 0, field: value})
