"""Structured output offline: completions follow their JSON schema, regex or choice whatever the
model (tiny's random weights never would by themselves), with parallel samples, under preemption,
beside unguided requests; logit_bias moves the sampled tokens; bad grammars are ValueErrors."""

import functools
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


# ------------------------------------------------------------------ hostile grammars
def _all_of(letters: int) -> dict:
    """A 100-byte-per-letter schema llguidance takes exponential time on (21 letters: 87 s, 1 GB)."""
    return {"type": "string", "allOf": [{"pattern": f".*{chr(97 + i)}.*"} for i in range(letters)]}


REF_CYCLE = {"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                                                  "required": ["x"]}}}
REFUSED = [  # (kwargs, field, what the message must say)
    (dict(guided_json=_all_of(21)), "guided_json", "grammar_compile_timeout=2 s"),
    (dict(guided_choice=[str(i) for i in range(100_000)]), "guided_choice", "MAX_ALTERNATIVES"),
    (dict(guided_json={"enum": list(range(100_000))}), "guided_json", "MAX_ALTERNATIVES"),
    (dict(guided_json={"anyOf": [{"const": i} for i in range(2000)]}), "guided_json", "MAX_ALTERNATIVES"),
    (dict(guided_json={"type": "object", "patternProperties": {f"^k{i}[a-z]*$": {} for i in range(1000)}}),
     "guided_json", "MAX_PATTERNS"),
    (dict(guided_json={"type": "string", "description": "x" * 200_000}), "guided_json", "MAX_GRAMMAR_BYTES"),
    (dict(guided_regex="a" * 200_000), "guided_regex", "MAX_GRAMMAR_BYTES"),
    (dict(guided_json='{"items":' * 5000 + "{}" + "}" * 5000), "guided_json", "MAX_SCHEMA_DEPTH"),
    (dict(guided_json=functools.reduce(lambda inner, _: {"items": inner}, range(100), {})), "guided_json",
     "MAX_SCHEMA_DEPTH"),
    (dict(guided_json={"type": "integer", "maximum": 10**20}), "guided_json", "64-bit"),
    (dict(guided_json={"type": "integer", "minimum": -(2**64), "maximum": 0}), "guided_json", "64-bit"),
    (dict(guided_json={"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 1e300}}}),
     "guided_json", "64-bit"),
    (dict(guided_json=REF_CYCLE), "guided_json", "no finite value"),
    (dict(guided_json={"type": "array", "items": {"$ref": "#"}, "minItems": 1}), "guided_json", "no finite value"),
    (dict(guided_regex=r"[^\x00-\U0010FFFF]"), "guided_regex", "not a valid grammar"),  # matches nothing
    (dict(guided_regex=""), "guided_regex", "only an empty completion"),
    (dict(guided_regex="a(?!b)"), "guided_regex", "look-around"),
]


def test_hostile_grammars_are_refused_naming_the_field_and_the_limit():
    """Each grammar that froze the server, or came back silently wrong, is a ValueError naming the
    field and the limit, within the compile budget; the worker that was killed comes back, and a
    sane grammar still works."""
    import time

    llm = jpaged.LLM("tiny", num_gpu_blocks_override=32, grammar_compile_timeout=2, **LIMITS)
    for kwargs, field, reason in REFUSED:
        start = time.monotonic()
        with pytest.raises(ValueError) as e:
            llm.generate([[1, 2]], jpaged.SamplingParams(max_tokens=4, **kwargs), use_tqdm=False)
        message = str(e.value)
        print(f"{time.monotonic() - start:.2f} s: {message[:160]}")
        assert message.startswith(f"{field}=") and reason in message, message
        assert "<state>" not in message and "backtrace" not in message and len(message) < 600
    out = llm.generate([[1, 2]], jpaged.SamplingParams(temperature=1.0, max_tokens=10, guided_regex="[0-9]{4}"),
                       use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[0-9]{4}", out.text) and out.finish_reason == "stop"
    assert llm.stats()["num_free_gpu_blocks"] == llm.stats()["num_gpu_blocks"]


def test_grammar_compile_memory_bound():
    """A grammar whose compile grows past grammar_compile_memory is refused as such (the worker is
    killed by its address-space limit, not the serving process), then the next grammar compiles."""
    llm = jpaged.LLM("tiny", num_gpu_blocks_override=32, grammar_compile_timeout=120, grammar_compile_memory=128,
                     **LIMITS)
    with pytest.raises(ValueError, match=r"^guided_json=.*grammar_compile_memory=128 MiB"):
        llm.generate([[1, 2]], jpaged.SamplingParams(max_tokens=4, guided_json=_all_of(19)), use_tqdm=False)
    out = llm.generate([[1, 2]], jpaged.SamplingParams(temperature=1.0, max_tokens=10, guided_choice=["ab", "cd"]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text in ("ab", "cd")


def test_grammar_engine_error_during_generation_ends_with_an_error():
    """`a{1000}{1000}` compiles, then the grammar engine gives up at the first token (its lexer
    builds too many expressions): every sample ends with finish_reason "error" and the engine's
    message, and no text the grammar did not vouch for ("a" with "stop" before)."""
    llm = jpaged.LLM("tiny", num_gpu_blocks_override=32, **LIMITS)
    outs = llm.generate([[1, 2], [3, 4, 5]], [jpaged.SamplingParams(temperature=1.0, n=2, max_tokens=8,
                                                                    guided_regex="a{1000}{1000}"),
                                              jpaged.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)],
                        use_tqdm=False)
    for c in outs[0].outputs:
        assert c.finish_reason == "error" and "lexer" in c.stop_reason and "<" not in c.stop_reason, c
        assert set(c.text) <= {"a"}
    assert len(outs[1].outputs[0].token_ids) == 8 and outs[1].outputs[0].finish_reason == "length"
    assert llm.llm_engine.structured_output._matchers == {} and llm.llm_engine.structured_output._errors == {}
    assert llm.stats()["num_free_gpu_blocks"] == llm.stats()["num_gpu_blocks"]


@pytest.mark.parametrize("schema, finite", [
    (REF_CYCLE, False),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}}}}, True),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": "#/$defs/a"},
                                                                         "minItems": 1}]}}}, True),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/b"}, "minItems": 2},
                                     "b": {"type": "object", "properties": {"y": {"$ref": "#/$defs/a"}},
                                           "required": ["y"]}}}, False),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/a"}}}}, True),
    ({"type": "object", "properties": {"self": {"$ref": "#"}}, "required": ["self"]}, False),
    ({"type": ["object", "null"], "properties": {"self": {"$ref": "#"}}, "required": ["self"]}, True),
    ({"definitions": {"t": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/definitions/t"}}},
                            "required": ["c"]}}, "$ref": "#/definitions/t"}, True),
    ({"$ref": "https://example.com/schema.json"}, True),
])
def test_finite_instance_check(schema, finite):
    from jpaged.core.structured_output import _has_finite_instance

    assert _has_finite_instance(schema) is finite


