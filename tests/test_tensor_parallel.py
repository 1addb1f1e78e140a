"""Tensor parallelism on 8 CPU devices (tests/conftest.py): for TP = 2, 4, 8 the logits equal
TP=1's within 1e-5 (relative to the logits' scale) and greedy outputs are identical (also under
swap preemption and copy-on-write); weights and KV pages are really split; bad sizes fail
before any allocation.

Why relative: a row-parallel projection sums its partial products in another order, and fp32
rounds differently. That difference is the size of fp32's own noise floor: TP=1 alone, computing
the same prompt packed with another sequence, moves tiny's logits (|logit| up to 30) by up to
7e-5 and the HF models' (|logit| ~ 9) by 2e-5; TP moves them by at most 4e-6 of max |logit|.
"""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers as tf
from flax import nnx

import jpaged
from jpaged.models.forward_context import AttentionMetadata, ForwardContext, forward_context
from jpaged.parallel.sharding import LOGICAL_AXIS_RULES

LIMITS = dict(dtype="float32", block_size=8, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
              swap_space=0.002, enforce_eager=True)
VOCAB = 160  # divisible by 8: the embedding and LM head are split too (tiny's 259 is replicated)
HF_LLAMA = dict(vocab_size=VOCAB, max_position_embeddings=256, hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=8, head_dim=8, initializer_range=0.3)
# kv heads 1 (MQA, with q/k/v biases and a tied LM head), 2 (GQA) and 8 (MHA).
HF_CASES = {"kv1": dict(num_key_value_heads=1, attention_bias=True, tie_word_embeddings=True),
            "kv2": dict(num_key_value_heads=2), "kv8": dict(num_key_value_heads=8)}
# Another layout through the same rules: fused c_attn, [in, out] weights, biases, learned positions.
GPT2 = dict(vocab_size=VOCAB, n_positions=256, n_embd=64, n_layer=2, n_head=4, initializer_range=0.3)
SPLIT_AXES = {name for name, axis in LOGICAL_AXIS_RULES.items() if axis is not None}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    torch = pytest.importorskip("torch")
    configs = {name: tf.LlamaConfig(**HF_LLAMA, **kwargs) for name, kwargs in HF_CASES.items()}
    configs["gpt2"] = tf.GPT2Config(**GPT2)
    paths = {"tiny": "tiny"}
    for seed, (name, config) in enumerate(configs.items()):
        torch.manual_seed(seed)
        path = tmp_path_factory.mktemp(name)
        tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
        paths[name] = str(path)
    return paths


@pytest.fixture(scope="module")
def engine(checkpoints):
    """engine(model, tp, **kwargs): an LLM, built once per module for each distinct set of arguments."""
    built = {}

    def get(model: str, tp: int, **kwargs) -> jpaged.LLM:
        if tp > jax.device_count():  # e.g. the suite run on a one-GPU machine
            pytest.skip(f"needs {tp} devices, {jax.device_count()} available")
        key = (model, tp, tuple(sorted(kwargs.items())))
        if key not in built:
            built[key] = jpaged.LLM(checkpoints[model], tensor_parallel_size=tp, **{**LIMITS, **kwargs})
        return built[key]

    yield get
    built.clear()


def workload(vocab: int, num: int = 6, seed: int = 0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, size=rng.integers(5, 60)).tolist() for _ in range(num)]
    return prompts, jpaged.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)


