"""Speculative decoding with a draft model (spec_decode/draft_model.py) on the tiny model.

Drafts come from a real second model: the tiny model cut to its first layers (a checkpoint on
disk, the same vocabulary), which agrees with the whole model often but not always, or the tiny
model itself, which agrees always: then every draft must be accepted, and that holds only if the
draft's own KV pages hold the right K/V at every position (after prefix-cache hits, swaps,
recomputes). Outputs must be exactly those without speculation, greedy and sampled.
"""

import json

import numpy as np
import pytest
import safetensors.numpy

import jpaged
from jpaged.models import tiny
from test_spec_decode import assert_same_distributions

VOCAB = 259
LIMITS = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64)
# shared_llm (conftest): the engine without speculation, built once; it runs greedy and seeded
# requests only, so what ran on it before changes nothing.
SEED = 20261124


def write_tiny(path, num_layers: int | None = None, **config):
    """The tiny model's weights as a checkpoint directory, keeping its first `num_layers` layers."""
    cfg = tiny.tiny_config()
    weights = dict(tiny.tiny_weights(cfg))
    if num_layers is not None:
        cfg.num_hidden_layers = num_layers
        weights = {k: v for k, v in weights.items() if not k.startswith("model.layers.")
                   or int(k.split(".")[2]) < num_layers}
    for key, value in config.items():
        setattr(cfg, key, value)
    if "vocab_size" in config:  # another vocabulary: resized embeddings and head
        weights = {k: np.resize(v, (cfg.vocab_size, v.shape[1])) if k in ("model.embed_tokens.weight", "lm_head.weight")
                   else v for k, v in weights.items()}
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    safetensors.numpy.save_file(weights, str(path / "model.safetensors"))
    tiny.tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def short_draft(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("draft") / "tiny-2-layers", num_layers=2)


def draft_config(model, k=3, **extra):
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, **extra}


def generate(llm, prompts, sp):
    return [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]


def spec_stats(llm):
    return {k: v for k, v in llm.stats().items() if k.startswith("spec_decode")}


def test_outputs_equal_without_speculation_and_nothing_compiles_after_warm_up(short_draft, shared_llm):
    """Greedy with logprobs, seeded sampling with top-p / top-k, a penalty and a grammar in one
    batch: token for token the outputs without speculation."""
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(0, 256, n).tolist() for n in (3, 9, 17, 30, 5, 12)]
    params = [jpaged.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
              jpaged.SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True),
              jpaged.SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=11, max_tokens=24, ignore_eos=True),
              jpaged.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
              jpaged.SamplingParams(temperature=0, max_tokens=20, guided_regex="[a-z]{3,12}"),
              jpaged.SamplingParams(temperature=1.0, max_tokens=17, ignore_eos=True)]  # unseeded: the engine seed
    # A fresh engine: the unseeded request draws from the engine's seed and its request count (a
    # shared engine other files ran first would have moved on).
    reference = generate(jpaged.LLM("tiny", enforce_eager=True, **LIMITS), prompts, params)
    llm = jpaged.LLM("tiny", speculative_config=draft_config(short_draft), **LIMITS)  # warmed up: every bucket
    compiled = llm.stats()["num_compilations"]
    outputs = generate(llm, prompts, params)
    stats = spec_stats(llm)
    print(stats)
    assert llm.stats()["num_compilations"] == compiled, "a draft or verification shape compiled after warm-up"
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    for ours, ref in zip(outputs, reference):
        assert ours.token_ids == ref.token_ids
    for top, ref_top in zip(outputs[0].logprobs, reference[0].logprobs):  # the target's logprobs
        assert top.keys() == ref_top.keys() and all(abs(top[t] - ref_top[t]) < 1e-4 for t in top)


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_the_draft_pages_follow_the_target_s(preemption_mode, shared_llm):
    """The tiny model as its own draft: every draft is the target's own draw, so all must be
    accepted, also after preemption (swap or recompute) and prefix-cache hits, which read the
    draft's K/V from blocks other steps wrote, moved or computed again."""
    rng = np.random.default_rng(SEED)
    shared = rng.integers(0, 256, 40).tolist()
    prompts = [shared + rng.integers(0, 256, n).tolist() for n in (2, 9, 15, 4, 20, 7)]
    params = [jpaged.SamplingParams(temperature=0 if i % 2 else 1.0, seed=i, max_tokens=30, ignore_eos=True)
              for i in range(len(prompts))]
    reference = generate(shared_llm("tiny", enforce_eager=True, **LIMITS), prompts, params)
    llm = jpaged.LLM("tiny", speculative_config=draft_config("tiny"), enforce_eager=True, enable_prefix_caching=True,
                     preemption_mode=preemption_mode, num_gpu_blocks_override=14, block_size=8, **LIMITS)
    outputs = generate(llm, prompts, params)
    stats, spec = llm.stats(), spec_stats(llm)
    print(spec, stats["num_preemptions"], stats["prefix_cache_hits"])
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert spec["spec_decode_num_draft_tokens"] > 50
    assert spec["spec_decode_num_accepted_tokens"] == spec["spec_decode_num_draft_tokens"]
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    assert stats["num_free_gpu_blocks"] + stats["num_cached_gpu_blocks"] >= 0 and stats["num_running"] == 0