def test_compiled_grammars_are_bounded_by_bytes(monkeypatch):
    """The compiled-grammar cache holds at most MAX_CACHED_GRAMMAR_BYTES, by what each compile
    took, least recently used out first; an evicted grammar compiles again when used."""
    from jpaged.core import structured_output

    llm = jpaged.LLM("tiny", num_gpu_blocks_override=32, **LIMITS)
    manager = llm.llm_engine.structured_output
    for i in (1, 2):
        manager.prepare(jpaged.SamplingParams(guided_regex=f"[0-9]{{{i}}}"))
    cost = min(c for _, c in manager._compiled.values())
    assert cost > 0 and manager._compiled_bytes == sum(c for _, c in manager._compiled.values())
    monkeypatch.setattr(structured_output, "MAX_CACHED_GRAMMAR_BYTES", 3 * cost)
    for i in range(3, 13):
        manager.prepare(jpaged.SamplingParams(guided_regex=f"[0-9]{{{i}}}"))
        assert manager._compiled_bytes <= 3 * cost or len(manager._compiled) == 1
    assert len(manager._compiled) < 12 and ("guided_regex", "[0-9]{1}") not in manager._compiled
    assert ("guided_regex", "[0-9]{12}") in manager._compiled
    out = llm.generate([[1]], jpaged.SamplingParams(temperature=1.0, max_tokens=4, guided_regex="[0-9]{1}"),
                       use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[0-9]", out.text)


def test_grammar_worker_starts_with_its_modules_only_on_pythonpath(tmp_path):
    """The worker runs isolated (`python -I`, which drops PYTHONPATH), yet starts where jpaged is
    importable only through PYTHONPATH (a checkout) and llguidance and numpy only through a
    `pip install --target DIR` tree on it, as on the first GPU machine: here an interpreter with an
    empty site-packages (a new venv), PYTHONPATH=<checkout>:<target>, the target holding links to
    this interpreter's llguidance and numpy."""
    import importlib.util
    import os
    import subprocess
    import sys
    import venv
    from pathlib import Path

    from jpaged.core.structured_output import StructuredOutputManager
    from jpaged.models.tiny import tiny_tokenizer

    target = tmp_path / "target"
    target.mkdir()
    for name in ("llguidance", "numpy"):
        site = Path(importlib.util.find_spec(name).submodule_search_locations[0]).parent
        for entry in site.glob(f"{name}*"):  # the package, its dist-info, numpy.libs (its BLAS)
            (target / entry.name).symlink_to(entry)
    venv.create(tmp_path / "venv", with_pip=False)
    python = tmp_path / "venv" / "bin" / "python"
    bare = subprocess.run([python, "-c", "import llguidance"], capture_output=True, text=True, timeout=60)
    assert bare.returncode != 0 and "No module named 'llguidance'" in bare.stderr  # only the target has it

    tokenizer = tiny_tokenizer()
    args = tmp_path / "tokenizer.json"
    args.write_text(json.dumps(StructuredOutputManager(tokenizer, len(tokenizer))._tokenizer_args))
    script = ("import json, sys\n"
              "from jpaged.core.grammar_worker import GrammarWorker\n"
              "worker = GrammarWorker(tuple(json.load(open(sys.argv[1]))), timeout=60, memory_mib=1024)\n"
              "grammar, cost, only_empty = worker.check('guided_regex', '[0-9]{4}')\n"
              "print('compiled', cost > 0, only_empty)\n"
              "try:\n"
              "    worker.check('guided_regex', 'a(?!b)')\n"
              "except ValueError as e:\n"
              "    print('refused', e)\n")
    checkout = Path(__file__).parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PYTHONPATH"] = f"{checkout}{os.pathsep}{target}"
    done = subprocess.run([python, "-c", script, str(args)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled True False" in done.stdout and "refused not a valid grammar" in done.stdout, done.stdout
