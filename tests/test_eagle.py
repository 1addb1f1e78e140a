"""EAGLE-1/2 speculative decoding (`{"method": "eagle"}`: spec_decode/eagle_head.py's Eagle1Head,
run by the same EagleRunner as EAGLE-3) on the tiny model, with a random head written in the
public layout (tests/eagle3_head.py's write_eagle_head: fc with a bias, layers.0.*, a stray
embed_tokens.weight and layers.0.input_layernorm.weight that must not be read).

The head's drafts are checked against a float64 numpy head fed by Hugging Face transformers'
output of the same target (after its final norm), with the target's embedding and LM head;
outputs must be exactly those without speculation.
"""

import numpy as np
import pytest
import torch
import transformers

import jpaged
from jpaged.models import tiny
from eagle3_head import ReferenceEagleHead, write_eagle_head, write_head
from test_eagle3 import assert_warmed_engine_matches, generate, record_drafts, spec_stats
from test_spec_decode_draft import write_tiny

LIMITS = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64)
SEED = 20261126
K = 3


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return write_eagle_head(tmp_path_factory.mktemp("eagle") / "head", tiny.tiny_config(), seed=SEED)


@pytest.fixture(scope="module")
def reference_target(tmp_path_factory):
    """The tiny model in float64 (transformers), its output after the final norm at every token."""
    path = write_tiny(tmp_path_factory.mktemp("eagle-target") / "tiny")
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()


def eagle_config(path, k=K, **extra):
    return {"method": "eagle", "model": path, "num_speculative_tokens": k, **extra}


def reference_mismatches(head_dir, target, records) -> int:
    """How many recorded proposals differ from the float64 head's over the target's outputs."""
    reference = ReferenceEagleHead(head_dir, target.model.embed_tokens.weight.detach().numpy(),
                                   target.lm_head.weight.detach().numpy())
    mismatches = 0
    for tokens, drafts in records:
        with torch.no_grad():
            output = target.model(torch.tensor([tokens[:-1]])).last_hidden_state[0].numpy()
        mismatches += drafts != reference.drafts(tokens, output, len(drafts))
    return mismatches


def oracle_of(prompts, expected):
    """The tokens that followed each sequence without speculation (record_drafts' oracle)."""
    full = [p + list(e) for p, e in zip(prompts, expected)]

    def oracle(tokens):
        whole = next(f for f in full if f[:len(tokens)] == tokens)
        return whole[len(tokens):]

    return oracle


def test_drafts_are_the_reference_heads(head, reference_target, shared_llm):
    """Every proposal equals the float64 head's, with prefix-cache hits, swaps and runs of
    accepted drafts; outputs (greedy and seeded) are those without speculation."""
    print("seed", SEED)
    rng = np.random.default_rng(SEED)
    shared = rng.integers(0, 256, 17).tolist()
    prompts = [shared + rng.integers(0, 256, n).tolist() for n in (2, 9, 20)]
    params = [jpaged.SamplingParams(temperature=0 if i % 2 else 1.0, seed=i, max_tokens=16, ignore_eos=True)
              for i in range(len(prompts))]
    expected = [o.token_ids for o in generate(shared_llm("tiny", enforce_eager=True, **LIMITS), prompts, params)]
    llm = jpaged.LLM("tiny", speculative_config=eagle_config(head), enforce_eager=True, enable_prefix_caching=True,
                     preemption_mode="swap", num_gpu_blocks_override=8, block_size=8,
                     max_model_len=128, max_num_seqs=8, max_num_batched_tokens=512)
    records = record_drafts(llm, oracle_of(prompts, expected), rng)
    outputs = generate(llm, prompts[:1], params[0])  # cached: the later prompts' first two blocks
    outputs += generate(llm, prompts[1:], params[1:])
    stats, spec = llm.stats(), spec_stats(llm)
    print(spec, stats["num_preemptions"], stats["prefix_cache_hits"], len(records))
    assert [o.token_ids for o in outputs] == expected
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0 and len(records) > 10
    assert spec["spec_decode_num_accepted_tokens_per_pos"][1] > 0
    mismatches = reference_mismatches(head, reference_target, records)
    assert mismatches <= len(records) // 50, f"{mismatches} of {len(records)} proposals differ from the reference"


