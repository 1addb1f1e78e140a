"""Server flags that change what a prompt holds or what `usage` reports, as vLLM's do:
--enable-prompt-tokens-details (usage.prompt_tokens_details.cached_tokens, with prefix caching)
and --exclude-tools-when-tool-choice-none. Cached counts are checked against the block rule
worked out here (full blocks of the shared prefix, never the last token's block); prompts against
the chat template rendered here with transformers."""

import asyncio
import json
import random

import aiohttp
import openai
import pytest
from test_server import Server

from jpaged.models import tiny

SEED = 20261124
BS = 16
# tiny's template with the tools first, as tool-aware templates write them.
TOOLS_TEMPLATE = ("{% if tools %}<|tools|>\n{{ tools | tojson }}{{ eos_token }}\n{% endif %}"
                  + tiny.CHAT_TEMPLATE)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    s = Server("--max-num-seqs", "8", "--max-model-len", "512", "--enforce-eager", "--block-size", str(BS),
               "--enable-prefix-caching", "--enable-prompt-tokens-details", "--exclude-tools-when-tool-choice-none",
               "--chat-template", str(template))
    yield s
    assert s.stop() == 0, "".join(s.log[-30:])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def expected_hits(num_shared: int, num_tokens: int) -> int:
    """Tokens a prompt of `num_tokens` finds cached when its first `num_shared` equal a computed
    prompt's: whole blocks only, and never the block of its last token (computed for the logits)."""
    return min(num_shared // BS, (num_tokens - 1) // BS) * BS


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))


def test_cached_tokens_in_usage(client):
    rng = random.Random(SEED)
    print("seed", SEED)
    text = random_text(rng, 70)  # tiny: one token per byte, after <s>
    first = client.completions.create(model="tiny", prompt=text, max_tokens=3, temperature=0)
    num_tokens = first.usage.prompt_tokens
    assert num_tokens == 71 and first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model="tiny", prompt=text, max_tokens=3, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == expected_hits(num_tokens, num_tokens) == 64
    assert again.choices[0].text == first.choices[0].text
    # 40 equal characters (41 tokens with <s>), then a different one: two whole blocks.
    other = text[:40] + ("b" if text[40] == "a" else "a") + random_text(rng, 9)
    partial = client.completions.create(model="tiny", prompt=other, max_tokens=3, temperature=0)
    assert partial.usage.prompt_tokens_details.cached_tokens == expected_hits(41, 51) == 32
    # Several prompts: their hits add up, as their prompt tokens do.
    both = client.completions.create(model="tiny", prompt=[text, other, random_text(rng, 30)], max_tokens=2)
    assert both.usage.prompt_tokens == 71 + 51 + 31
    assert both.usage.prompt_tokens_details.cached_tokens == 64 + expected_hits(51, 51)
    # Prompt logprobs come from computing the prompt: no hits.
    echoed = client.completions.create(model="tiny", prompt=text, max_tokens=1, echo=True, logprobs=1)
    assert echoed.usage.prompt_tokens_details.cached_tokens == 0


def test_cached_tokens_in_streamed_chat_and_responses(server, client):
    rng = random.Random(SEED + 1)
    messages = [{"role": "user", "content": random_text(rng, 60)}]

    def streamed_usage():
        chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, stream=True,
                                                     stream_options={"include_usage": True}))
        assert all(c.usage is None for c in chunks[:-1])
        return chunks[-1].usage

    first, second = streamed_usage(), streamed_usage()
    assert first.prompt_tokens_details.cached_tokens == 0
    assert second.prompt_tokens_details.cached_tokens == expected_hits(second.prompt_tokens, second.prompt_tokens)
    assert second.prompt_tokens_details.cached_tokens > 0
    # The Responses API reports them always (input_tokens_details), the same messages' blocks.
    r = client.responses.create(model="tiny", input=messages[0]["content"], max_output_tokens=3)
    assert r.usage.input_tokens == second.prompt_tokens
    assert r.usage.input_tokens_details.cached_tokens == second.prompt_tokens_details.cached_tokens


def prompt_tokens(messages, tools=None) -> int:
    tokenizer = tiny.tiny_tokenizer()
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                         chat_template=TOOLS_TEMPLATE)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_tool_choice_none_leaves_the_tools_out(server, client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    with_tools, without = prompt_tokens(messages, TOOLS), prompt_tokens(messages)
    assert with_tools > without + 50  # the template renders them
    none = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none",
                                          max_tokens=2)
    assert none.usage.prompt_tokens == without and none.choices[0].message.tool_calls is None
    required = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="required",
                                              max_tokens=40)
    assert required.usage.prompt_tokens == with_tools
    flat = [{"type": "function", **TOOLS[0]["function"]}]
    r = client.responses.create(model="tiny", input=messages[0]["content"], tools=flat, tool_choice="none",
                                max_output_tokens=2)
    assert r.usage.input_tokens == without and r.tool_choice == "none"

    async def tokenize():  # /tokenize renders what chat would
        async with aiohttp.ClientSession() as session:
            async with session.post(server.url + "/tokenize", json={"messages": messages, "tools": TOOLS,
                                                                     "tool_choice": "none"}) as resp:
                return resp.status, json.loads(await resp.text())

    status, body = asyncio.run(tokenize())
    assert status == 200 and body["count"] == without, body
    assert not any("does not render 'tools'" in line for line in server.log)
