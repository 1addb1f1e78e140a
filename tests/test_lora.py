"""Multi-LoRA against HF transformers + PEFT: a random tiny Llama checkpoint, three PEFT adapters
of different ranks and target modules (random A and B, so each changes the output), one
`generate` call mixing them with the base model under max_loras=2. Greedy tokens must equal
PEFT's, token for token."""

import json

import numpy as np
import pytest

import jpaged
from jpaged import LoRARequest

SEED = 20261124
VOCAB = 300
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
    import torch
    import transformers

    torch.manual_seed(SEED)
    root = tmp_path_factory.mktemp("lora")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # sharper logits: greedy choices far apart, stable across float orders
        model.lm_head.weight.mul_(8)
    model.save_pretrained(root / "base")
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
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_mixed_adapters_equal_peft(checkpoint):
    base_dir, adapters = checkpoint
    rng = np.random.default_rng(SEED)
    print("seed", SEED)
    names = [None, *ADAPTERS, None, *ADAPTERS]
    prompts = [rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(3, 20, len(names))]
    requests = [None if name is None else LoRARequest(name, i + 1, adapters[name])
                for name in names for i in [list(ADAPTERS).index(name) if name else 0]]
    max_tokens = 10
    llm = jpaged.LLM(base_dir, **LIMITS)
    compiled = llm.stats()["num_compilations"]
    outputs = llm.generate(prompts, jpaged.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           lora_request=requests, use_tqdm=False)
    assert llm.stats()["num_compilations"] == compiled, "loading adapters compiled something"
    ours = [o.outputs[0].token_ids for o in outputs]
    expected = [peft_greedy(base_dir, None if name is None else adapters[name], prompt, max_tokens)
                for name, prompt in zip(names, prompts)]
    for name, got, want in zip(names, ours, expected):
        print(name, got, want)
    assert ours == expected
    # Each adapter changes the output: the test would see an adapter applied wrongly or not at all.
    base_only = [peft_greedy(base_dir, None, prompt, max_tokens) for prompt in prompts]
    assert all(a != b for name, a, b in zip(names, expected, base_only) if name is not None)
    assert llm.llm_engine.lora_manager.num_slot_writes >= 3  # 3 adapters through 2 slots


def test_prefix_cache_keeps_adapters_apart(checkpoint):
    """The same prompt under two adapters and the base model: no block is shared between them
    (each adapter's K/V differs), while the same adapter twice hits its own cached blocks."""
    base_dir, adapters = checkpoint
    prompt = list(range(1, 40))
    llm = jpaged.LLM(base_dir, enable_prefix_caching=True, block_size=8, **LIMITS)
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
    llm = jpaged.LLM(base_dir, **dict(LIMITS, max_lora_rank=8))
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