def test_sampled_distribution_matches_without_speculation(short_draft):
    """Unseeded requests at temperature 1, two engines with different seeds: a two-sample
    chi-square over the tokens at output positions 1-3 must not tell them apart."""
    rng = np.random.default_rng(SEED)
    prompt = rng.integers(0, 256, 6).tolist()
    num = 1500
    sp = jpaged.SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    counts, stats = {}, None
    for name, spec, seed in (("plain", None, 1), ("spec", draft_config(short_draft), 2)):
        llm = jpaged.LLM("tiny", speculative_config=spec, seed=seed, enforce_eager=True, max_model_len=32,
                         max_num_seqs=256, max_num_batched_tokens=1024)
        outputs = generate(llm, [prompt] * num, sp)
        counts[name] = [np.bincount([o.token_ids[i] for o in outputs], minlength=VOCAB) for i in (1, 2, 3)]
        stats = spec_stats(llm)
    print(stats)
    assert stats["spec_decode_num_accepted_tokens"] > 100
    assert_same_distributions(counts["plain"], counts["spec"])


def test_requests_that_cannot_speculate_run_without_drafts(short_draft, shared_llm):
    """best_of and beam search take no drafts; their outputs are those without speculation."""
    prompts = [[1, 2, 3, 4], [9, 8, 7]]
    params = [jpaged.SamplingParams(n=2, best_of=3, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True),
              jpaged.SamplingParams(use_beam_search=True, best_of=2, n=2, temperature=0, max_tokens=10,
                                    ignore_eos=True)]
    plain = shared_llm("tiny", enforce_eager=True, **LIMITS).generate(prompts, params, use_tqdm=False)
    llm = jpaged.LLM("tiny", speculative_config=draft_config(short_draft), enforce_eager=True, **LIMITS)
    ours = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in ours] == [[c.token_ids for c in o.outputs] for o in plain]
    assert spec_stats(llm)["spec_decode_num_drafts"] == 0


def test_tensor_parallel(short_draft, shared_llm):
    """Both models split over a 2-device mesh: the same outputs."""
    prompts = [[5, 6, 7, 8, 9], [100, 3, 4]]
    sp = jpaged.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference = generate(shared_llm("tiny", enforce_eager=True, **LIMITS), prompts, sp)
    llm = jpaged.LLM("tiny", speculative_config=draft_config(short_draft), tensor_parallel_size=2,
                     enforce_eager=True, **LIMITS)
    assert [o.token_ids for o in generate(llm, prompts, sp)] == [o.token_ids for o in reference]
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0


def test_bad_draft_models_are_value_errors(tmp_path):
    other_vocab = write_tiny(tmp_path / "vocab", vocab_size=300)
    short = write_tiny(tmp_path / "short", max_position_embeddings=64)
    cases = [
        (draft_config(other_vocab), r"speculative_config.model=.*vocabulary of 300 tokens, the target 259"),
        (draft_config(short), r"speculative_config.model=.*64 positions, fewer than max_model_len=128"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, r"speculative_config.model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "tiny"}, r"speculative_config.model"),
        (draft_config("tiny", k=0), r"speculative_config.num_speculative_tokens"),
        (draft_config(str(tmp_path / "missing")), r"missing"),
    ]
    for config, message in cases:
        with pytest.raises((ValueError, OSError), match=message):
            jpaged.LLM("tiny", speculative_config=config, enforce_eager=True, **LIMITS)
    # A bare "model" means a draft model (vLLM infers the method the same way).
    from jpaged.spec_decode.config import SpeculativeConfig
    assert SpeculativeConfig.of(json.dumps({"model": "tiny", "num_speculative_tokens": 2})).method == "draft_model"