def test_outputs_equal_without_speculation_and_nothing_compiles_after_warm_up(head, shared_llm):
    """Greedy with logprobs, seeded top-p / top-k and a penalty in one batch: token for token the
    outputs without speculation, on an engine warmed up before the first request."""
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(0, 256, n).tolist() for n in (3, 9, 17, 30)]
    params = [jpaged.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
              jpaged.SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True),
              jpaged.SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=11, max_tokens=24, ignore_eos=True),
              jpaged.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3)]
    reference = generate(shared_llm("tiny", enforce_eager=True, **LIMITS), prompts, params)
    assert_warmed_engine_matches(eagle_config(head), prompts, params, reference, min_draft_tokens=30)


def test_tensor_parallel_and_a_head_without_fc_bias(reference_target, shared_llm, tmp_path):
    """Target and head over a 2-device mesh (the target's LM head split over the vocabulary), a
    head whose fc has no bias: the same outputs, and the reference's drafts."""
    head = write_eagle_head(tmp_path / "head", tiny.tiny_config(), seed=SEED + 1, fc_bias=False)
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 11, 3)]
    sp = jpaged.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.token_ids for o in generate(shared_llm("tiny", enforce_eager=True, **LIMITS), prompts, sp)]
    llm = jpaged.LLM("tiny", speculative_config=eagle_config(head), tensor_parallel_size=2, enforce_eager=True,
                     **LIMITS)
    records = record_drafts(llm, oracle_of(prompts, expected), rng)
    assert [o.token_ids for o in generate(llm, prompts, sp)] == expected
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0 and len(records) > 5
    mismatches = reference_mismatches(head, reference_target, records)
    assert mismatches <= len(records) // 50, f"{mismatches} of {len(records)} proposals differ from the reference"


def test_target_with_tied_embeddings(head, tmp_path):
    """A target whose LM head is its embedding (no lm_head tensor): the head drafts with it, as
    the reference does; outputs as without speculation."""
    import safetensors.numpy

    target_dir = write_tiny(tmp_path / "tied", tie_word_embeddings=True)
    weights = safetensors.numpy.load_file(f"{target_dir}/model.safetensors")
    del weights["lm_head.weight"]
    safetensors.numpy.save_file(weights, f"{target_dir}/model.safetensors")
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(0, 256, n).tolist() for n in (4, 13, 7)]
    sp = jpaged.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.token_ids for o in generate(jpaged.LLM(target_dir, enforce_eager=True, **LIMITS), prompts, sp)]
    llm = jpaged.LLM(target_dir, speculative_config=eagle_config(head), enforce_eager=True, **LIMITS)
    records = record_drafts(llm, oracle_of(prompts, expected), rng)
    assert [o.token_ids for o in generate(llm, prompts, sp)] == expected
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0 and len(records) > 5
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    assert torch.equal(target.lm_head.weight, target.model.embed_tokens.weight)
    mismatches = reference_mismatches(head, target, records)
    assert mismatches <= len(records) // 50, f"{mismatches} of {len(records)} proposals differ from the reference"


def test_bad_heads_are_value_errors(tmp_path):
    cfg = tiny.tiny_config()
    cases = [
        (write_eagle_head(tmp_path / "hidden", cfg, hidden_size=128),
         r"speculative_config.model=.*hidden_size=128, the target 256"),
        (write_eagle_head(tmp_path / "vocab", cfg, vocab_size=300),
         r"speculative_config.model=.*vocab_size=300, the target 259"),
        (write_eagle_head(tmp_path / "layers", cfg, num_hidden_layers=2), r"num_hidden_layers=2"),
        (write_eagle_head(tmp_path / "mlp", cfg, intermediate_size=100), r"does not fit.*layers.0.mlp"),
        (write_eagle_head(tmp_path / "hass", cfg, add_para_norm=True), r"add_para_norm"),
        (write_eagle_head(tmp_path / "draft_vocab", cfg, draft_vocab_size=64), r"draft_vocab_size=64"),
        (write_head(tmp_path / "eagle3", cfg), r"midlayer\.\* tensors, the layout of method 'eagle3'"),
        (str(tmp_path / "missing"), r"speculative_config.model=.*config.json"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            jpaged.LLM("tiny", speculative_config=eagle_config(path), enforce_eager=True, **LIMITS)
    # An EAGLE-1 head named as EAGLE-3: its fc fuses two features, not three.
    with pytest.raises(ValueError, match=r"does not fit.*'fc\.(weight|bias)'"):
        jpaged.LLM("tiny", speculative_config=dict(eagle_config(write_eagle_head(tmp_path / "as3", cfg)),
                                                   method="eagle3"), enforce_eager=True, **LIMITS)
    with pytest.raises(ValueError, match=r"speculative_config.model"):
        jpaged.LLM("tiny", speculative_config={"method": "eagle", "num_speculative_tokens": 2}, **LIMITS)
