"""Speculative decoding with LoRA adapters (n-gram and draft model): the outputs of a batch that
mixes two adapters and the base model equal those without speculation, greedy and seeded.

The n-gram drafts come from an oracle (tests/test_spec_decode.py's `draft_from`: the outputs
without speculation, some tokens wrong), so acceptance and rejection both happen. The draft
model is the base checkpoint without adapters: its drafts agree with the base requests and
often not with the adapted ones; verification keeps the target's (adapted) draws either way."""

import numpy as np
import pytest

import hf_reference
import jpaged
from jpaged import LoRARequest
from test_spec_decode import draft_from

SEED = 20261125
VOCAB = 259
ADAPTERS = {"attn-r4": (4, 8, ["q_proj", "v_proj"]), "all-r8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                         "gate_proj", "up_proj", "down_proj"])}
LIMITS = dict(max_model_len=96, max_num_seqs=8, max_num_batched_tokens=64, enable_lora=True, max_loras=2,
              max_lora_rank=8, enforce_eager=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import peft
    import transformers

    root = tmp_path_factory.mktemp("spec-lora")
    hf_reference.save_random_llama(root / "base", SEED, num_hidden_layers=2)
    adapters = {}
    for name, (rank, alpha, modules) in ADAPTERS.items():
        base = transformers.LlamaForCausalLM.from_pretrained(root / "base")
        lora = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules,
                                                         init_lora_weights=False))
        lora.save_pretrained(root / name)
        adapters[name] = str(root / name)
    return str(root / "base"), adapters


def batch(adapters, rng):
    names = [None, *ADAPTERS, None, *ADAPTERS]
    prompts = [[int(f)] + rng.integers(0, VOCAB, int(n)).tolist()
               for f, n in zip(rng.permutation(VOCAB)[:len(names)], rng.integers(3, 12, len(names)))]
    requests = [None if name is None else LoRARequest(name, list(ADAPTERS).index(name) + 1, adapters[name])
                for name in names]
    return prompts, requests


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_with_lora_equals_without(checkpoint, method, monkeypatch):
    base_dir, adapters = checkpoint
    rng = np.random.default_rng(SEED)
    prompts, requests = batch(adapters, rng)
    greedy = jpaged.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = [jpaged.SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True, seed=100 + i)
              for i in range(len(prompts))]
    plain = jpaged.LLM(base_dir, **LIMITS)
    expected = {name: [o.outputs[0].token_ids for o in plain.generate(prompts, sp, lora_request=requests,
                                                                      use_tqdm=False)]
                for name, sp in (("greedy", greedy), ("seeded", seeded))}
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 3}
        # Oracle drafts: each request's outputs without speculation, some tokens wrong.
        draft_from(monkeypatch, [(p, list(o)) for p, o in zip(prompts + prompts, expected["greedy"]
                                                                 + expected["seeded"])], rng)
    else:
        spec = {"method": "draft_model", "model": base_dir, "num_speculative_tokens": 3}
    llm = jpaged.LLM(base_dir, speculative_config=spec, **LIMITS)
    for name, sp in (("greedy", greedy), ("seeded", seeded)):
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, lora_request=requests, use_tqdm=False)]
        assert got == expected[name], name
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"]  # rejections too
