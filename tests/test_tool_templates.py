"""The tool chat templates shipped in serving/tool_templates/: each renders tools, an assistant's
tool calls and tool results, and the calls it renders read back through the --tool-call-parser of
the same name; `--chat-template NAME` finds them, and a wheel (`pip install .`) ships them."""

import glob
import json
import os
import random
import shutil
import string
import subprocess
import sys
import zipfile

import pytest

from jpaged.models.tiny import tiny_tokenizer
from serving import cli
from serving.tool_calls import TOOL_CALL_PARSERS, ToolCalling, split
from serving.tool_templates import TOOL_CHAT_TEMPLATES, load_chat_template, template_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What ends an assistant turn in each template (after it: the next turn).
END_OF_TURN = {"hermes": "<|im_end|>", "llama3_json": "<|eot_id|>", "mistral": "</s>"}


def random_tools(rng):
    return [{"type": "function", "function": {
        "name": f"tool_{i}_" + "".join(rng.choices(string.ascii_lowercase, k=5)),
        "description": "".join(rng.choices(string.ascii_letters + " ", k=20)),
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}} for i in range(rng.randint(1, 3))]


def conversation(rng, tools):
    """system, user, an assistant turn calling 1-3 tools (arguments as objects, as
    serving.protocol.parse_messages gives them), each call's result, and what the calls were."""
    calls = [(rng.choice(tools)["function"]["name"],
              {"city": "".join(rng.choices(string.ascii_letters + " \"'<>", k=rng.randint(1, 8))),
               "days": rng.randint(0, 9)}) for _ in range(rng.randint(1, 3))]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": f"call{i}", "type": "function", "function": {"name": n, "arguments": a}}
                    for i, (n, a) in enumerate(calls)]}]
    messages += [{"role": "tool", "tool_call_id": f"call{i}", "content": f"result {i}: {rng.random():.3f}"}
                 for i in range(len(calls))]
    return messages, calls


def render(tokenizer, name, messages, tools, add_generation_prompt):
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, chat_template=load_chat_template(name))


@pytest.mark.parametrize("name", TOOL_CHAT_TEMPLATES)
def test_each_template_renders_tools_calls_and_results_its_parser_reads(name):
    assert name in TOOL_CALL_PARSERS  # each template has its parser
    rng = random.Random()
    tokenizer = tiny_tokenizer()
    for _ in range(5):
        tools = random_tools(rng)
        messages, calls = conversation(rng, tools)
        n_before = 2  # system + user: the prompt the model answered with the calls
        prompt = render(tokenizer, name, messages[:n_before], tools, True)
        whole = render(tokenizer, name, messages, tools, True)
        for tool in tools:  # each tool's schema, as JSON
            assert json.dumps(tool["function"]["parameters"]) in prompt
        assert "Be brief." in prompt and "What is the weather?" in prompt
        # The generation prompt is where the model's turn starts: the rendered call follows it.
        assert whole.startswith(prompt), (prompt, whole)
        turn = whole[len(prompt):].split(END_OF_TURN[name])[0]
        parsed = split(turn, ToolCalling(None, parser=name), final=True)
        assert [(n, json.loads(a)) for n, a in parsed.calls] == calls, turn
        assert parsed.content.strip() == ""
        # Every result follows the calls, in order.
        positions = [whole.index(m["content"], len(prompt)) for m in messages[n_before + 1:]]
        assert positions == sorted(positions) and positions[0] > len(prompt) + len(turn)
        # Without tools: no tool instructions; the conversation is still rendered.
        plain = render(tokenizer, name, messages[:n_before], None, True)
        assert tools[0]["function"]["name"] not in plain and "What is the weather?" in plain


@pytest.mark.parametrize("name", TOOL_CHAT_TEMPLATES)
def test_streamed_calls_in_each_format_come_back_whole(name):
    """What a model writes after the generation prompt in each format, fed in pieces: the calls the
    stream adds up to are the calls written (mistral's parser is new with its template)."""
    from serving.tool_calls import StreamedCalls

    rng = random.Random()
    tokenizer = tiny_tokenizer()
    tools = random_tools(rng)
    messages, calls = conversation(rng, tools)
    prompt = render(tokenizer, name, messages[:2], tools, True)
    turn = render(tokenizer, name, messages[:3], tools, False)[len(prompt):].split(END_OF_TURN[name])[0]
    streamed, got = StreamedCalls(ToolCalling(None, parser=name)), {}
    cuts = sorted(rng.sample(range(1, len(turn)), min(10, len(turn) - 1)))
    pieces = [turn[a:b] for a, b in zip([0, *cuts], [*cuts, len(turn)])]
    for i, piece in enumerate(pieces):
        delta, _ = streamed.delta(piece, "stop" if i == len(pieces) - 1 else None)
        assert not delta.get("content", "").strip(), delta
        for call in delta.get("tool_calls", []):
            entry = got.setdefault(call["index"], [call["function"].get("name"), ""])
            entry[1] += call["function"]["arguments"]
    assert [(n, json.loads(a)) for n, a in (got[i] for i in sorted(got))] == calls


def test_chat_template_names_files_and_errors(tmp_path):
    assert load_chat_template(None) is None
    for name in TOOL_CHAT_TEMPLATES:
        with open(template_path(name)) as f:
            assert load_chat_template(name) == f.read()
    own = tmp_path / "own.jinja"
    own.write_text("{{ messages[0].content }}")
    assert load_chat_template(str(own)) == "{{ messages[0].content }}"
    assert load_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{% for")
    with pytest.raises(ValueError, match="not a file, a Jinja template, or a shipped template's name "
                                         r"\(hermes, llama3_json, mistral\)"):
        load_chat_template("hermes2")
    # The command line says so before loading a model: one line, exit status 2.
    assert cli.main(["serve", "--chat-template", str(tmp_path / "missing.jinja")]) == 2


def test_a_wheel_ships_the_templates(tmp_path):
    """`pip install .` (not editable) installs the templates: they are package data of the wheel."""
    src = tmp_path / "src"
    for name in ("jpaged", "serving", "pallas_kernels"):
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    names = zipfile.ZipFile(glob.glob(str(tmp_path / "dist" / "*.whl"))[0]).namelist()
    for name in TOOL_CHAT_TEMPLATES:
        assert f"serving/tool_templates/{name}.jinja" in names
