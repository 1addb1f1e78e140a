"""Penalties through the engine, whose sampler keeps each sequence's tokens on the device (a row
of the token history, uploaded once and appended to by every step): greedy outputs must equal
HF transformers' model with vLLM's penalties applied in float64, while sequences join, leave,
change rows and are preempted (their history uploaded again)."""

import numpy as np
import torch

import jpaged
from test_engine import assert_all_blocks_free
from test_models import VOCAB, make_checkpoint


def hf_greedy_penalised(model, ids: list[int], steps: int, sp: jpaged.SamplingParams) -> list[int]:
    """HF's logits (whole sequence recomputed each step), vLLM's penalties in float64, argmax."""
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([tokens])).logits[0, -1].double().numpy()
            output = tokens[len(ids):]
            counts = np.bincount(output, minlength=len(logits)).astype(np.float64)
            seen = counts > 0
            seen[ids] = True
            r = sp.repetition_penalty
            logits = np.where(seen, np.where(logits > 0, logits / r, logits * r), logits)
            logits = logits - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0)
            tokens.append(int(np.argmax(logits)))
    return tokens[len(ids):]


def test_penalties_match_hf(tmp_path):
    hf = make_checkpoint(tmp_path, "llama3-gqa-rope-scaling")
    # 12 blocks of 8 tokens for 4 rows of up to 55 tokens: preemption (recompute).
    llm = jpaged.LLM(str(tmp_path), dtype="float32", block_size=8, enforce_eager=True, max_model_len=128,
                     max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks_override=12,
                     preemption_mode="recompute")
    rng = np.random.default_rng(20261123)  # greedy equality across implementations: no luck with near-ties
    prompts, params = [], []
    for i in range(10):
        # Repeated tokens in the prompt, so the repetition penalty has something to bite on.
        prompts.append(rng.integers(0, VOCAB // 4, size=int(rng.integers(16, 30))).tolist())
        penalised = i % 3 != 2  # and unpenalised requests in the same batches
        params.append(jpaged.SamplingParams(
            temperature=0, max_tokens=int(rng.integers(10, 25)), ignore_eos=True,
            repetition_penalty=float(rng.choice([1.0, 1.4, 0.7])) if penalised else 1.0,
            presence_penalty=float(rng.choice([0.0, 0.8, -0.5])) if penalised else 0.0,
            frequency_penalty=float(rng.choice([0.0, 0.6])) if penalised else 0.0))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    for prompt, sp, out in zip(prompts, params, outs):
        assert out.outputs[0].token_ids == hf_greedy_penalised(hf, prompt, sp.max_tokens, sp), sp
    assert_all_blocks_free(llm)


def test_penalties_with_history_uploads_narrower_than_max_model_len(tmp_path, monkeypatch):
    """Token-history uploads are as wide as their longest sequence needs (32, 128 or 256 columns
    here), not max_model_len: rows reused by a shorter sequence keep a longer one's tokens past
    its length, which the sampler must never read. The sampler counts a row's tokens 48 columns
    at a time (HISTORY_CHUNK, shrunk from 4096: 6 chunks, the last overlapping the one before,
    whose columns must not count twice)."""
    from jpaged.runner import buckets, step_functions

    monkeypatch.setattr(buckets, "HISTORY_MIN_WIDTH", 32)  # (256: the model's whole length)
    monkeypatch.setattr(step_functions, "HISTORY_CHUNK", 48)
    hf = make_checkpoint(tmp_path, "llama3-gqa-rope-scaling")
    llm = jpaged.LLM(str(tmp_path), dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=3,
                     max_num_batched_tokens=256, executable_cache=False)  # (the chunk is not in the cache's key)
    assert llm.llm_engine.runner.buckets.history == (32, 128, 256)
    rng = np.random.default_rng(20261128)  # fixed: greedy equality across implementations, no near-tie luck
    uploads = []
    runner = llm.llm_engine.runner
    write = runner._write_history
    runner._write_history = lambda rows, tokens: (uploads.append(tokens.shape[1]), write(rows, tokens))
    # Long prompts first, then short ones that take over their rows.
    lengths = [int(rng.integers(130, 230)) for _ in range(3)] + [int(rng.integers(8, 20)) for _ in range(5)]
    prompts = [rng.integers(0, VOCAB // 4, size=n).tolist() for n in lengths]
    params = [jpaged.SamplingParams(temperature=0, max_tokens=int(rng.integers(6, 12)), ignore_eos=True,
                                    repetition_penalty=float(rng.choice([1.4, 0.7])),
                                    presence_penalty=float(rng.choice([0.0, 0.8, -0.5])),
                                    frequency_penalty=float(rng.choice([0.0, 0.6]))) for _ in prompts]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert 32 in uploads and 256 in uploads, uploads
    for prompt, sp, out in zip(prompts, params, outs):
        assert out.outputs[0].token_ids == hf_greedy_penalised(hf, prompt, sp.max_tokens, sp), sp
    assert_all_blocks_free(llm)
