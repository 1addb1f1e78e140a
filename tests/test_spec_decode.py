"""Speculative decoding through the whole engine on the tiny model.

Random tiny weights rarely repeat themselves, so n-gram drafts would rarely be accepted: most
tests draft from an oracle instead, the outputs the engine produced without speculation (keyed
by prompt), each draft token wrong with some probability. Acceptance and rejection then both
happen often, and the outputs must be exactly those without speculation: greedy, and sampled
with seeds (a row draws with the key of its output position, as without drafts). The real
n-gram proposer's acceptance on real weights is in tests/test_smollm2.py and scripts/bench_spec.py.
"""

import math

import numpy as np
import pytest

import jpaged
from jpaged.spec_decode.config import SpeculativeConfig
from jpaged.spec_decode import ngram

VOCAB = 259  # the tiny model's
LIMITS = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
# Fixed: every prompt, oracle draft and corruption below is the same in every run (the
# assertions that drafts were accepted, preempted, stopped, are then never luck).
SEED = 20261124


def draft_from(monkeypatch, references, rng, wrong=0.3):
    """Propose the continuation each prompt had without speculation, each token replaced by a
    wrong one with probability `wrong`."""
    def propose(token_ids, k, lookup_min, lookup_max):
        token_ids = list(token_ids)
        for prompt, output in references:
            done = len(token_ids) - len(prompt)
            if done >= 0 and token_ids == prompt + output[:done]:
                return [t if rng.random() >= wrong else (t + 1) % VOCAB for t in output[done:done + k]]
        return []

    monkeypatch.setattr(ngram, "propose_ngram", propose)


def generate(llm, prompts, sp):
    return [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]


def distinct_prompts(rng, lengths):
    """Prompts that differ in their first token (the oracle tells them apart by prefix)."""
    first = rng.permutation(VOCAB)[:len(lengths)]
    return [[int(f)] + rng.integers(0, VOCAB, n - 1).tolist() for f, n in zip(first, lengths)]


@pytest.fixture
def plain(shared_llm):
    """The engine without speculation every test compares with, built once: it only runs greedy
    and seeded requests, so what an earlier test ran on it changes nothing."""
    return shared_llm("tiny", enforce_eager=True, **LIMITS)


def spec_stats(llm):
    return {k: v for k, v in llm.stats().items() if k.startswith("spec_decode")}


def test_greedy_equals_without_speculation_and_nothing_compiles_after_warm_up(monkeypatch, plain):
    rng = np.random.default_rng(SEED)
    prompts = distinct_prompts(rng, (3, 9, 17, 30, 5, 12))
    sp = jpaged.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    reference = generate(plain, prompts, sp)
    draft_from(monkeypatch, [(p, list(o.token_ids)) for p, o in zip(prompts, reference)], rng)
    llm = jpaged.LLM("tiny", speculative_config=NGRAM, background_warmup=False, **LIMITS)  # every bucket
    compiled = llm.stats()["num_compilations"]
    outputs = generate(llm, prompts, sp)
    stats = spec_stats(llm)
    print(stats)
    assert llm.stats()["num_compilations"] == compiled, "a verification shape compiled after warm-up"
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert sum(stats["spec_decode_num_accepted_tokens_per_pos"]) == stats["spec_decode_num_accepted_tokens"]
    for ours, ref in zip(outputs, reference):
        assert ours.token_ids == ref.token_ids
        # Logprobs are the target's: those of the same positions without drafts.
        for top, ref_top in zip(ours.logprobs, ref.logprobs):
            assert top.keys() == ref_top.keys()
            assert all(abs(top[t] - ref_top[t]) < 1e-4 for t in top)
        assert abs(ours.cumulative_logprob - ref.cumulative_logprob) < 1e-3


