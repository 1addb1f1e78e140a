"""The smallest token bucket on a GPU (runner/buckets.py MIN_TOKEN_BUCKET): steps of fewer tokens
run padded to it, so the warm-up compiles no forward below it and no sampler row bucket that no
step reaches. Here the CPU is given the GPU's floor, and a Llama checkpoint made by transformers'
save_pretrained must generate what transformers generates, token for token, with nothing
compiled while serving: a lone decode (1 token padded to 16), a batch, chunked prompts, and
K-step decodes (whose buckets start at the floor)."""

import numpy as np
import pytest

import jpaged
from jpaged.runner import buckets as bucket_module
from test_kv_pool_size import _random_llama

FLOOR = 16


def hf_greedy(path, prompts, max_new_tokens):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                 min_new_tokens=max_new_tokens, pad_token_id=0)
            out.append(ids[0, len(prompt):].tolist())
    return out


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_steps_below_the_floor_run_padded_to_it_and_match_transformers(num_scheduler_steps, monkeypatch, tmp_path,
                                                                        test_seed):
    monkeypatch.setitem(bucket_module.MIN_TOKEN_BUCKET, "cpu", FLOOR)
    path = _random_llama(tmp_path / "llama", test_seed)
    rng = np.random.default_rng(test_seed)
    # A lone short prompt, then a batch with prompts longer than a step's token budget (chunked).
    lone = [rng.integers(1, 300, size=3).tolist()]
    batch = [rng.integers(1, 300, size=int(n)).tolist() for n in (5, 17, 70, 2, 41)]
    llm = jpaged.LLM(path, dtype="float32", max_num_seqs=32, max_model_len=256, max_num_batched_tokens=64,
                     num_scheduler_steps=num_scheduler_steps, background_warmup=False, enable_prefix_caching=False)
    runner = llm.llm_engine.runner
    assert runner.buckets.tokens[0] == FLOOR
    assert all(key[1] >= FLOOR for key in runner.buckets.keys() if key[0] in ("forward", "multi_step"))
    assert min(key[1] for key in runner.buckets.keys() if key[0] == "sample") == runner.buckets.sample_rows(FLOOR)
    compiled = llm.stats()["num_compilations"]
    sp = jpaged.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(lone, sp, use_tqdm=False)]
    got += [o.outputs[0].token_ids for o in llm.generate(batch, sp, use_tqdm=False)]
    assert llm.stats()["num_compilations"] == compiled  # every step found its executable
    assert [list(t) for t in got] == hf_greedy(path, lone + batch, 10)


def test_the_floor_leaves_out_what_no_step_reaches():
    """The ladders with and without a floor: the same buckets from the floor up, none below it,
    sampler rows from what a floor-sized step samples; a floor above max_num_seqs stops there."""
    plain = bucket_module.Buckets.create(128, 2048, 40)
    floored = bucket_module.Buckets.create(128, 2048, 40, min_tokens=FLOOR)
    assert floored.tokens == [t for t in plain.tokens if t >= FLOOR] and floored.tokens[0] == FLOOR
    assert floored.rows == [r for r in plain.rows if r >= plain.sample_rows(FLOOR)]
    assert set(floored.keys()) < set(plain.keys())
    small = bucket_module.Buckets.create(4, 64, 16, num_scheduler_steps=4, min_tokens=FLOOR)
    assert small.tokens[0] == 4 and small.decode_tokens == [4]
    spec = bucket_module.Buckets.create(8, 256, 16, num_speculative_tokens=3, min_tokens=FLOOR)
    assert spec.tokens[0] == 8 and spec.rows == [8, 16, 32]