def prompt_logits(llm: jpaged.LLM, ids: list[int], num_tokens: int = 64) -> np.ndarray:
    """Every prompt position's logits through the paged prefill path, in fresh (sharded) pages;
    padded to `num_tokens` so that every prompt reuses one compiled forward."""
    runner = llm.llm_engine.runner
    n = len(ids)
    kv_cache = jax.tree.map(lambda pages: jnp.zeros(pages.shape, pages.dtype, device=pages.sharding), runner.kv_cache)
    slots = np.full(num_tokens, -1, np.int32)
    slots[:n] = np.arange(n)
    meta = AttentionMetadata(slot_mapping=slots,
                             block_tables=np.arange(num_tokens // runner.block_size, dtype=np.int32)[None],
                             context_lens=np.array([n], np.int32), query_start_loc=np.array([0, n], np.int32))

    @jax.jit
    def forward(state, kv_cache, ids, positions, meta):
        model = nnx.merge(runner.graphdef, state)
        with forward_context(ForwardContext(meta)):
            hidden, _ = model(ids, positions, kv_cache)
        return model.compute_logits(hidden)

    padded = np.zeros(num_tokens, np.int32)
    padded[:n] = ids
    return np.asarray(forward(runner.state, kv_cache, padded, np.arange(num_tokens, dtype=np.int32), meta))[:n]


def logits_tolerance(reference_logits: np.ndarray) -> float:
    return 1e-5 * max(1.0, np.abs(reference_logits).max())


def assert_same_outputs(reference, outs, atol: float):
    """Identical tokens, and logprobs within the logits' tolerance."""
    for ref, out in zip(reference, outs, strict=True):
        for a, b in zip(ref.outputs, out.outputs, strict=True):
            assert a.token_ids == b.token_ids
            for lp_a, lp_b in zip(a.logprobs, b.logprobs, strict=True):
                assert lp_a.keys() == lp_b.keys()
                assert np.allclose(list(lp_a.values()), list(lp_b.values()), rtol=0, atol=atol)


def assert_sharded(llm: jpaged.LLM, tp: int):
    """Each weight is split as its logical axes say, and every device holds 1/tp of each KV page array."""
    runner = llm.llm_engine.runner
    devices = set(jax.devices()[:tp])
    model = nnx.merge(runner.graphdef, runner.state)
    num_split = 0
    for _, param in nnx.iter_graph(model):
        if not isinstance(param, nnx.Param):
            continue
        value = param[...]
        split = [name in SPLIT_AXES and size % tp == 0 for name, size in zip(param.logical_axes, value.shape)]
        expected = tuple(size // tp if s else size for s, size in zip(split, value.shape))
        assert {shard.device for shard in value.addressable_shards} == devices
        assert all(shard.data.shape == expected for shard in value.addressable_shards), (param.logical_axes, expected)
        num_split += any(split)
    assert num_split > 0
    for pages in jax.tree.leaves(runner.kv_cache):
        shards = pages.addressable_shards
        assert {s.device for s in shards} == devices
        assert all(s.data.shape == (pages.shape[0] // tp,) + pages.shape[1:] for s in shards)
        assert all(s.data.nbytes * tp == pages.nbytes for s in shards)


MESHES = [("tiny", 2), ("tiny", 4), ("gpt2", 4)] + [(case, tp) for case in HF_CASES for tp in (2, 4, 8)]


@pytest.mark.parametrize("model,tp", MESHES)
def test_logits_and_greedy_outputs_match_tp1(engine, model, tp):
    reference, llm = engine(model, 1), engine(model, tp)
    assert_sharded(llm, tp)
    prompts, sp = workload(llm.llm_engine.hf_config.vocab_size)
    atol = 0.0
    for ids in prompts[:2]:
        expected = prompt_logits(reference, ids)
        atol = max(atol, logits_tolerance(expected))
        assert np.abs(prompt_logits(llm, ids) - expected).max() <= logits_tolerance(expected)
    assert_same_outputs(reference.generate(prompts, sp, use_tqdm=False), llm.generate(prompts, sp, use_tqdm=False),
                        atol)


@pytest.mark.parametrize("tp", [2, 4])
def test_swap_preemption_and_copy_on_write_match_tp1(engine, tp):
    """18 blocks of 8 tokens cannot hold 4 sequences of up to ~70 tokens: swap-out/in happens on
    sharded pages. Seeded parallel sampling forks sequences and copies their shared last block."""
    prompts, greedy = workload(259, num=8, seed=1)
    params = [greedy] * 6 + [jpaged.SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True,
                                                   logprobs=1)] * 2
    tp1 = engine("tiny", 1)
    reference = tp1.generate(prompts, params, use_tqdm=False)
    llm = engine("tiny", tp, num_gpu_blocks_override=18, preemption_mode="swap")
    before = llm.stats()["num_preemptions"]
    atol = logits_tolerance(prompt_logits(tp1, prompts[0]))
    assert_same_outputs(reference, llm.generate(prompts, params, use_tqdm=False), atol)
    stats = llm.stats()
    assert stats["num_preemptions"] > before
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    assert stats["num_free_cpu_blocks"] == stats["num_cpu_blocks"]


def test_pallas_kernels_run_per_shard(engine):
    """The Pallas kernels (interpret mode off-GPU) inside shard_map, with tiny's 2 kv heads
    replicated over 4 shards, give TP=1's greedy tokens."""
    prompts, _ = workload(259, num=3, seed=3)
    sp = jpaged.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    reference = engine("tiny", 1).generate(prompts, sp, use_tqdm=False)
    outs = engine("tiny", 4, attention_backend="pallas").generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]


def test_bench_throughput_tensor_parallel():
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench_throughput.py")
    spec = importlib.util.spec_from_file_location("bench_throughput", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    report = bench.main(["--model", "tiny", "--tensor-parallel-size", "2", "--num-prompts", "4", "--input-len", "12",
                         "--output-len", "6", "--enforce-eager", "--max-num-seqs", "4", "--max-num-batched-tokens",
                         "64", "--swap-space", "0.002", "--no-tqdm"])
    (result,) = report["results"]
    assert result["output_tokens"] == 24 and result["output_tokens_per_s"] > 0


def test_bad_sizes_fail_before_allocating(tmp_path):
    if jax.device_count() < 6:  # the head checks come after the device-count check
        pytest.skip("needs 6 devices")
    live = len(jax.live_arrays())
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide num_attention_heads=4"):
        jpaged.LLM("tiny", tensor_parallel_size=3)
    with pytest.raises(ValueError, match=rf"tensor_parallel_size=16 exceeds the {jax.device_count()} available"):
        jpaged.LLM("tiny", tensor_parallel_size=16)
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        jpaged.LLM("tiny", tensor_parallel_size=0)
    # Only a config: the check needs no weights.
    neither = "tensor_parallel_size=6 is neither a divisor nor a multiple of num_key_value_heads=4"
    for kv_heads, tp, message in [(6, 4, "tensor_parallel_size=4 does not divide num_key_value_heads=6"),
                                  (4, 6, neither)]:
        cfg = tf.LlamaConfig(**{**HF_LLAMA, "num_attention_heads": 12, "num_key_value_heads": kv_heads,
                                "hidden_size": 48, "head_dim": 4})
        cfg.architectures = ["LlamaForCausalLM"]
        cfg.save_pretrained(tmp_path / str(tp))
        with pytest.raises(ValueError, match=message):
            jpaged.LLM(str(tmp_path / str(tp)), tensor_parallel_size=tp)
    assert len(jax.live_arrays()) == live
