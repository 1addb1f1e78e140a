"""Chat templates that tell a model which tools it may call, one per tool-call format of
serving/tool_calls.py, shipped with the package: `--chat-template hermes` (or llama3_json,
mistral) picks one by name, with `--enable-auto-tool-choice --tool-call-parser` of the same name.

Each renders the tools, earlier assistant turns' tool calls (in the format its parser reads) and
tool results, so a conversation goes on after a call. They are jpaged's own, written from each
format's public conventions:
- hermes: ChatML turns (SmolLM2, Qwen, Hermes); tools in <tools></tools>, calls in <tool_call>;
- llama3_json: Llama 3.1 headers; tools as JSON in the system turn, calls as
  {"name": ..., "parameters": ...}; results in "ipython" turns;
- mistral: [AVAILABLE_TOOLS], [TOOL_CALLS] and [TOOL_RESULTS] (the v0.3 tokenizer's tokens).
"""

import os

_DIR = os.path.dirname(os.path.abspath(__file__))
TOOL_CHAT_TEMPLATES = ("hermes", "llama3_json", "mistral")


def template_path(name: str) -> str:
    """The shipped template file of `name` (one of TOOL_CHAT_TEMPLATES)."""
    if name not in TOOL_CHAT_TEMPLATES:
        raise ValueError(f"no shipped chat template {name!r}; shipped: {', '.join(TOOL_CHAT_TEMPLATES)}")
    return os.path.join(_DIR, f"{name}.jinja")


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`'s value as a template: a shipped template's name, a file holding one, or
    the template itself (None: the tokenizer's). A value that is none of these (no Jinja in it)
    is an error naming the choices, not a template that renders its own text."""
    if value is None:
        return None
    if value in TOOL_CHAT_TEMPLATES:
        value = template_path(value)
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" not in value and "{%" not in value:
        raise ValueError(f"--chat-template {value!r:.80}: not a file, a Jinja template, or a shipped template's "
                         f"name ({', '.join(TOOL_CHAT_TEMPLATES)})")
    return value
