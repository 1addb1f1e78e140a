"""Compilation: after warm-up nothing compiles, whatever the workload (checked with jax's own
instrumentation, not the engine's counter); the scanned step updates the KV pool in place."""

import os
import re

import jax
import numpy as np
import pytest

import jpaged
from jpaged.config import EngineConfig
from jpaged.runner.buckets import BLOCK_OP_SIZES

BS = 16


@pytest.fixture(scope="module")
def llm():
    # A small pool (8 sequences of 128 tokens would need 64 blocks) so that the workload preempts;
    # multi-step decode when every running request allows it.
    return jpaged.LLM(model="tiny", max_num_seqs=8, max_model_len=128, max_num_batched_tokens=128,
                      num_gpu_blocks_override=24, swap_space=0.01, enable_prefix_caching=True, num_scheduler_steps=4,
                      background_warmup=False)


class CompileRecorder:
    """Every executable jax obtains (compiled or loaded from the persistent cache) while active."""

    def __init__(self):
        self.events = []

    def __call__(self, event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            self.events.append(kwargs.get("fun_name", "?"))

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


def test_recorder_sees_compilations():
    with CompileRecorder() as recorder:
        jax.jit(lambda x: x * 3 + 1)(np.arange(7.0))
    assert len(recorder.events) == 1


def test_nothing_compiles_after_warm_up(llm):
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 256, size=3 * BS).tolist()
    prompts = [shared + rng.integers(0, 256, size=rng.integers(1, 40)).tolist() for _ in range(6)]
    prompts += [rng.integers(0, 256, size=rng.integers(1, 90)).tolist() for _ in range(6)]
    greedy = jpaged.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    workload = [
        jpaged.SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=40, ignore_eos=True),  # copy-on-write
        jpaged.SamplingParams(use_beam_search=True, n=3, temperature=0, max_tokens=12, ignore_eos=True),
        jpaged.SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_tokens=30, ignore_eos=True, logprobs=5,
                              presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, min_tokens=4),
        greedy,
        jpaged.SamplingParams(temperature=0.8, max_tokens=30, guided_regex="[a-z ]{5,60}", logit_bias={66: 3.0}),
        jpaged.SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=2, logprobs=1),
    ]
    params = [workload[i % len(workload)] for i in range(len(prompts))]
    compiled = llm.stats()["num_compilations"]
    with CompileRecorder() as recorder:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        # and multi-step decodes
        multi = llm.generate(prompts[:8], [greedy] * 8, use_tqdm=False) + llm.generate(prompts[:1], greedy)
    assert all(o.finished for o in outs + multi)
    # The workload did exercise every path: both kinds of preemption, swaps, copies and prefix hits.
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert recorder.events == [], f"compiled after warm-up: {recorder.events}"
    assert stats["num_compilations"] == compiled


def test_every_block_operation_is_warm(llm):
    runner = llm.llm_engine.runner
    for op in ("copy_blocks", "swap_out", "swap_in"):
        for size in BLOCK_OP_SIZES:
            assert (op, size) in runner._executables
    assert runner.num_compilations == len(list(runner.buckets.keys()))


# Ops whose result may have the pool's shape: the donated pool itself passing through.
_POOL_PASS_THROUGH = {"parameter", "get-tuple-element", "bitcast", "tuple", "while", "conditional", "scatter"}


def pool_spanning_ops(hlo: str, dims: tuple[int, ...]) -> list[str]:
    """The compiled module's instructions that produce a pool-shaped array other than the pool
    passing through and its in-place scatter (a fusion counts as one when its root is a
    scatter): converts, copies, elementwise loops over the whole pool."""
    shape = r"\w+\[" + ",".join(map(str, dims)) + r"\]"
    roots, computation = {}, None
    for line in hlo.splitlines():
        header = re.match(r"(?:ENTRY )?%([\w.-]+) .*\{$", line)
        if header:
            computation = header.group(1)
        root = re.match(r"\s*ROOT %\S+ = \S+ ([\w-]+)\(", line)
        if root and computation:
            roots[computation] = root.group(1)
    spanning = []
    for line in hlo.splitlines():
        op = re.match(r"\s*(?:ROOT )?%\S+ = " + shape + r"\S* ([\w-]+)\(", line)
        if op is None or op.group(1) in _POOL_PASS_THROUGH:
            continue
        callee = re.search(r"calls=%([\w.-]+)", line)
        if op.group(1) == "fusion" and callee and roots.get(callee.group(1)) == "scatter":
            continue
        spanning.append(line.strip()[:200])
    return spanning


