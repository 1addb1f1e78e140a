"""Automatic prefix caching end to end on `tiny`: greedy outputs equal those without caching for
prompts sharing prefixes of many lengths (on a block boundary, one token before and after),
with and without preemption (recompute and swap); hit counts are exact; device pages nobody may
read are filled with NaN all along, so reading one would show. Mixed beam search, parallel
sampling and cached prefixes leave no block behind."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jpaged
from jpaged.runner.kv_transfer import every_layer

BS = 16
LIMITS = dict(block_size=BS, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128, enforce_eager=True)
PREFIX_LENS = [15, 16, 17, 31, 32, 33, 47, 48, 49]


def greedy(max_tokens, **kwargs):
    return jpaged.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1, **kwargs)


def shared_prefix_prompts(rng, base):
    """One prompt per prefix length: base[:n] and a suffix that differs from base at once; then the
    base's first 32 and 48 tokens alone (all their full blocks cached)."""
    prompts = []
    for n in PREFIX_LENS:
        suffix = rng.integers(0, 256, size=int(rng.integers(1, 20))).tolist()
        suffix[0] = (base[n] + 1) % 256
        prompts.append(base[:n] + suffix)
    return prompts + [base[:32], base[:48]]


def assert_same_greedy(reference, outs):
    """Identical greedy tokens, except after a near-tie in the reference (top-2 logprob gap < 1e-3):
    another batch shape rounds fp32 differently (see test_engine.py)."""
    for ref, out in zip(reference, outs):
        ref_ids, ids = ref.outputs[0].token_ids, out.outputs[0].token_ids
        assert len(ids) == len(ref_ids) and np.isfinite(out.outputs[0].cumulative_logprob)
        for step, (a, b) in enumerate(zip(ref_ids, ids)):
            if a != b:
                top2 = sorted(ref.outputs[0].logprobs[step].values(), reverse=True)[:2]
                assert top2[0] - top2[1] < 1e-3, f"diverged at step {step} without a near-tie"
                break


