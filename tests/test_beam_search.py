"""Beam search in the engine (vLLM v0.4 semantics) against a plain reference beam search that
shares nothing: every candidate's next-token logprobs are recomputed from its whole token list,
from scratch, by the same model in fresh pages. On `tiny` and on a small HF Llama checkpoint,
widths 1-4, each early_stopping mode and several length penalties; under preemption too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jpaged
from jpaged.models.forward_context import AttentionMetadata, ForwardContext, forward_context
from jpaged.models.kv_cache import KVCache

PAD = 64  # the reference pads every forward pass to this many tokens: one compiled shape
LIMITS = dict(dtype="float32", block_size=8, max_model_len=PAD, max_num_seqs=16, max_num_batched_tokens=64,
              enforce_eager=True)
MAX_TOKENS = 8
# (beam width, n, early_stopping, length_penalty)
CASES = [(1, 1, False, 1.0), (2, 2, False, 1.0), (3, 2, True, 0.5), (4, 4, "never", 2.0), (4, 3, "never", 0.0)]


def beam_params(width, n, early_stopping, length_penalty, **kwargs):
    return jpaged.SamplingParams(use_beam_search=True, n=n, best_of=width, temperature=0, max_tokens=MAX_TOKENS,
                                 early_stopping=early_stopping, length_penalty=length_penalty, **kwargs)


def reference_logprobs(llm):
    """token ids -> the model's next-token logprobs (float32[vocab]), computed from scratch."""
    runner = llm.llm_engine.runner
    bs = runner.block_size
    pos = jnp.arange(PAD, dtype=jnp.int32)

    @jax.jit
    def forward(state, ids, n):
        model = nnx.merge(runner.graphdef, state)
        k = runner.kv_cache.k_pages  # a fresh pool of PAD // bs pages per layer
        kv_cache = KVCache(*(jnp.zeros((k.shape[0], runner.num_layers * PAD // bs) + k.shape[2:], k.dtype),) * 2,
                           raw_of=runner.kv_cache.raw_of)
        meta = AttentionMetadata(slot_mapping=jnp.where(pos < n, pos, -1),
                                 block_tables=jnp.arange(PAD // bs, dtype=jnp.int32)[None], context_lens=n[None],
                                 query_start_loc=jnp.stack([jnp.int32(0), n]))
        with forward_context(ForwardContext(meta)):
            hidden, _ = model(ids, pos, kv_cache)
        return jax.nn.log_softmax(model.compute_logits(hidden[n - 1][None])[0].astype(jnp.float32))

    def logprobs(token_ids):
        ids = np.zeros(PAD, np.int32)
        ids[:len(token_ids)] = token_ids
        return np.asarray(forward(runner.state, ids, np.int32(len(token_ids)))).astype(np.float64)

    return logprobs


def reference_beam_search(logprobs, prompt, sp, eos, max_model_len):
    """vLLM v0.4's beam search, spelled out: [(output token ids, cumulative logprob)], best first."""
    width = sp.best_of

    def score(tokens, cum, seq_len=None):
        if seq_len is None:
            seq_len = len(tokens) - (tokens[-1] == eos)
        return cum / seq_len ** sp.length_penalty

    def by_score(beams):
        return sorted(beams, key=lambda beam: score(*beam), reverse=True)

    running, finished = [(list(prompt), 0.0)], []
    while running:
        scores = np.stack([cum + logprobs(tokens) for tokens, cum in running])
        vocab = scores.shape[1]
        best = np.argsort(-scores.ravel(), kind="stable")[:2 * width]
        children = []  # in the engine's order: by parent, then by score
        for parent, (tokens, _) in enumerate(running):
            for i in best[best // vocab == parent]:
                child = tokens + [int(i % vocab)]
                done = child[-1] == eos or len(child) - len(prompt) == sp.max_tokens or len(child) >= max_model_len
                children.append((child, float(scores.flat[i]), done))
        finished = by_score(finished + [(t, c) for t, c, done in children if done])
        running = by_score([(t, c) for t, c, done in children if not done])
        if not running or len(finished) < width:
            stop = not running
        elif sp.early_stopping is True:
            stop = True
        else:
            seq_len = None
            if sp.early_stopping == "never" and sp.length_penalty > 0:
                seq_len = max(len(prompt) + sp.max_tokens, max_model_len)
            stop = score(*finished[width - 1]) >= score(*running[0], seq_len)
        finished = finished[:width]
        running = [] if stop else running[:width]
    return [(tokens[len(prompt):], cum) for tokens, cum in finished[:sp.n]]


def assert_matches_reference(llm, prompts, eos):
    logprobs = reference_logprobs(llm)
    requests = [(prompt, beam_params(*case)) for prompt in prompts for case in CASES]
    outs = llm.generate([p for p, _ in requests], [sp for _, sp in requests], use_tqdm=False)
    for (prompt, sp), out in zip(requests, outs):
        expected = reference_beam_search(logprobs, prompt, sp, eos, llm.llm_engine.max_model_len)
        assert [c.token_ids for c in out.outputs] == [tokens for tokens, _ in expected], sp
        np.testing.assert_allclose([c.cumulative_logprob for c in out.outputs], [cum for _, cum in expected],
                                   rtol=1e-5, atol=1e-4)
        assert [c.index for c in out.outputs] == list(range(sp.n))
    stats = llm.stats()
    assert stats["num_gpu_blocks_in_use"] == 0 and stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    return outs


def frequent_eos(llm, prompt):
    """Make a token the greedy path takes early the EOS, so that beams finish at different steps."""
    greedy = llm.generate([prompt], jpaged.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    llm.llm_engine.eos_token_id = greedy[2]
    return greedy[2]


@pytest.fixture(scope="module")
def tiny():
    return jpaged.LLM("tiny", num_gpu_blocks_override=96, **LIMITS)


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    torch = pytest.importorskip("torch")
    import transformers as tf
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=160, max_position_embeddings=256, hidden_size=64, intermediate_size=96,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3)
    path = tmp_path_factory.mktemp("llama")
    tf.LlamaForCausalLM(config).save_pretrained(path)
    return jpaged.LLM(str(path), num_gpu_blocks_override=96, **LIMITS)


def test_beam_search_equals_the_reference_on_tiny(tiny):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (5, 17)]
    eos = frequent_eos(tiny, prompts[0])
    outs = assert_matches_reference(tiny, prompts, eos)
    assert any(c.finish_reason == "stop" for o in outs for c in o.outputs)  # some beams ended at EOS
    assert any(c.finish_reason == "length" for o in outs for c in o.outputs)


def test_beam_search_equals_the_reference_on_an_hf_checkpoint(hf_llama):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 160, size=n).tolist() for n in (8, 13)]
    assert_matches_reference(hf_llama, prompts, frequent_eos(hf_llama, prompts[1]))


def test_width_one_is_greedy(tiny):
    prompt = np.random.default_rng(2).integers(0, 256, size=11).tolist()
    greedy = tiny.generate([prompt], jpaged.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
                           use_tqdm=False)[0].outputs[0]
    beam = tiny.generate([prompt], jpaged.SamplingParams(use_beam_search=True, temperature=0, max_tokens=12,
                                                         ignore_eos=True, logprobs=2), use_tqdm=False)[0].outputs
    assert len(beam) == 1 and beam[0].token_ids == greedy.token_ids
    assert beam[0].cumulative_logprob == pytest.approx(greedy.cumulative_logprob, abs=1e-5)
    assert beam[0].logprobs == greedy.logprobs


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_beams_are_preempted_together(tiny, preemption_mode):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (20, 26, 30)]
    params = [beam_params(4, 2, "never", 1.0, ignore_eos=True)] * 3
    expected = tiny.generate(prompts, params, use_tqdm=False)
    # 12 blocks of 8 tokens: three groups of four beams can't all grow at once.
    cramped = jpaged.LLM("tiny", num_gpu_blocks_override=12, preemption_mode=preemption_mode, swap_space=0.01,
                         **LIMITS)
    outs = cramped.generate(prompts, params, use_tqdm=False)
    assert cramped.stats()["num_preemptions"] > 0
    for ref, out in zip(expected, outs):
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
    stats = cramped.stats()
    assert stats["num_gpu_blocks_in_use"] == 0 and stats["num_free_cpu_blocks"] == stats["num_cpu_blocks"]


def test_beam_width_is_limited_by_the_top_logprobs(tiny):
    with pytest.raises(ValueError, match="best_of=11; beam search supports at most 10 beams"):
        tiny.generate([[1, 2]], beam_params(11, 1, False, 1.0), use_tqdm=False)
