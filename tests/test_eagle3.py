"""EAGLE-3 speculative decoding (spec_decode/eagle.py, eagle_head.py) on the tiny model, with a
random head written in the public layout (tests/eagle3_head.py).

The head's drafts are checked against a float64 numpy head fed by Hugging Face transformers'
hidden states of the same target (its pages must hold the right K/V after prefix-cache hits
and preemptions); outputs must be exactly those without speculation (verification keeps the
target's draws whatever the drafts).
"""

import numpy as np
import pytest
import torch
import transformers

import jpaged
from jpaged.models import tiny
from eagle3_head import ReferenceHead, write_head, write_successor_head
from test_async_scheduling import generate_counting_overlaps
from test_spec_decode import assert_same_distributions, sampled_token_counts
from test_spec_decode_async import count_proposer_work
from test_spec_decode_draft import write_tiny

# A pool of 128 blocks (of 16) is 2x what 8 sequences of 128 tokens need: on a GPU, where a pool is
# otherwise sized from memory, several engines live in one test process (gpu_check.sh runs this file).
LIMITS = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks_override=128)
SEED = 20261125
K = 3


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return write_head(tmp_path_factory.mktemp("eagle") / "head", tiny.tiny_config())


def eagle_config(path, k=K, **extra):
    return {"method": "eagle3", "model": path, "num_speculative_tokens": k, **extra}


def generate(llm, prompts, sp):
    return [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]


def spec_stats(llm):
    return {k: v for k, v in llm.stats().items() if k.startswith("spec_decode")}


