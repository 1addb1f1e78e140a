"""A dropped engine frees its runner and every device array it owns (`del llm; gc.collect()`, as
vLLM users free one), so that a second engine in the process, or training in an RL loop, gets the
memory back. An engine freezes its start-up heap out of the cyclic collector
(engine/start_up.freeze_heap): a runner in a reference cycle was never collected, and with it the
KV pool (on a GPU most of the card: the next engine found no room for its pool)."""

import asyncio
import gc
import threading
import weakref

import jax

import jpaged

SHAPE = dict(max_model_len=128, max_num_seqs=4)


def live_arrays() -> list:
    return [a for a in jax.live_arrays() if not a.is_deleted()]


def assert_freed(runner: weakref.ref, before: list):
    """The runner is gone and no device array is alive that was not before the engine was built."""
    gc.collect()
    assert runner() is None, f"the dropped engine's runner is still alive ({len(gc.get_referrers(runner()))} " \
                             "referrers the collector sees)"
    left = [(a.shape, a.dtype.name) for a in live_arrays() if not any(a is b for b in before)]
    assert not left, f"device arrays left by the dropped engine: {left}"
    assert sum(a.nbytes for a in live_arrays()) == sum(a.nbytes for a in before)


def test_dropped_llm_frees_its_runner_and_kv_pool():
    before = live_arrays()
    llm = jpaged.LLM("tiny", enforce_eager=True, async_scheduling=True, **SHAPE)
    outs = llm.generate([[1, 2, 3], [4, 5]], jpaged.SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    runner = weakref.ref(llm.llm_engine.runner)
    pool = weakref.ref(llm.llm_engine.runner.kv_cache.k_pages)
    del llm, outs
    # Reference counting alone frees the runner: it is in no reference cycle (its pool goes at
    # `del`, with no collection; a cycle would keep it until one).
    assert runner() is None and pool() is None, "the runner is in a reference cycle again"
    assert_freed(runner, before)


def test_dropped_llm_with_prefix_caching_and_background_warm_up():
    before = live_arrays()
    llm = jpaged.LLM("tiny", enable_prefix_caching=True, **SHAPE)
    assert llm.wait_for_warmup(300)
    prompt = list(range(1, 40))
    for _ in range(2):  # the second reuses the first's cached blocks
        llm.generate([prompt], jpaged.SamplingParams(max_tokens=3), use_tqdm=False)
    assert llm.llm_engine.block_manager.enable_caching
    runner = weakref.ref(llm.llm_engine.runner)
    del llm
    assert runner() is None, "the runner (or its warm-up) is in a reference cycle again"
    assert_freed(runner, before)


def test_dropped_during_its_warm_up_stops_it_and_frees_the_runner():
    """Dropping an engine whose background warm-up still runs stops the warm-up (after the compile
    under way); the thread held the runner until then, and then lets it go."""
    before = live_arrays()
    llm = jpaged.LLM("tiny", **SHAPE)
    warmup = llm.llm_engine.runner.warmup  # (it holds its runner weakly)
    runner = weakref.ref(llm.llm_engine.runner)
    del llm
    assert warmup.wait(300), "the dropped engine's warm-up did not stop"
    if warmup._thread is not None:
        warmup._thread.join(60)
        assert not warmup._thread.is_alive()
    assert_freed(runner, before)


def test_dropped_eagle_engine_frees_both_runners(tmp_path):
    """An EAGLE head's runner reads the target's weights through the target's runner
    (EagleRunner.target): a reference cycle, which the collector frees once the engine is dropped
    (dropping it unfreezes the heap its start-up froze)."""
    from eagle3_head import write_eagle_head
    from jpaged.models import tiny

    head = write_eagle_head(tmp_path / "head", tiny.tiny_config(), seed=1)
    before = live_arrays()
    llm = jpaged.LLM("tiny", speculative_config={"method": "eagle", "model": str(head), "num_speculative_tokens": 2},
                     enforce_eager=True, max_num_batched_tokens=64, **SHAPE)
    llm.generate([[1, 2, 3, 1, 2, 3]], jpaged.SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    runners = [weakref.ref(llm.llm_engine.runner), weakref.ref(llm.llm_engine.proposer.runner)]
    del llm
    for runner in runners:
        assert_freed(runner, before)


def test_dropped_server_engine_frees_its_runner():
    """The server's path: AsyncLLMEngine serves a request, shuts down, and is dropped."""
    from serving.async_engine import AsyncLLMEngine
    from serving.metrics import Metrics

    before = live_arrays()
    engine = jpaged.LLM("tiny", enforce_eager=True, **SHAPE).llm_engine

    async def serve(engine):
        async_engine = AsyncLLMEngine(engine, Metrics("tiny"))
        async_engine.start()
        try:
            stream = await async_engine.add_request("a", [1, 2, 3], jpaged.SamplingParams(max_tokens=3))
            final = None
            async for out in stream:
                final = out
            assert len(final.outputs[0].token_ids) == 3
        finally:
            await async_engine.shutdown()

    asyncio.run(serve(engine))
    runner = weakref.ref(engine.runner)
    del engine
    assert not [t for t in threading.enumerate() if t.name in ("jpaged-engine", "jpaged-outputs")]
    assert_freed(runner, before)