def test_seeded_sampling_equals_without_speculation(monkeypatch, plain):
    """Temperature 1 with top_p / top_k: each row draws with the key of its output position, so
    accepted drafts and the token after them are what the same seed draws without speculation."""
    rng = np.random.default_rng(SEED)
    prompts = distinct_prompts(rng, (4, 11, 20, 7))
    params = [jpaged.SamplingParams(temperature=1.0, top_p=0.9 if i % 2 else 1.0, top_k=50 if i == 2 else -1,
                                    seed=int(rng.integers(1 << 30)), max_tokens=20, ignore_eos=True)
              for i in range(len(prompts))]
    reference = [o.outputs[0] for o in plain.generate(
        prompts, params, use_tqdm=False)]
    draft_from(monkeypatch, [(p, list(o.token_ids)) for p, o in zip(prompts, reference)], rng, wrong=0.25)
    llm = jpaged.LLM("tiny", speculative_config=dict(NGRAM, num_speculative_tokens=4), enforce_eager=True, **LIMITS)
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    print(spec_stats(llm))
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_preemption_and_prefix_caching(monkeypatch, preemption_mode, plain):
    """A pool too small for the batch (preempted by swap or recompute, drafts dropped when
    blocks are short) with prefix caching on prompts sharing a prefix: the same outputs, and the
    cached blocks' hashes only cover accepted tokens (a later prompt that continues a finished
    one's output hits them, then reads its K/V)."""
    rng = np.random.default_rng(SEED)
    shared = rng.integers(0, VOCAB, 40).tolist()
    prompts = [shared + [int(f)] + rng.integers(0, VOCAB, n).tolist()
               for f, n in zip(rng.permutation(VOCAB)[:6], (2, 9, 15, 4, 20, 7))]
    sp = jpaged.SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    reference = generate(plain, prompts, sp)
    # A later request whose prompt is the first one's prompt + output: hits blocks filled by drafts.
    follow_up = prompts[0] + list(reference[0].token_ids) + [7, 8]
    reference_follow_up = generate(plain, [follow_up], sp)[0]
    references = [(p, list(o.token_ids)) for p, o in zip(prompts + [follow_up], reference + [reference_follow_up])]
    draft_from(monkeypatch, references, rng)
    llm = jpaged.LLM("tiny", speculative_config=NGRAM, enforce_eager=True, enable_prefix_caching=True,
                     preemption_mode=preemption_mode, num_gpu_blocks_override=14, block_size=8, **LIMITS)
    outputs = generate(llm, prompts, sp)
    stats = llm.stats()
    print(spec_stats(llm), stats["num_preemptions"], stats["prefix_cache_hits"])
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    # A pool that keeps what finished: the follow-up hits every full block of the first request.
    llm = jpaged.LLM("tiny", speculative_config=NGRAM, enforce_eager=True, enable_prefix_caching=True,
                     num_gpu_blocks_override=64, block_size=8, **LIMITS)
    assert generate(llm, prompts[:1], sp)[0].token_ids == reference[0].token_ids
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0
    assert generate(llm, [follow_up], sp)[0].token_ids == reference_follow_up.token_ids
    assert llm.stats()["prefix_cache_hits"] == 8 * ((len(follow_up) - 3) // 8)


def test_stops_inside_an_accepted_run(monkeypatch, plain):
    """Stop token ids, stop strings, max_tokens and min_tokens that fall inside a run of drafts
    end the output exactly where they do without speculation (the drafts past them are dropped)."""
    rng = np.random.default_rng(SEED)
    prompts = distinct_prompts(rng, (5, 8, 13, 6, 9))
    free = jpaged.SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = generate(plain, prompts, free)
    # Each prompt's own stop: a token from the middle of its output, a piece of its text, a length.
    params = [jpaged.SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                    stop_token_ids=[full[0].token_ids[12]]),
              jpaged.SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                    stop=[full[1].text[10:13]] if len(full[1].text) >= 13 else None,
                                    stop_token_ids=[full[1].token_ids[14]]),
              jpaged.SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),
              jpaged.SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[full[3].text[9:11]],
                                    stop_token_ids=[full[3].token_ids[20]])]
    # min_tokens=12 with a stop id the output meets at position 3: rows before position 12 ban it
    # (each by its own position), so the output goes on; it ends at a second stop id, one that the
    # min_tokens run meets only after position 12 (banning it earlier changes nothing there), or
    # at max_tokens=20 when every later token also came earlier (a loop).
    banned_early = full[4].token_ids[3]
    late = generate(plain, [prompts[4]], jpaged.SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                               min_tokens=12, stop_token_ids=[banned_early]))[0]
    second = next((t for t in late.token_ids[12:] if t not in late.token_ids[:12] and t != banned_early), None)
    params.append(jpaged.SamplingParams(temperature=0, max_tokens=30 if second is not None else 20, ignore_eos=True,
                                        min_tokens=12,
                                        stop_token_ids=[banned_early] + ([second] if second is not None else [])))
    reference = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    assert all(len(o.token_ids) < 30 for o in reference), "a stop that never happened tests nothing"
    draft_from(monkeypatch, [(p, list(o.token_ids)) for p, o in zip(prompts, full)], rng, wrong=0.1)
    llm = jpaged.LLM("tiny", speculative_config=dict(NGRAM, num_speculative_tokens=5), enforce_eager=True, **LIMITS)
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    print(spec_stats(llm))
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0
    for ours, ref in zip(outputs, reference):
        assert (ours.token_ids, ours.text, ours.finish_reason, ours.stop_reason) == \
            (ref.token_ids, ref.text, ref.finish_reason, ref.stop_reason)
    assert llm.stats()["num_free_gpu_blocks"] == llm.stats()["num_gpu_blocks"]