def record_drafts(llm, oracle=None, rng=None) -> list:
    """(the sequence's tokens, the head's drafts) of every proposal the engine makes from now on.
    `oracle(tokens)`: the tokens that really follow; the step verifies those instead, one in
    five changed (so runs of drafts are accepted, and rejected, whatever the random head says)."""
    scheduler, records = llm.llm_engine.scheduler, []
    set_drafts = scheduler.set_drafts

    def recording(plan, scheduled, tokens):
        if tokens:
            seq_tokens = scheduled.seqs[0].get_token_ids()
            records.append((seq_tokens, list(tokens)))
            if oracle is not None:
                tokens = [t if rng.random() < 0.8 else (t + 1) % 256 for t in oracle(seq_tokens)[:len(tokens)]]
        return set_drafts(plan, scheduled, tokens)

    scheduler.set_drafts = recording
    return records


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_drafts_are_the_reference_heads(head, preemption_mode, shared_llm, tmp_path):
    """Every proposal equals the float64 head's over the target's (transformers) hidden states,
    with prefix-cache hits, preemptions and runs of accepted drafts; the outputs are those
    without speculation. The shared prefix runs one token past its last full block: a cached
    block's last entry pairs with the token after it, the same for every prompt."""
    rng = np.random.default_rng(SEED)
    shared = rng.integers(0, 256, 17).tolist()
    prompts = [shared + rng.integers(0, 256, n).tolist() for n in (2, 9, 20)]
    params = [jpaged.SamplingParams(temperature=0 if i % 2 else 1.0, seed=i, max_tokens=16, ignore_eos=True)
              for i in range(len(prompts))]
    expected = [o.token_ids for o in generate(shared_llm("tiny", enforce_eager=True, **LIMITS), prompts, params)]
    full = [p + e for p, e in zip(prompts, expected)]

    def oracle(tokens):
        whole = next(f for f in full if f[:len(tokens)] == tokens)
        return whole[len(tokens):]

    llm = jpaged.LLM("tiny", speculative_config=eagle_config(head), enforce_eager=True, enable_prefix_caching=True,
                     preemption_mode=preemption_mode, num_gpu_blocks_override=8, block_size=8,
                     max_model_len=128, max_num_seqs=8, max_num_batched_tokens=512)
    records = record_drafts(llm, oracle, rng)
    outputs = generate(llm, prompts[:1], params[0])  # cached: the later prompts' first two blocks
    outputs += generate(llm, prompts[1:], params[1:])
    stats, spec = llm.stats(), spec_stats(llm)
    print(spec, stats["num_preemptions"], stats["prefix_cache_hits"], len(records))
    assert [o.token_ids for o in outputs] == expected
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0 and len(records) > 10
    assert spec["spec_decode_num_accepted_tokens_per_pos"][1] > 0

    target = transformers.AutoModelForCausalLM.from_pretrained(write_tiny(tmp_path / "tiny"), dtype=torch.float64)
    reference = ReferenceHead(head, target.model.embed_tokens.weight.detach().numpy())
    layers = (2, 2, 1)  # (2, L // 2, L - 3) of the tiny model's 4 layers
    mismatches = 0
    for tokens, drafts in records:
        with torch.no_grad():
            states = target(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        aux = np.concatenate([states[i][0].numpy() for i in layers], -1)
        mismatches += drafts != reference.drafts(tokens, aux, len(drafts))
    assert mismatches <= len(records) // 50, f"{mismatches} of {len(records)} proposals differ from the reference"


@pytest.mark.parametrize("disable_by_batch_size", [None, 2])
def test_outputs_equal_without_speculation_and_nothing_compiles_after_warm_up(head, disable_by_batch_size, shared_llm):
    """Greedy with logprobs, seeded sampling with top-p / top-k, a penalty and a grammar in one
    batch: token for token the outputs without speculation. With disable_by_batch_size, the
    steps above it run forwards without hidden states, compiled at warm-up too."""
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
    # Warmed up (every bucket), on fewer buckets than the reference's: outputs do not depend on them.
    assert_warmed_engine_matches(eagle_config(head, disable_by_batch_size=disable_by_batch_size), prompts, params,
                                 reference, min_draft_tokens=50 if disable_by_batch_size is None else 10)


def assert_warmed_engine_matches(speculative_config, prompts, params, reference, min_draft_tokens: int):
    """A speculating engine warmed up on return (every bucket): nothing compiles while it
    generates, it drafts, and its tokens and the first request's logprobs are `reference`'s."""
    llm = jpaged.LLM("tiny", speculative_config=speculative_config, max_model_len=128, max_num_seqs=4,
                     max_num_batched_tokens=32, background_warmup=False, num_gpu_blocks_override=128)
    compiled = llm.stats()["num_compilations"]
    outputs = generate(llm, prompts, params)
    stats = spec_stats(llm)
    print(stats)
    assert llm.stats()["num_compilations"] == compiled, "a draft or verification shape compiled after warm-up"
    assert stats["spec_decode_num_draft_tokens"] > min_draft_tokens
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    for top, ref_top in zip(outputs[0].logprobs, reference[0].logprobs):  # the target's logprobs
        assert top.keys() == ref_top.keys() and all(abs(top[t] - ref_top[t]) < 1e-4 for t in top)


def test_sampled_distribution_matches_without_speculation(shared_llm, tmp_path):
    """Unseeded requests at temperature 1, with and without the head (engines of different seeds):
    a two-sample chi-square over output positions 1-3 must not tell them apart. The head's drafts
    are its argmax (a one-hot proposal); the head follows the prompt's greedy continuation from
    the token just sampled (tests/eagle3_head.py's write_successor_head), so runs of drafts are
    accepted and many are rejected: verification must keep the target's distribution."""
    print("seed", SEED)
    rng = np.random.default_rng(SEED)
    prompt = rng.integers(0, 256, 6).tolist()
    greedy = generate(shared_llm("tiny", enforce_eager=True, **LIMITS), [prompt],
                      jpaged.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].token_ids
    embed = next(tiny.tiny_weights(tiny.tiny_config()))[1]
    likely = write_successor_head(tmp_path / "likely", tiny.tiny_config(), embed, dict(zip(greedy, greedy[1:])))
    plain, _ = sampled_token_counts(prompt, None, seed=1)
    spec, stats = sampled_token_counts(prompt, eagle_config(likely), seed=2)
    print(stats)
    assert 300 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"] // 2
    assert_same_distributions(plain, spec)


def test_bad_heads_are_value_errors(tmp_path):
    cfg = tiny.tiny_config()
    cases = [
        (write_head(tmp_path / "hidden", cfg, hidden_size=128), r"speculative_config.model=.*hidden_size=128, the target 256"),
        (write_head(tmp_path / "vocab", cfg, vocab_size=300), r"speculative_config.model=.*vocab_size=300, the target 259"),
        (write_head(tmp_path / "layers", cfg, aux_layers=(0, 2, 4)), r"eagle_aux_hidden_state_layer_ids"),
        (write_head(tmp_path / "draft_vocab", cfg, draft_vocab_size=65), r"d2t of shape \(64,\).*draft_vocab_size"),
        (write_head(tmp_path / "mlp", cfg, intermediate_size=100), r"does not fit.*midlayer.mlp"),
        # Issue 60: without d2t, or with a float one, every draft was a wrong token (acceptance ~0).
        (write_head(tmp_path / "no_d2t", cfg, d2t_dtype=None), r"has no d2t tensor; .*draft_vocab_size=64"),
        (write_head(tmp_path / "float_d2t", cfg, d2t_dtype=np.float32), r"has d2t of dtype float32; expected an "
                                                                          r"integer tensor"),
        (str(tmp_path / "missing"), r"speculative_config.model=.*config.json"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            jpaged.LLM("tiny", speculative_config=eagle_config(path), enforce_eager=True, **LIMITS)
    with pytest.raises(ValueError, match=r"speculative_config.model"):
        jpaged.LLM("tiny", speculative_config={"method": "eagle3", "num_speculative_tokens": 2}, **LIMITS)


def test_async_scheduling_and_disable_by_batch_size(head, shared_llm):
    """With async scheduling, steps above disable_by_batch_size overlap and skip the head (no
    hidden states, no fill: its pages miss those steps' entries), and the thinned-out batch
    speculates again: outputs as without speculation."""
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(3, 20, 4)]
    params = [jpaged.SamplingParams(temperature=1.0 if i % 2 else 0, top_k=20, seed=i, max_tokens=n, ignore_eos=True)
              for i, n in enumerate([4, 6, 16, 20])]
    expected = [o.token_ids for o in generate(shared_llm("tiny", enforce_eager=True, **LIMITS), prompts, params)]
    llm = jpaged.LLM("tiny", speculative_config=eagle_config(head, disable_by_batch_size=2), async_scheduling=True,
                     enforce_eager=True, **LIMITS)
    work = count_proposer_work(llm, "after_step")
    outputs, overlapped = generate_counting_overlaps(llm, prompts, params)
    print(work, spec_stats(llm))
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert overlapped > 0 and spec_stats(llm)["spec_decode_num_draft_tokens"] > 0
    assert work["without"] > 0 and work["calls"] == work["with"] > 0


def test_tensor_parallel(head, shared_llm):
    """Target and head over a 2-device mesh: the same outputs."""
    prompts = [[5, 6, 7, 8, 9], [100, 3, 4]]
    sp = jpaged.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reference = generate(shared_llm("tiny", enforce_eager=True, **LIMITS), prompts, sp)
    llm = jpaged.LLM("tiny", speculative_config=eagle_config(head), tensor_parallel_size=2, enforce_eager=True,
                     **LIMITS)
    assert [o.token_ids for o in generate(llm, prompts, sp)] == [o.token_ids for o in reference]
    assert spec_stats(llm)["spec_decode_num_draft_tokens"] > 0
