"""Structured output offline: completions follow their JSON schema, regex or choice whatever the
model (tiny's random weights never would by themselves), with parallel samples, under preemption,
beside unguided requests; logit_bias moves the sampled tokens; bad grammars are ValueErrors."""

import json
import re

import numpy as np
import pytest

import jpaged

LIMITS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, block_size=16, enforce_eager=True)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                                           "ok": {"type": "boolean"}}, "required": ["name", "ok"]}


def check_schema(value):
    assert set(value) <= {"name", "tags", "ok"} and {"name", "ok"} <= set(value)  # strict: no invented keys
    assert isinstance(value["name"], str) and len(value["name"]) <= 6 and isinstance(value["ok"], bool)
    assert all(t in ("a", "b") for t in value.get("tags", [])) and len(value.get("tags", [])) <= 3


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_guided_completions_follow_their_grammar(preemption_mode):
    # 14 blocks for 11 sequences of up to ~140 tokens: requests are preempted while guided.
    llm = jpaged.LLM("tiny", num_gpu_blocks_override=14, preemption_mode=preemption_mode, swap_space=0.05, **LIMITS)
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 256, size=int(rng.integers(5, 40))).tolist() for _ in range(8)]
    params = [jpaged.SamplingParams(temperature=1.0, n=2, seed=int(rng.integers(2**31)), max_tokens=80,
                                    guided_json=SCHEMA),
              jpaged.SamplingParams(temperature=0, max_tokens=80, guided_json=json.dumps(SCHEMA)),
              jpaged.SamplingParams(temperature=1.0, n=3, max_tokens=20, guided_choice=["yes", "no", "not sure"]),
              jpaged.SamplingParams(temperature=1.0, max_tokens=30, guided_regex=r"[0-9]{3}-[a-z]{2,4}", min_tokens=5),
              jpaged.SamplingParams(temperature=1.0, max_tokens=60, ignore_eos=True),  # unguided company
              jpaged.SamplingParams(temperature=0, max_tokens=80, guided_json={"type": "object"})]
    # Two long unguided requests: together they need at least 16 of the 14 blocks, so preemption happens.
    params += [jpaged.SamplingParams(temperature=1.0, max_tokens=120, ignore_eos=True) for _ in range(2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    for c in outs[0].outputs + outs[1].outputs:
        assert c.finish_reason == "stop", c
        check_schema(json.loads(c.text))
    assert all(c.text in ("yes", "no", "not sure") and c.finish_reason == "stop" for c in outs[2].outputs)
    # ([0-9], not \d: the grammar's \d knows digits of newer Unicode versions than Python's re.)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outs[3].outputs[0].text)
    assert len(outs[4].outputs[0].token_ids) == 60
    assert outs[5].outputs[0].text.startswith("{")
    assert llm.llm_engine.structured_output._matchers == {}  # every sequence's matcher let go
    assert llm.stats()["num_free_gpu_blocks"] == llm.stats()["num_gpu_blocks"]


def test_logit_bias_and_bad_grammars():
    llm = jpaged.LLM("tiny", num_gpu_blocks_override=32, **LIMITS)
    z = llm.get_tokenizer().convert_tokens_to_ids("Z")
    out = llm.generate([[1, 2, 3]], jpaged.SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True,
                                                          logit_bias={z: 100}), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [z] * 8
    plain = llm.generate([[1, 2, 3]], jpaged.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    banned = llm.generate([[1, 2, 3]], jpaged.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                             logit_bias={plain.token_ids[0]: -100}),
                          use_tqdm=False)[0].outputs[0]
    assert banned.token_ids[0] != plain.token_ids[0]
    for field, kwargs in [("guided_regex", dict(guided_regex="(unclosed")),
                          ("guided_json", dict(guided_json={"type": "nonsense"})),
                          ("guided_json", dict(guided_json="{not json")),
                          ("logit_bias", dict(logit_bias={300: 1.0}))]:
        with pytest.raises(ValueError, match=rf"^{field}="):
            llm.generate([[1, 2]], jpaged.SamplingParams(**kwargs), use_tqdm=False)
    assert llm.stats()["num_waiting"] == 0