class Poisoner:
    """Fills with NaN every device page nobody may read: after each step the free ones (cached
    ones keep their prefix), and a cached page evicted for a new owner before the step that reuses
    it runs (unless that step first fills it from a swap-in or a copy)."""

    def __init__(self, llm):
        self.engine = engine = llm.llm_engine
        pool, runner = engine.block_manager.gpu_pool, engine.runner
        self.evicted, self.num_evicted, self.plan = [], 0, None
        allocate, schedule, copy_blocks = pool.allocate, engine.scheduler.schedule, runner.copy_blocks

        def tracking_allocate():  # the next block is the free queue's head once every block was used
            if len(pool.blocks) == pool.num_blocks and pool.free_queue and \
                    next(iter(pool.free_queue.values())).block_hash is not None:
                self.evicted.append(next(iter(pool.free_queue)))
            return allocate()

        def tracking_schedule(*args):
            self.plan = schedule(*args)
            return self.plan

        def copy_then_poison(pairs):  # the last thing before the forward pass
            copy_blocks(pairs)
            filled = {dst for _, dst in self.plan.blocks_to_swap_in + self.plan.blocks_to_copy}
            self.poison(set(self.evicted) - filled)
            self.num_evicted += len(self.evicted)
            self.evicted.clear()

        pool.allocate, engine.scheduler.schedule, runner.copy_blocks = tracking_allocate, tracking_schedule, \
            copy_then_poison

    def poison(self, block_ids):
        if block_ids:
            runner = self.engine.runner
            pages = every_layer(jnp.asarray(sorted(block_ids)), runner.num_layers, runner.num_gpu_blocks)
            runner.kv_cache = jax.tree.map(lambda x: jax.device_put(x.at[:, pages].set(jnp.nan), x.sharding),
                                           runner.kv_cache)

    def generate(self, prompts, params):
        engine = self.engine
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"p{i}", prompt, sp)
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out
            pool = engine.block_manager.gpu_pool
            self.poison([b for b in range(pool.num_blocks) if pool.ref_cnt(b) == 0 and not pool.is_cached(b)])
        return [outs[f"p{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def plain():
    return jpaged.LLM("tiny", num_gpu_blocks_override=96, **LIMITS)


@pytest.fixture(scope="module")
def cached():
    return jpaged.LLM("tiny", num_gpu_blocks_override=96, enable_prefix_caching=True, **LIMITS)


def assert_no_blocks_held(llm):
    stats = llm.stats()
    assert stats["num_gpu_blocks_in_use"] == stats["num_gpu_blocks_without_sharing"] == 0
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    assert stats["num_free_cpu_blocks"] == stats["num_cpu_blocks"]


def test_hits_are_the_shared_full_blocks_and_outputs_are_unchanged(plain, cached):
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, size=64).tolist()
    prompts = shared_prefix_prompts(rng, base)
    expected = plain.generate(prompts, greedy(12), use_tqdm=False)
    assert plain.stats()["prefix_cache_queries"] == 0  # off: nothing is looked up
    assert {o.num_cached_tokens for o in expected} == {0}

    cached.generate([base], greedy(4), use_tqdm=False)  # caches base's 4 full blocks
    outs = []
    for prompt in prompts:  # one at a time: each hits exactly the full blocks it shares with base
        before = cached.stats()
        outs.append(cached.generate([prompt], greedy(12), use_tqdm=False)[0])
        after = cached.stats()
        shared = next(i for i, (a, b) in enumerate(zip(prompt + [-1], base)) if a != b)
        expected_hits = min(shared // BS, (len(prompt) - 1) // BS) * BS  # never the last token's block
        assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == len(prompt)
        assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == expected_hits, len(prompt)
        assert outs[-1].num_cached_tokens == expected_hits, len(prompt)  # the request's own count (vLLM's)
    assert_same_greedy(expected, outs)
    assert [o.outputs[0].token_ids for o in outs[-2:]] == [o.outputs[0].token_ids for o in expected[-2:]]
    assert_no_blocks_held(cached)
    assert cached.stats()["num_cached_gpu_blocks"] > 0


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_batched_shared_prefixes_under_preemption_read_no_freed_or_evicted_page(plain, preemption_mode):
    rng = np.random.default_rng(1)
    prompts = shared_prefix_prompts(rng, rng.integers(0, 256, size=64).tolist())
    params = [greedy(int(m)) for m in rng.integers(8, 24, size=len(prompts))]
    expected = plain.generate(prompts, params, use_tqdm=False)
    # 12 blocks of 16 tokens: a few requests at a time, so they preempt each other and evict
    # prefixes; the same requests again look up prefixes cached, evicted and reused meanwhile.
    llm = jpaged.LLM("tiny", num_gpu_blocks_override=12, enable_prefix_caching=True, preemption_mode=preemption_mode,
                     swap_space=0.05, **LIMITS)
    poisoner = Poisoner(llm)
    assert_same_greedy(expected * 2, poisoner.generate(prompts * 2, params * 2))
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and poisoner.num_evicted > 0
    assert stats["prefix_cache_hits"] > 0
    assert_no_blocks_held(llm)


def test_mixed_beam_parallel_and_prefix_workload_leaves_no_block(plain):
    rng = np.random.default_rng(2)
    base = rng.integers(0, 256, size=40).tolist()
    prompts = [base[:int(n)] + rng.integers(0, 256, size=5).tolist() for n in rng.integers(16, 40, size=9)]
    params = []
    for i in range(len(prompts)):
        kind = i % 3
        if kind == 0:
            params.append(jpaged.SamplingParams(use_beam_search=True, n=2, best_of=3, temperature=0, max_tokens=16,
                                                ignore_eos=True))
        elif kind == 1:
            params.append(jpaged.SamplingParams(n=3, temperature=1.0, seed=i, max_tokens=20, ignore_eos=True))
        else:
            params.append(greedy(24))
    expected = plain.generate(prompts, params, use_tqdm=False)
    llm = jpaged.LLM("tiny", num_gpu_blocks_override=12, enable_prefix_caching=True, swap_space=0.05, **LIMITS)
    poisoner = Poisoner(llm)
    outs = poisoner.generate(prompts, params)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert_no_blocks_held(llm)
    for ref, out, sp in zip(expected, outs, params):
        assert len(out.outputs) == sp.n
        if sp.temperature == 0 and not sp.use_beam_search:
            assert_same_greedy([ref], [out])
        else:  # seeded samples and beams: the same tokens whatever else runs
            assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