def test_penalties_count_the_drafts_before_each_row(monkeypatch, plain):
    """Repetition, frequency and presence penalties over prompt + outputs + the drafts before the
    row (the runner uploads them to the device's token history): greedy and seeded sampling
    equal the outputs without speculation."""
    rng = np.random.default_rng(SEED)
    prompts = distinct_prompts(rng, (6, 10, 15))
    params = [jpaged.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.4),
              jpaged.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=0.8,
                                    presence_penalty=0.5, logprobs=3),
              jpaged.SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True, frequency_penalty=0.6)]
    reference = [o.outputs[0] for o in plain.generate(
        prompts, params, use_tqdm=False)]
    draft_from(monkeypatch, [(p, list(o.token_ids)) for p, o in zip(prompts, reference)], rng, wrong=0.2)
    llm = jpaged.LLM("tiny", speculative_config=NGRAM, enforce_eager=True, **LIMITS)
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    print(spec_stats(llm))
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    for top, ref_top in zip(outputs[1].logprobs, reference[1].logprobs):  # the penalised logprobs
        assert all(abs(top[t] - ref_top[t]) < 1e-4 for t in top)


def test_structured_output_checks_the_drafts(monkeypatch, plain):
    """Drafts are cut at the first token the grammar rejects, and each row samples under the
    grammar's mask after the drafts before it: the same outputs as without speculation, which
    the grammars accept."""
    rng = np.random.default_rng(SEED)
    prompts = distinct_prompts(rng, (6, 9, 12))
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    params = [jpaged.SamplingParams(temperature=0, max_tokens=40, guided_json=schema),
              jpaged.SamplingParams(temperature=1.0, seed=5, max_tokens=30,
                                    guided_regex="[a-z]{3,9}( [a-z]{2,9}){2,4}"),
              jpaged.SamplingParams(temperature=0, max_tokens=30, guided_choice=["alpha beta gamma", "alpha delta"])]
    reference = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    print([o.text for o in reference])
    # Half the drafts wrong: many break the grammar (cut there), the rest are verified.
    draft_from(monkeypatch, [(p, list(o.token_ids)) for p, o in zip(prompts, reference)], rng, wrong=0.5)
    llm = jpaged.LLM("tiny", speculative_config=NGRAM, enforce_eager=True, **LIMITS)
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    print(spec_stats(llm))
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0
    assert [(o.token_ids, o.text, o.finish_reason) for o in outputs] == \
        [(o.token_ids, o.text, o.finish_reason) for o in reference]


def test_requests_that_cannot_speculate_run_without_drafts(monkeypatch, plain):
    """n > 1 and beam search sample several sequences from one: those requests decode one
    token a step, with the same outputs."""
    rng = np.random.default_rng(SEED)
    prompts = distinct_prompts(rng, (6, 10))
    params = [jpaged.SamplingParams(temperature=0.8, n=2, seed=3, max_tokens=12, ignore_eos=True),
              jpaged.SamplingParams(use_beam_search=True, n=2, temperature=0, max_tokens=12, ignore_eos=True)]
    reference = plain.generate(prompts, params, use_tqdm=False)
    draft_from(monkeypatch, [(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts, reference)], rng, wrong=0)
    llm = jpaged.LLM("tiny", speculative_config=NGRAM, enforce_eager=True, **LIMITS)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert spec_stats(llm)["spec_decode_num_drafts"] == 0
    for ours, ref in zip(outputs, reference):
        assert [o.token_ids for o in ours.outputs] == [o.token_ids for o in ref.outputs]


def test_disable_by_batch_size(monkeypatch, plain):
    rng = np.random.default_rng(SEED)
    prompts = distinct_prompts(rng, (5, 6, 7, 8))
    sp = jpaged.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    reference = generate(plain, prompts, sp)
    draft_from(monkeypatch, [(p, list(o.token_ids)) for p, o in zip(prompts, reference)], rng, wrong=0)
    llm = jpaged.LLM("tiny", speculative_config=dict(NGRAM, disable_by_batch_size=2), enforce_eager=True, **LIMITS)
    assert [o.token_ids for o in generate(llm, prompts, sp)] == [o.token_ids for o in reference]
    assert spec_stats(llm)["spec_decode_num_drafts"] == 0  # four ran at once: more than 2
    assert [o.token_ids for o in generate(llm, prompts[:2], sp)] == [o.token_ids for o in reference[:2]]
    assert spec_stats(llm)["spec_decode_num_drafts"] > 0  # two: speculated