# As users' engines compile: where the suite's XLA_FLAGS pick XLA CPU's older emitters (conftest.py),
# which expand the scatter into a loop of whole-pool dynamic-update-slices, the fusion emitters.
AS_USERS_COMPILE = {"xla_cpu_use_fusion_emitters": True} \
    if "xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", "") else None


@pytest.mark.parametrize("dtype,kv_cache_dtype", [("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8"),
                                                  ("bfloat16", "fp8_e5m2")])
def test_step_updates_the_pool_in_place(dtype, kv_cache_dtype):
    """The scanned forward (and each block operation) aliases the donated KV pool to its output,
    needs scratch memory far below the pool's size (a bf16 model's scratch is its weights widened
    for the CPU's matmuls: 16 MB, whatever the pool), and no op but the in-place page write spans
    the pool: a step costs what it reads and writes, never the pool's size. (On a CPU, XLA has
    no bf16 or fp8 scatter: it converted the whole pool around each layer's write, 1.7 s per
    token for an fp8 pool of 8,192 blocks; those pools hold raw bits there.)"""
    llm = jpaged.LLM(model="tiny", max_num_seqs=8, max_model_len=128, max_num_batched_tokens=128, dtype=dtype,
                     kv_cache_dtype=kv_cache_dtype, num_gpu_blocks_override=8192, enforce_eager=True,
                     num_scheduler_steps=4)
    runner = llm.llm_engine.runner
    k_pages = runner.kv_cache.k_pages
    pool_bytes = k_pages.nbytes
    for key in (("forward", 8), ("forward", 128), ("multi_step", 8), ("copy_blocks", BLOCK_OP_SIZES[-1]),
                ("swap_in", BLOCK_OP_SIZES[-1])):
        compiled = runner._lower(key).compile(compiler_options=AS_USERS_COMPILE)
        memory = compiled.memory_analysis()
        assert memory.alias_size_in_bytes >= 2 * pool_bytes, key  # k and v pages donated and reused
        assert memory.temp_size_in_bytes < pool_bytes / 2, (key, memory.temp_size_in_bytes, pool_bytes)
        spanning = pool_spanning_ops(compiled.as_text(), k_pages.shape)
        assert spanning == [], (key, spanning[:3])


def test_optimization_level_reaches_every_compile_and_the_cache_key(tmp_path, monkeypatch):
    """optimization_level (--optimization-level): each step compiles with XLA's backend level set
    (seen at jax's compile call), under a key of its own in the executable cache (an executable
    of another level is never loaded), with the same greedy tokens; unset, no options are passed."""
    monkeypatch.setenv("JPAGED_CACHE_DIR", str(tmp_path))
    seen = []
    compile_lowered = jax.stages.Lowered.compile

    def recording(self, compiler_options=None, **kwargs):
        seen.append(compiler_options)
        return compile_lowered(self, compiler_options=compiler_options, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", recording)
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    greedy = jpaged.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens, files = {}, {}
    for level in (None, 0, 2):
        seen.clear()
        before = set(p.name for p in tmp_path.iterdir())
        llm = jpaged.LLM("tiny", optimization_level=level, enforce_eager=True, max_num_seqs=2, max_model_len=64)
        tokens[level] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        files[level] = set(p.name for p in tmp_path.iterdir()) - before
        steps = llm.llm_engine.runner.num_compilations
        expected = None if level is None else {"xla_backend_optimization_level": level}
        assert steps >= 2 and seen.count(expected) == steps, (level, steps, seen)
        assert len(files[level]) == steps  # each compiled here, none loaded from another level
    assert tokens[0] == tokens[2] == tokens[None]
    with pytest.raises(ValueError, match="optimization_level"):
        EngineConfig(optimization_level=4)
