"""scripts/train_eagle3.py's data and head on the tiny model: the hidden states its
FeatureRecorder keeps from the generating steps are transformers' (float64) at the same tokens,
and a head trained on them for a few steps loads as an EAGLE-3 head whose engine's outputs are
those without speculation."""

import argparse

import numpy as np
import torch
import transformers

import jpaged
from jpaged.models import tiny
from scripts.eagle3_train_lib import train_head, write_head
from scripts.train_eagle3 import FeatureRecorder, next_token_labels
from test_spec_decode_draft import write_tiny

SEED = 20261128
LAYERS = (2, 2, 1)  # (2, L // 2, L - 3) of the tiny model's 4 layers
LIMITS = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, enforce_eager=True)


def test_recorded_features_are_transformers_and_the_head_loads(tmp_path):
    print("seed", SEED)
    rng = np.random.default_rng(SEED)
    # More prompts than max_num_seqs and prompts longer than the step budget: chunked prefills,
    # sequences that join as others finish.
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(3, 50, 7)]
    llm = jpaged.LLM("tiny", **LIMITS)
    recorder = FeatureRecorder.install(llm.llm_engine.runner, LAYERS)
    outs = llm.generate(prompts, jpaged.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    feats = recorder.features(seqs)

    model_dir = write_tiny(tmp_path / "tiny")
    target = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    worst = 0.0
    for seq, got in zip(seqs, feats):
        with torch.no_grad():
            states = target(torch.tensor([seq]), output_hidden_states=True).hidden_states
        want = np.concatenate([states[i][0].numpy() for i in LAYERS], -1)
        assert got.shape == want.shape
        # The last token is fed only by the step in flight when it was read (async scheduling, the
        # default): then its features are recorded too, and must be right as well.
        fed = len(seq) if got[-1].any() else len(seq) - 1
        worst = max(worst, float(np.abs(got[:fed] - want[:fed]).max() / np.abs(want[:fed]).max()))
    print("largest error relative to the largest value", worst)
    assert worst < 2e-3  # float16 storage

    cfg = tiny.tiny_config().to_dict()
    embed = next(tiny.tiny_weights(tiny.tiny_config()))[1]
    args = argparse.Namespace(minutes=0.05, draft_vocab=2048, ttt_steps=3, batch=4, lr=1e-3)
    params, draft_ids = train_head(cfg, seqs, feats, next_token_labels(seqs, [len(p) for p in prompts]), embed,
                                   np.ones(cfg["hidden_size"], np.float32), args)
    assert len(draft_ids) == cfg["vocab_size"] and all(np.isfinite(v).all() for v in params.values())
    (tmp_path / "head").mkdir()
    write_head(str(tmp_path / "head"), cfg, params, draft_ids, LAYERS)
    spec = {"method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": 3}
    speculating = jpaged.LLM("tiny", speculative_config=spec, **LIMITS)
    again = speculating.generate(prompts, jpaged.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                 use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    assert speculating.stats()["spec_decode_num_draft_tokens"] > 0
