"""Speculative decoding with LoRA adapters (n-gram, draft model, EAGLE): the outputs of a batch
that mixes two adapters and the base model equal those without speculation, greedy and seeded.

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
K_LORA = 3  # an EAGLE head's drafts per step
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


def outputs_without_speculation(base_dir, prompts, requests):
    """Greedy and per-request seeded sampling params, and each one's token ids with no speculation."""
    greedy = jpaged.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = [jpaged.SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True, seed=100 + i)
              for i in range(len(prompts))]
    plain = jpaged.LLM(base_dir, **LIMITS)
    expected = {name: [o.outputs[0].token_ids for o in plain.generate(prompts, sp, lora_request=requests,
                                                                      use_tqdm=False)]
                for name, sp in (("greedy", greedy), ("seeded", seeded))}
    return greedy, seeded, expected


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_with_lora_equals_without(checkpoint, method, monkeypatch):
    base_dir, adapters = checkpoint
    rng = np.random.default_rng(SEED)
    prompts, requests = batch(adapters, rng)
    greedy, seeded, expected = outputs_without_speculation(base_dir, prompts, requests)
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


def adapted_float64(base_dir, adapter_dir):
    """The base model with the adapter merged (PEFT, float32), in float64: the reference's target."""
    import peft
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    return model.double().eval()


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_eagle_with_lora_reads_the_adapted_hidden_states(checkpoint, method, tmp_path):
    """An EAGLE head (EAGLE-3's layout, or EAGLE-1/2's) on a batch mixing two adapters and the
    base model: the outputs (greedy and seeded) equal those without speculation, and every
    proposal equals a float64 head's over the hidden states of the request's own adapted model
    (PEFT, merged); over the base model's hidden states the adapted requests' proposals mostly
    differ (the check would see a head reading those)."""
    import torch

    from eagle3_head import ReferenceEagleHead, ReferenceHead, write_eagle_head, write_head
    from jpaged.models.loader import read_hf_config
    from test_eagle3 import record_drafts

    base_dir, adapters = checkpoint
    print("seed", SEED)
    rng = np.random.default_rng(SEED)
    prompts, requests = batch(adapters, rng)
    aux_layers = (0, 1, 1)  # EAGLE-3's: the base has 2 layers (the embeddings; layer 1's input, after layer 0's LoRA)
    if method == "eagle3":
        head = write_head(tmp_path / "head", read_hf_config(base_dir), seed=SEED, aux_layers=aux_layers)
    else:
        head = write_eagle_head(tmp_path / "head", read_hf_config(base_dir), seed=SEED)
    greedy, seeded, expected = outputs_without_speculation(base_dir, prompts, requests)
    full = [p + list(o) for p, o in zip(prompts, expected["greedy"])]

    def oracle(tokens):  # the greedy continuation (the seeded runs: whatever follows, often wrong)
        whole = next((f for f in full if f[:len(tokens)] == tokens), tokens)
        return whole[len(tokens):] or [0] * K_LORA

    llm = jpaged.LLM(base_dir, speculative_config={"method": method, "model": head,
                                                   "num_speculative_tokens": K_LORA}, **LIMITS)
    records = record_drafts(llm, oracle, rng)
    for name, sp in (("greedy", greedy), ("seeded", seeded)):
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, lora_request=requests, use_tqdm=False)]
        assert got == expected[name], name
    stats = llm.stats()
    print({k: v for k, v in stats.items() if k.startswith("spec_decode")}, len(records))
    assert stats["spec_decode_num_accepted_tokens_per_pos"][1] > 0 and len(records) > 50

    models = {name: adapted_float64(base_dir, adapters.get(name)) for name in (None, *ADAPTERS)}
    embed = models[None].model.embed_tokens.weight.detach().numpy()
    if method == "eagle3":
        reference = ReferenceHead(head, embed)
    else:  # LoRA leaves the LM head alone
        reference = ReferenceEagleHead(head, embed, models[None].lm_head.weight.detach().numpy())

    def drafts_over(model, tokens, k):
        with torch.no_grad():
            out = model.model(torch.tensor([tokens[:-1]]), output_hidden_states=True)
        if method == "eagle3":
            features = np.concatenate([out.hidden_states[i][0].numpy() for i in aux_layers], -1)
        else:  # the output after the final norm
            features = out.last_hidden_state[0].numpy()
        return reference.drafts(tokens, features, k)

    adapter_of = {p[0]: None if r is None else r.lora_name for p, r in zip(prompts, requests)}
    mismatches, adapted, unadapted_equal = 0, 0, 0
    for tokens, drafts in records:
        name = adapter_of[tokens[0]]
        mismatches += drafts != drafts_over(models[name], tokens, len(drafts))
        if name is not None:
            adapted += 1
            unadapted_equal += drafts == drafts_over(models[None], tokens, len(drafts))
    print(f"{mismatches} of {len(records)} proposals differ from the adapted reference; "
          f"{unadapted_equal} of {adapted} adapted ones equal the base model's")
    assert mismatches <= len(records) // 50
    assert adapted > 20 and unadapted_equal < adapted // 2
