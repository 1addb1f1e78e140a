"""LayerStack unrolled (as the loader builds it on a GPU: stacked.unroll_layers_on_gpu) computes what
the scan does (the CPU's form), through the engine's paged prefill, per-layer sliding windows, rope
bases and EAGLE-3's captured hidden states included; and only a GPU mesh unrolls."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jpaged
from jpaged.models.forward_context import ForwardContext, capture_hidden_states, forward_context
from jpaged.models.paged_attention import AttentionMetadata
from jpaged.models.stacked import LayerStack, unroll_layers_on_gpu
from test_models import VOCAB, make_checkpoint

SEED = 20261128


def stacks(model):
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, LayerStack)]


def logits_and_cache(model, kv_cache, ids, block_size, capture_layers=()):
    n = len(ids)
    meta = AttentionMetadata(slot_mapping=jnp.arange(n, dtype=jnp.int32),
                             block_tables=jnp.arange(-(-n // block_size), dtype=jnp.int32)[None],
                             context_lens=jnp.array([n], jnp.int32), query_start_loc=jnp.array([0, n], jnp.int32))
    with forward_context(ForwardContext(meta)), capture_hidden_states(capture_layers) as captured:
        hidden, kv_cache = model(jnp.array(ids, jnp.int32), jnp.arange(n, dtype=jnp.int32), kv_cache)
    states = captured["states"]
    return np.asarray(model.compute_logits(hidden)), kv_cache, states


@pytest.mark.parametrize("case", ["llama3-gqa-rope-scaling", "gemma2", "gemma3", "qwen3-tied-sliding-layer"])
def test_unrolled_stack_equals_the_scan(case, tmp_path):
    make_checkpoint(tmp_path, case)
    llm = jpaged.LLM(str(tmp_path), dtype="float32", block_size=8, enforce_eager=True, max_model_len=128,
                     max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks_override=32)
    runner = llm.llm_engine.runner
    rng = np.random.default_rng(SEED)
    print(f"seed {SEED}")
    ids = rng.integers(0, VOCAB, size=int(rng.integers(17, 60))).tolist()
    capture = (0, 1, 1)  # EAGLE-3's features: a layer named twice too
    results = []
    for unroll in (False, True):
        model = nnx.merge(runner.graphdef, runner.state)
        assert stacks(model) and all(not s.unroll for s in stacks(model)), "a CPU engine scans its layers"
        for stack in stacks(model):
            stack.unroll = unroll
        kv_cache = jax.tree.map(jnp.zeros_like, runner.kv_cache)
        results.append(logits_and_cache(model, kv_cache, ids, runner.block_size, capture))
    (scan_logits, scan_cache, scan_states), (unrolled_logits, unrolled_cache, unrolled_states) = results
    assert np.abs(scan_logits).max() > 0.1
    np.testing.assert_allclose(unrolled_logits, scan_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(unrolled_states), np.asarray(scan_states), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(unrolled_cache), jax.tree.leaves(scan_cache)):  # every layer's K/V written alike
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-5)


class _Platform:
    def __init__(self, platform):
        self.platform = platform


class _Mesh:
    def __init__(self, platform):
        self.devices = np.array([_Platform(platform)], dtype=object)


def test_only_a_gpu_unrolls():
    llm = jpaged.LLM("tiny", enforce_eager=True, max_model_len=64, max_num_seqs=2, num_gpu_blocks_override=16)
    runner = llm.llm_engine.runner
    for platform, expected in (("cpu", False), ("gpu", True)):
        model = nnx.merge(runner.graphdef, runner.state)
        unroll_layers_on_gpu(model, _Mesh(platform))
        assert stacks(model) and all(s.unroll is expected for s in stacks(model)), platform



def test_scan_layers_keeps_the_scan_on_a_gpu_and_changes_the_cache_key(monkeypatch):
    """$JPAGED_SCAN_LAYERS=1: a GPU keeps its LayerStack's scan; the executable cache's key says which
    form was compiled (engine/start_up.model_fingerprint), so neither loads the other's executables."""
    import types

    import transformers

    from jpaged.engine import start_up
    from jpaged.models.stacked import SCAN_LAYERS_ENV, layers_form

    llm = jpaged.LLM("tiny", enforce_eager=True, max_model_len=64, max_num_seqs=2, num_gpu_blocks_override=16)
    engine = llm.llm_engine
    runner = engine.runner
    config = transformers.LlamaConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1)
    fingerprints = {}
    for scan in ("1", ""):
        monkeypatch.setenv(SCAN_LAYERS_ENV, scan)
        model = nnx.merge(runner.graphdef, runner.state)
        unroll_layers_on_gpu(model, _Mesh("gpu"))
        assert all(s.unroll is (not scan) for s in stacks(model)), scan
        loaded = types.SimpleNamespace(hf_config=config, dtype=jnp.dtype(jnp.float32), model=model)
        fingerprints[layers_form(model)] = start_up.model_fingerprint(engine.config, loaded, 64)
    assert set(fingerprints) == {"scanned", "unrolled"} and len(set(fingerprints.values())) == 2
