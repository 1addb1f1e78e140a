"""Multi-LoRA against HF transformers + PEFT: a random tiny Llama checkpoint, three PEFT adapters
of different ranks and target modules (random A and B, so each changes the output), one
`generate` call mixing them with the base model under max_loras=2. Greedy tokens must equal
PEFT's, token for token."""

import json

import numpy as np
import pytest

import hf_reference
import jpaged
from jpaged import LoRARequest

SEED = 20261124
VOCAB = 259  # the tiny tokenizer's (saved with the base checkpoint: the server needs one)
ADAPTERS = {  # name: (rank, alpha, target modules, rsLoRA)
    "attn-r4": (4, 8, ["q_proj", "v_proj"], False),
    "all-r8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "mlp-r16-rs": (16, 4, ["gate_proj", "down_proj", "up_proj"], True),
}
LIMITS = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, enable_lora=True, max_loras=2,
              max_lora_rank=16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(base model directory, {adapter name: directory}), written by transformers and PEFT."""
    import peft
    import transformers

    root = tmp_path_factory.mktemp("lora")
    hf_reference.save_random_llama(root / "base", SEED, num_hidden_layers=3)
    adapters = {}
    for name, (rank, alpha, modules, rslora) in ADAPTERS.items():
        base = transformers.LlamaForCausalLM.from_pretrained(root / "base")
        lora = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules,
                                                         use_rslora=rslora, init_lora_weights=False))
        lora.save_pretrained(root / name)
        adapters[name] = str(root / name)
    return str(root / "base"), adapters


def peft_greedy(base_dir, adapter_dir, prompt, max_tokens):
    import peft
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():  # greedy by hand: no token banned, nothing stops it (jpaged's ignore_eos)
        for _ in range(max_tokens):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, len(prompt):].tolist()


def test_mixed_adapters_equal_peft(checkpoint):
    base_dir, adapters = checkpoint
    rng = np.random.default_rng(SEED)
    print("seed", SEED)
    names = [None, *ADAPTERS, None, *ADAPTERS]
    prompts = [rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(3, 20, len(names))]
    requests = [None if name is None else LoRARequest(name, i + 1, adapters[name])
                for name in names for i in [list(ADAPTERS).index(name) if name else 0]]
    max_tokens = 10
    from test_compilation import CompileRecorder

    # Warmed up on return: the recorder hears every compile in the process, a background warm-up's too.
    llm = jpaged.LLM(base_dir, background_warmup=False, **LIMITS)
    sp = jpaged.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with CompileRecorder() as recorder:  # jax's own compile events: loading and swapping adapters compiles nothing
        outputs = llm.generate(prompts, sp, lora_request=requests, use_tqdm=False)
        llm.llm_engine.lora_manager.remove(1)  # unloaded, then loaded again into a slot another adapter held
        again = llm.generate(prompts[1:2], sp, lora_request=requests[1:2], use_tqdm=False)[0].outputs[0].token_ids
    assert recorder.events == [], recorder.events
    ours = [o.outputs[0].token_ids for o in outputs]
    expected = [peft_greedy(base_dir, None if name is None else adapters[name], prompt, max_tokens)
                for name, prompt in zip(names, prompts)]
    for name, got, want in zip(names, ours, expected):
        print(name, got, want)
    assert ours == expected and again == expected[1]
    # Each adapter changes the output: the test would see an adapter applied wrongly or not at all.
    base_only = [peft_greedy(base_dir, None, prompt, max_tokens) for prompt in prompts]
    assert all(a != b for name, a, b in zip(names, expected, base_only) if name is not None)
    assert llm.llm_engine.lora_manager.num_slot_writes >= 3  # 3 adapters through 2 slots


def test_prefix_cache_keeps_adapters_apart(checkpoint):
    """The same prompt under two adapters and the base model: no block is shared between them
    (each adapter's K/V differs), while the same adapter twice hits its own cached blocks."""
    base_dir, adapters = checkpoint
    prompt = list(range(1, 40))
    # Eager: compiles the few shapes it runs, not a whole warm-up (no test here of warm-up).
    llm = jpaged.LLM(base_dir, enable_prefix_caching=True, block_size=8, enforce_eager=True, **LIMITS)
    sp = jpaged.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a = LoRARequest("attn-r4", 1, adapters["attn-r4"])
    b = LoRARequest("all-r8", 2, adapters["all-r8"])
    outs = {}
    for label, lora in (("base", None), ("a", a), ("b", b)):
        before = llm.stats()["prefix_cache_hits"]
        outs[label] = llm.generate([prompt], sp, lora_request=lora, use_tqdm=False)[0].outputs[0].token_ids
        assert llm.stats()["prefix_cache_hits"] == before, f"{label} hit another adapter's blocks"
    before = llm.stats()["prefix_cache_hits"]
    again = llm.generate([prompt], sp, lora_request=a, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.stats()["prefix_cache_hits"] > before and again == outs["a"]
    assert outs["a"] == peft_greedy(base_dir, adapters["attn-r4"], prompt, 6)


def test_bad_adapters_are_value_errors(checkpoint, tmp_path):
    base_dir, adapters = checkpoint
    llm = jpaged.LLM(base_dir, **dict(LIMITS, max_lora_rank=8), enforce_eager=True)  # eager: no warm-up to test
    sp = jpaged.SamplingParams(max_tokens=2)
    bad_json = tmp_path / "bad-json"
    bad_json.mkdir()
    (bad_json / "adapter_config.json").write_text("{not json")
    dora = tmp_path / "dora"
    dora.mkdir()
    with open(f"{adapters['attn-r4']}/adapter_config.json") as f:
        config = json.load(f)
    (dora / "adapter_config.json").write_text(json.dumps(dict(config, use_dora=True)))
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "adapter_config.json").write_text(json.dumps(config))
    (truncated / "adapter_model.safetensors").write_bytes(
        open(f"{adapters['attn-r4']}/adapter_model.safetensors", "rb").read()[:100])
    cases = [
        (LoRARequest("big", 1, adapters["mlp-r16-rs"]), r"r=16.*max_lora_rank=8"),
        (LoRARequest("missing", 2, str(tmp_path / "nowhere")), r"lora_path=.*nowhere"),
        (LoRARequest("json", 3, str(bad_json)), r"not valid JSON"),
        (LoRARequest("dora", 4, str(dora)), r"use_dora"),
        (LoRARequest("cut", 5, str(truncated)), r"cannot be read"),
    ]
    for lora, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate([[1, 2, 3]], sp, lora_request=lora, use_tqdm=False)
    # The engine goes on serving, adapters and base alike.
    ok = LoRARequest("attn-r4", 6, adapters["attn-r4"])
    assert len(llm.generate([[1, 2, 3]], sp, lora_request=ok, use_tqdm=False)[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="already names adapter"):
        llm.generate([[1, 2]], sp, lora_request=LoRARequest("other", 6, adapters["all-r8"]), use_tqdm=False)
    with pytest.raises(ValueError, match="enable_lora"):
        jpaged.LLM(base_dir, max_model_len=64, enforce_eager=True).generate([[1]], sp, lora_request=ok)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "p")


def test_server_serves_adapters_through_the_openai_sdk(checkpoint, tmp_path):
    """--lora-modules (both forms), /v1/models, a request's model picking its adapter, adapters
    loaded and unloaded at run time behind --api-key, and every bad adapter a 4xx while the
    server goes on serving."""
    import httpx
    import openai

    from test_server import Server

    base_dir, adapters = checkpoint
    offline = jpaged.LLM(base_dir, **LIMITS)
    sp = jpaged.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    expected = {name: offline.generate([prompt], sp, use_tqdm=False,
                                       lora_request=LoRARequest(name, i + 1, path) if path else None)[0].outputs[0].text
                for i, (name, path) in enumerate([("base", None), *adapters.items()])}
    server = Server("--model", base_dir, "--served-model-name", "base", "--enable-lora", "--max-loras", "2",
                    "--max-lora-rank", "16", "--api-key", "k", "--max-model-len", "128", "--max-num-seqs", "8",
                    "--max-num-batched-tokens", "64", "--enforce-eager", "--enable-lora-runtime-updates",
                    "--lora-modules", f"attn-r4={adapters['attn-r4']}",
                    json.dumps({"name": "all-r8", "path": adapters["all-r8"], "base_model_name": "base"}))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="k")
        models = {m.id: m for m in client.models.list()}
        assert set(models) == {"base", "attn-r4", "all-r8"}
        assert getattr(models["attn-r4"], "parent", None) == "base" and getattr(models["base"], "parent", None) is None

        def complete(model):
            response = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                                 extra_body={"ignore_eos": True})
            assert response.model == model  # the adapter's name, as vLLM answers
            return response.choices[0].text

        for name in ("base", "attn-r4", "all-r8"):
            assert complete(name) == expected[name], name
        with pytest.raises(openai.NotFoundError):
            complete("mlp-r16-rs")

        def post(path, body, key="k"):
            return httpx.post(f"{server.url}/v1/{path}", json=body, headers={"Authorization": f"Bearer {key}"},
                              timeout=120)

        assert post("load_lora_adapter", {"lora_name": "mlp-r16-rs", "lora_path": adapters["mlp-r16-rs"]},
                    key="wrong").status_code == 401
        assert post("load_lora_adapter", {"lora_name": "mlp-r16-rs", "lora_path": adapters["mlp-r16-rs"]}).status_code == 200
        assert complete("mlp-r16-rs") == expected["mlp-r16-rs"]  # three adapters through two slots
        assert complete("attn-r4") == expected["attn-r4"]
        bad_dir = tmp_path / "bad"
        bad_dir.mkdir()
        (bad_dir / "adapter_config.json").write_text("{}")
        too_big = tmp_path / "rank-32"
        too_big.mkdir()
        with open(f"{adapters['attn-r4']}/adapter_config.json") as f:
            (too_big / "adapter_config.json").write_text(json.dumps(dict(json.load(f), r=32)))
        for body, status in [({"lora_name": "again", "lora_path": str(tmp_path / "missing")}, 400),
                             ({"lora_name": "again", "lora_path": str(too_big)}, 400),
                             ({"lora_name": "again", "lora_path": str(bad_dir)}, 400),
                             ({"lora_name": "attn-r4", "lora_path": adapters["attn-r4"]}, 400),
                             ({"lora_name": "again"}, 400)]:
            response = post("load_lora_adapter", body)
            assert response.status_code == status and "error" in response.json(), (body, response.text)
        assert post("unload_lora_adapter", {"lora_name": "attn-r4"}).status_code == 200
        assert post("unload_lora_adapter", {"lora_name": "attn-r4"}).status_code == 404
        with pytest.raises(openai.NotFoundError):
            complete("attn-r4")
        assert {m.id for m in client.models.list()} == {"base", "all-r8", "mlp-r16-rs"}
        assert complete("all-r8") == expected["all-r8"] and complete("base") == expected["base"]
        chunks = list(client.chat.completions.create(model="all-r8", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=4, stream=True))
        assert chunks and all(c.model == "all-r8" for c in chunks)
    finally:
        assert server.stop() == 0


def test_tensor_parallel_equals_one_device(checkpoint):
    """A and B split with their base weights on a 2-device mesh (the CPU's fake devices; kv heads
    2 and q heads 4 split, MLP split): the same greedy tokens as on one device."""
    base_dir, adapters = checkpoint
    rng = np.random.default_rng(SEED + 1)
    names = [None, *ADAPTERS]
    prompts = [rng.integers(0, VOCAB, 9).tolist() for _ in names]
    requests = [None if name is None else LoRARequest(name, i + 1, adapters[name]) for i, name in enumerate(names)]
    sp = jpaged.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = []
    for tp in (1, 2):
        llm = jpaged.LLM(base_dir, tensor_parallel_size=tp, enforce_eager=True, **LIMITS)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, lora_request=requests, use_tqdm=False)])
    assert runs[0] == runs[1]
