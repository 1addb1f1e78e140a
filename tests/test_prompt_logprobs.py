"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs; the server's echo + logprobs) against
HF transformers in float64: through chunked prefill, beside prefix-cache hits (a request that
asks for them computes its whole prompt), and across recompute preemption."""

import numpy as np
import pytest

import jpaged

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=200, max_position_embeddings=256, hidden_size=64, intermediate_size=96,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3)
    path = tmp_path_factory.mktemp("llama")
    model = tf.LlamaForCausalLM(config)
    model.save_pretrained(path)
    return str(path), model.double().eval()


def hf_prompt_logprobs(model, ids: list[int]) -> np.ndarray:
    """log p(token i | tokens < i) for i >= 1, in float64, and the full log-softmax rows."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].numpy()
    z = logits - logits.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_prompt_logprobs_match_hf(checkpoint):
    path, model = checkpoint
    # A small token budget chunks the long prompts; a small pool preempts (recompute) while decoding.
    llm = jpaged.LLM(path, enforce_eager=True, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32,
                     num_gpu_blocks_override=12, enable_prefix_caching=True, preemption_mode="recompute")
    rng = np.random.default_rng()
    shared = rng.integers(0, 200, size=48).tolist()
    prompts = [shared + rng.integers(0, 200, size=int(n)).tolist() for n in (5, 30, 1)]
    prompts.append(rng.integers(0, 200, size=90).tolist())
    # Warm the prefix cache with the shared prefix: a request without prompt logprobs takes its hits;
    # then prompts sharing it ask for prompt logprobs (and must compute the whole prompt).
    llm.generate([shared + [7]], jpaged.SamplingParams(max_tokens=1), use_tqdm=False)
    llm.generate([shared + [9, 9]], jpaged.SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.stats()["prefix_cache_hits"] == 48
    params = [jpaged.SamplingParams(prompt_logprobs=k, max_tokens=40, temperature=0, ignore_eos=True)
              for k in (0, 3, 1, 5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    for out, ids, sp in zip(outs, prompts, params):
        ref = hf_prompt_logprobs(model, ids)
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        for i in range(1, len(ids)):
            entry, row = out.prompt_logprobs[i], ref[i - 1]
            assert abs(entry[ids[i]] - row[ids[i]]) < 1e-4, (i, entry[ids[i]], row[ids[i]])
            top = sorted(entry.items(), key=lambda kv: -kv[1])
            best = np.sort(row)[::-1][:sp.prompt_logprobs]
            assert len(entry) in (sp.prompt_logprobs, sp.prompt_logprobs + 1)  # top k, and the token if not in it
            np.testing.assert_allclose([lp for t, lp in top[:sp.prompt_logprobs]], best, atol=1e-4)
        assert len(out.outputs[0].token_ids) == 40