def test_sampled_distribution_matches_without_speculation(monkeypatch, plain):
    """Unseeded requests at temperature 1, two engines with different seeds: a two-sample
    chi-square over the tokens at output positions 1-3, where drafts (always the position's most
    likely token) were accepted or rejected, must not tell the engines apart."""
    rng = np.random.default_rng(SEED)
    prompt = rng.integers(0, VOCAB, 6).tolist()
    greedy = generate(plain, [prompt],
                      jpaged.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].token_ids

    def propose(token_ids, k, lookup_min, lookup_max):  # the greedy continuation of every prefix seen
        done = len(token_ids) - len(prompt)
        return list(greedy[done:done + k]) if done < len(greedy) else []

    monkeypatch.setattr(ngram, "propose_ngram", propose)
    plain_counts, _ = sampled_token_counts(prompt, None, seed=1)
    spec_counts, stats = sampled_token_counts(prompt, NGRAM, seed=2)
    print(stats)
    assert stats["spec_decode_num_accepted_tokens"] > 100
    assert_same_distributions(plain_counts, spec_counts)


def sampled_token_counts(prompt, spec, seed: int, num: int = 1500):
    """`num` unseeded copies of `prompt` at temperature 1, 4 tokens each, on an engine with `seed`
    (and `spec`): the token counts at output positions 1, 2, 3 (the ones drafts can cover), and the
    engine's speculation counters."""
    llm = jpaged.LLM("tiny", speculative_config=spec, seed=seed, enforce_eager=True, max_model_len=32,
                     max_num_seqs=256, max_num_batched_tokens=1024)
    outputs = generate(llm, [prompt] * num, jpaged.SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))
    return [np.bincount([o.token_ids[i] for o in outputs], minlength=VOCAB) for i in (1, 2, 3)], spec_stats(llm)


def assert_same_distributions(plain, spec):
    """Token counts at output positions 1, 2, ... of two engines (equal totals): a two-sample
    chi-square per position must not tell them apart."""
    for i, (a, b) in enumerate(zip(plain, spec)):
        keep = (a + b) >= 10  # bins with >= 5 expected draws; the rest pooled
        a, b = np.append(a[keep], a[~keep].sum()), np.append(b[keep], b[~keep].sum())
        used = (a + b) > 0
        a, b = a[used], b[used]
        chi2 = float((((a - b) ** 2) / (a + b)).sum())  # equal totals: the two-sample statistic
        df = len(a) - 1
        print(f"position {i + 1}: chi2={chi2:.1f}, df={df}")
        assert chi2 < df + 6 * math.sqrt(2 * df) + 10, f"position {i + 1}: chi2={chi2:.1f} with df={df}"


def test_ngram_proposals():
    # The latest earlier occurrence of the longest suffix; what followed it, up to k tokens.
    assert ngram.propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3, 1, 4) == [7, 5, 1]
    assert ngram.propose_ngram([1, 2, 3, 4, 1, 2], 5, 1, 3) == [3, 4, 1, 2]
    assert ngram.propose_ngram([5, 6, 7], 2, 1, 3) == []  # no earlier occurrence
    assert ngram.propose_ngram([4, 8, 4, 9, 4], 2, 2, 3) == []  # only 1-grams repeat, min 2
    assert ngram.propose_ngram([4, 8, 4, 9, 4], 2, 1, 3) == [9, 4]  # the latest "4"
    assert ngram.propose_ngram([1, 1, 1, 1], 3, 1, 2) == [1]  # "1 1" last occurred just before the end
    assert ngram.propose_ngram([1], 3, 1, 4) == [] and ngram.propose_ngram([1, 2, 1], 0, 1, 4) == []


@pytest.mark.parametrize("config, field", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
    ({"method": "eagle7", "num_speculative_tokens": 2}, "method"),
    ({"num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 10**6}, r"num_speculative_tokens=1000000; expected an integer "
                                                          r"in \[1, 32\]"),
    ({"method": "ngram", "num_speculative_tokens": 33}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 10**9},
     r"prompt_lookup_max=1000000000; expected an integer in \[1, 32\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 10**9}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown fields"),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a dict"),
])
def test_bad_speculative_configs_are_value_errors(config, field):
    with pytest.raises(ValueError, match=f"speculative_config.*{field}|{field}"):
        jpaged.LLM("tiny", speculative_config=config, enforce_eager=True)


