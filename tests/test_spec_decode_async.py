"""Speculative decoding with async scheduling (n-gram and draft model): steps that may take
drafts wait for the last step's tokens; the others (here: while more sequences run than
disable_by_batch_size) overlap, and skip the proposer's per-step work. Outputs equal the
synchronous engine's without speculation, greedy and seeded, and both overlapped steps and
accepted drafts happen."""

import numpy as np
import pytest

import jpaged
from test_async_scheduling import generate_counting_overlaps
from test_spec_decode import draft_from
from test_spec_decode_draft import write_tiny

SEED = 20261125
VOCAB = 259
LIMITS = dict(max_model_len=96, max_num_seqs=8, max_num_batched_tokens=64, enforce_eager=True)


def count_proposer_work(llm, hook: str) -> dict:
    """From now on: target steps that ran the proposer's per-step `hook` ("forward_kv": a draft
    model's K/V forward; "after_step": an EAGLE head's fill), steps that skipped it (above
    disable_by_batch_size), and the hook's calls."""
    runner, counts = llm.llm_engine.runner, {"with": 0, "without": 0, "calls": 0}
    run_step, work = runner._run_step, getattr(runner.proposer, hook)

    def counting_step(key, *args):  # key: (tokens, full sampler, the proposer's hooks)
        counts["with" if key[2] else "without"] += 1
        return run_step(key, *args)

    def counting_work(*args):
        counts["calls"] += 1
        return work(*args)

    runner._run_step = counting_step
    setattr(runner.proposer, hook, counting_work)
    return counts


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_async_speculation_equals_synchronous_without(method, monkeypatch, tmp_path):
    rng = np.random.default_rng(SEED)
    num = 8
    prompts = [[int(f)] + rng.integers(0, VOCAB, int(n)).tolist()
               for f, n in zip(rng.permutation(VOCAB)[:num], rng.integers(3, 20, num))]
    lengths = [4, 6, 8, 10, 12, 24, 28, 32]  # the batch thins out: overlap first, speculation at the end
    params = {"greedy": [jpaged.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths],
              "seeded": [jpaged.SamplingParams(temperature=1.0, top_k=20, max_tokens=n, ignore_eos=True, seed=7 + i)
                         for i, n in enumerate(lengths)]}
    plain = jpaged.LLM("tiny", **LIMITS)
    expected = {name: [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
                for name, sp in params.items()}
    spec = {"num_speculative_tokens": 3, "disable_by_batch_size": 3}
    if method == "ngram":
        spec["method"] = "ngram"
        draft_from(monkeypatch, [(p, list(o)) for p, o in zip(prompts + prompts, expected["greedy"]
                                                                 + expected["seeded"])], rng)
    else:
        # The tiny model cut to 2 layers: it agrees with the whole model often, not always.
        spec.update(method="draft_model", model=write_tiny(tmp_path / "tiny-2-layers", num_layers=2))
    llm = jpaged.LLM("tiny", speculative_config=spec, async_scheduling=True, **LIMITS)
    work = count_proposer_work(llm, "forward_kv")
    for name, sp in params.items():
        outputs, overlapped = generate_counting_overlaps(llm, prompts, sp)
        assert [o.outputs[0].token_ids for o in outputs] == expected[name], name
        assert overlapped > 0, name
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"]  # rejections too
    print(work)
    assert work["without"] > 0 and work["with"] > 0
    if method == "draft_model":  # (the n-gram proposer has no per-step work)
        assert work["calls"] == work["with"]