def test_speculative_config_from_the_command_line():
    import argparse

    from jpaged.config import EngineConfig
    from serving.cli import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, '
                                                      '"prompt_lookup_max": 3}'])
    config = EngineConfig(**engine_kwargs(args))
    assert config.speculative_config == SpeculativeConfig("ngram", 4, prompt_lookup_max=3)
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineConfig(speculative_config=NGRAM, num_scheduler_steps=4)


def test_metrics_and_stats_line(plain):
    from serving.api_server import spec_decode_line
    from serving.metrics import Metrics

    llm = jpaged.LLM("tiny", speculative_config=NGRAM, enforce_eager=True, **LIMITS)
    stats = dict(llm.stats(), spec_decode_num_drafts=10, spec_decode_num_draft_tokens=30,
                 spec_decode_num_accepted_tokens=12, spec_decode_num_accepted_tokens_per_pos=[7, 4, 1])
    text = Metrics("tiny").render(stats)
    assert 'jpaged:spec_decode_num_drafts_total{model_name="tiny"} 10' in text
    assert 'jpaged:spec_decode_num_accepted_tokens_total{model_name="tiny"} 12' in text
    assert 'jpaged:spec_decode_num_accepted_tokens_per_pos{model_name="tiny",position="1"} 4' in text
    last = dict(stats, spec_decode_num_drafts=6, spec_decode_num_draft_tokens=18, spec_decode_num_accepted_tokens=6)
    # Since `last`: 4 runs, 12 drafted, 6 accepted -> 1 + 6 / 4 tokens per run.
    assert spec_decode_line(stats, last) == ("SpecDecoding metrics: Mean acceptance length: 2.50, Accepted: 6 tokens, "
                                             "Drafted: 12 tokens, Draft acceptance rate: 50.0%")
    assert spec_decode_line(stats, stats) is None
    assert "spec_decode" not in Metrics("tiny").render(plain.stats())


def test_tensor_parallel(monkeypatch, plain):
    """Verification on a 2-device tensor-parallel mesh (the CPU's fake devices): the same outputs."""
    rng = np.random.default_rng(SEED)
    prompts = distinct_prompts(rng, (5, 14, 9))
    sp = jpaged.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference = generate(plain, prompts, sp)
    draft_from(monkeypatch, [(p, list(o.token_ids)) for p, o in zip(prompts, reference)], rng)
    llm = jpaged.LLM("tiny", speculative_config=NGRAM, tensor_parallel_size=2, enforce_eager=True, **LIMITS)
    assert [o.token_ids for o in generate(llm, prompts, sp)] == [o.token_ids for o in reference]
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0


def test_server_speculative_config_flag():
    """`jpaged serve --speculative-config '<json>'` speculates (a prompt that repeats itself has
    n-grams to look up, even in random weights' outputs) and exports the counters."""
    import json

    from test_server import Server, get, post, run

    server = Server("--speculative-config", json.dumps(NGRAM), "--enforce-eager", "--max-model-len", "128",
                    "--max-num-seqs", "4")
    try:
        status, body = run(post(server.url, "/v1/completions", {"model": "tiny", "prompt": "abcabcabcabcabc" * 3,
                                                                  "max_tokens": 24, "ignore_eos": True,
                                                                  "temperature": 0}, headers={}))
        assert status == 200 and body["usage"]["completion_tokens"] == 24, json.dumps(body)
        status, text = run(get(server.url, "/metrics", headers={}))
        assert status == 200
        drafts = [line for line in text.splitlines() if line.startswith("jpaged:spec_decode_num_drafts_total")]
        assert drafts and float(drafts[0].split()[-1]) > 0, text
    finally:
        assert server.stop() == 0


def test_bf16_greedy_with_batch_invariance_equals_plain_decoding(monkeypatch):
    """In bf16 a verification step scores several tokens of a sequence in one batch, whose rounding
    differs from one-token decode steps (on an H200: 7 of 8 n-gram outputs equal plain greedy).
    With batch_invariant=True the two agree token for token and in their logprobs, bit for bit."""
    rng = np.random.default_rng(SEED)
    prompts = distinct_prompts(rng, [5, 9, 13, 20, 7, 11, 3, 17])
    sp = jpaged.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    limits = dict(LIMITS, dtype="bfloat16", batch_invariant=True, enforce_eager=True)
    plain = generate(jpaged.LLM("tiny", **limits), prompts, sp)
    draft_from(monkeypatch, [(p, o.token_ids) for p, o in zip(prompts, plain)], rng)
    llm = jpaged.LLM("tiny", speculative_config=NGRAM, **limits)
    spec = generate(llm, prompts, sp)
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0  # drafts were verified and taken
    for a, b in zip(spec, plain):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
