"""Hostile and unlucky requests, offline and through the AsyncLLMEngine: values the device code
cannot represent are ValueErrors naming the field, a request that makes a step fail is failed alone,
a request that can never fit the KV pool is refused up front and one that can fit is never cut
short, and a client leaving while its request is queued cannot kill the engine thread."""

import asyncio
import threading

import numpy as np
import pytest

import jpaged
from jpaged.engine.llm_engine import StepFailedError
from serving.async_engine import AsyncLLMEngine, EngineDeadError
from serving.metrics import Metrics
from test_engine import assert_all_blocks_free as assert_idle

LIMITS = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128, block_size=16, enforce_eager=True)
VOCAB = 259  # tiny's


@pytest.fixture(scope="module")
def llm():
    # 40 blocks of 16 tokens: a few hundred tokens per request fit, 8 long ones at once do not.
    return jpaged.LLM("tiny", num_gpu_blocks_override=40, swap_space=0.05, **LIMITS)


def greedy(max_tokens, **kw):
    return jpaged.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


KILLER_PARAMS = [  # (field named in the error, SamplingParams kwargs): each once killed the engine or slipped by
    ("top_k", dict(temperature=1.0, top_k=2**31)),
    ("stop_token_ids", dict(stop_token_ids=[2**31], min_tokens=1)),
    ("length_penalty", dict(use_beam_search=True, n=2, temperature=0, length_penalty=1000)),
    ("length_penalty", dict(use_beam_search=True, n=2, temperature=0, length_penalty=-1000)),
    ("length_penalty", dict(use_beam_search=True, n=2, temperature=0, length_penalty=400, early_stopping="never")),
    ("temperature", dict(temperature=float("inf"))),
    ("temperature", dict(temperature=float("nan"))),
    ("top_p", dict(temperature=1.0, top_p=float("nan"))),
    ("repetition_penalty", dict(repetition_penalty=1e-300, logprobs=2)),
    ("repetition_penalty", dict(repetition_penalty=float("inf"))),
    ("presence_penalty", dict(presence_penalty=float("nan"))),
    ("ignore_eos", dict(ignore_eos="yes")),
    ("stop", dict(stop=123)),
    ("stop", dict(stop=["x"] * 100_000)),
    ("stop", dict(stop="y" * 5000)),
    ("stop_token_ids", dict(stop_token_ids=5)),
    ("max_tokens", dict(max_tokens=2**40)),
    ("n", dict(n=2**40, temperature=1.0)),
    ("min_tokens", dict(min_tokens=-1)),
]


@pytest.mark.parametrize("field,kwargs", KILLER_PARAMS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(KILLER_PARAMS)])
def test_killer_values_are_value_errors_naming_the_field(field, kwargs):
    with pytest.raises(ValueError, match=rf"^{field}="):
        jpaged.SamplingParams(**kwargs)


ENGINE_LIMITS = [  # valid SamplingParams the engine cannot run: (field, kwargs, prompt)
    ("top_k", dict(temperature=1.0, top_k=VOCAB + 1), [1, 2]),
    ("stop_token_ids", dict(stop_token_ids=[VOCAB], min_tokens=1), [1, 2]),
    ("n", dict(n=9, temperature=1.0), [1, 2]),
    ("best_of", dict(n=1, best_of=9, temperature=1.0), [1, 2]),
    ("max_tokens", dict(n=8, temperature=1.0, max_tokens=100), [1, 2]),  # 8 x 7 blocks > 40
]


def test_engine_limits_are_checked_before_anything_is_queued(llm):
    for field, kwargs, prompt in ENGINE_LIMITS:
        with pytest.raises(ValueError, match=rf"^{field}="):
            llm.generate([prompt], jpaged.SamplingParams(**kwargs), use_tqdm=False)
        assert_idle(llm)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate("", use_tqdm=False)  # as the server: no request runs on BOS alone
    with pytest.raises(ValueError, match="prompt must be a str or a list of token ids"):
        llm.generate([[1, 2.5]], use_tqdm=False)
    # The message names the numbers: 8 sequences share the prompt's 2 full blocks, then need 7 more
    # each for 140 tokens: 58 blocks.
    with pytest.raises(ValueError, match=r"need up to 58 KV blocks, but the pool holds 40"):
        llm.generate([[3] * 40], jpaged.SamplingParams(n=8, temperature=1.0, max_tokens=100), use_tqdm=False)
    assert_idle(llm)
    # One sequence of 496 + 16 tokens fits (32 blocks): it runs, whole.
    out = llm.generate([[7] * 496], greedy(16), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 16 and out.finish_reason == "length"
    assert_idle(llm)


def test_extreme_but_valid_values_run(llm):
    prompt = [5, 6, 7, 8]
    outs = llm.generate([prompt] * 5, [
        jpaged.SamplingParams(temperature=1.0, top_k=VOCAB, seed=2**70, max_tokens=4),
        jpaged.SamplingParams(use_beam_search=True, n=2, temperature=0, length_penalty=10, max_tokens=4),
        jpaged.SamplingParams(use_beam_search=True, n=2, temperature=0, length_penalty=-10, early_stopping="never",
                              max_tokens=4),
        jpaged.SamplingParams(repetition_penalty=1e-6, logprobs=3, temperature=0, max_tokens=4),
        jpaged.SamplingParams(stop_token_ids=[VOCAB - 1], min_tokens=2, max_tokens=4, temperature=1e30),
    ], use_tqdm=False)
    assert all(o.finished for o in outs)
    for o in outs:
        for c in o.outputs:
            assert 1 <= len(c.token_ids) <= 4
            for lp in c.logprobs or []:
                assert all(not np.isnan(v) for v in lp.values())
    assert_idle(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_groups_that_fit_are_never_cut_short(mode):
    """n=2 with a 300-token prompt and 172 new tokens (8 of 960 such requests came back short under
    load): groups that fit the pool, preempted again and again, all end with every token."""
    llm = jpaged.LLM("tiny", num_gpu_blocks_override=60, preemption_mode=mode, swap_space=0.05, **LIMITS)
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 256, size=300).tolist() for _ in range(4)] + \
              [rng.integers(0, 256, size=int(rng.integers(20, 200))).tolist() for _ in range(6)]
    params = [jpaged.SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=172, ignore_eos=True) for i in range(4)]
    params += [jpaged.SamplingParams(n=int(rng.integers(1, 4)), temperature=1.0, max_tokens=int(rng.integers(20, 120)),
                                     ignore_eos=True) for _ in range(6)]
    params.append(jpaged.SamplingParams(use_beam_search=True, n=3, temperature=0, max_tokens=100, ignore_eos=True))
    prompts.append(rng.integers(0, 256, size=150).tolist())
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    for out, sp in zip(outs, params):
        assert len(out.outputs) == sp.n
        for c in out.outputs:
            assert len(c.token_ids) == sp.max_tokens and c.finish_reason == "length", (sp, len(c.token_ids))
    assert_idle(llm)


def poison(monkeypatch, engine):
    """Make every device step that computes a prompt starting with token 250 raise."""
    dispatch = engine.runner.dispatch

    def poisoned(batch, *args):
        if any(start == 0 and ids[:1] == [250] for start, ids in zip(batch.start_pos, batch.token_ids)):
            raise ZeroDivisionError("poisoned")
        return dispatch(batch, *args)

    monkeypatch.setattr(engine.runner, "dispatch", poisoned)


def test_a_failed_step_fails_its_request_alone(llm, monkeypatch):
    """A request whose step raises is found (its batch is re-run group by group) and aborted, its
    blocks freed; offline, generate() raises naming it and leaves nothing of the call queued; the
    engine then serves the next call normally."""
    reference = llm.generate([[9, 8, 7]], greedy(6), use_tqdm=False)[0].outputs[0].token_ids
    poison(monkeypatch, llm.llm_engine)
    with pytest.raises(StepFailedError, match="poisoned") as failure:
        llm.generate([[1, 2, 3], [250, 5, 6], [4, 5, 6]], greedy(10), use_tqdm=False)
    assert len(failure.value.request_ids) == 1  # the poisoned one only
    assert_idle(llm)
    assert llm.generate([[9, 8, 7]], greedy(6), use_tqdm=False)[0].outputs[0].token_ids == reference
    assert_idle(llm)


# ---------------------------------------------------------------------- the engine thread
async def _collect(stream):
    out = None
    async for out in stream:
        pass
    return out


def test_disconnect_while_queued_cannot_kill_the_engine_thread(llm, monkeypatch):
    """The race that killed the server: the handler is cancelled while its add waits for the engine
    thread, which then answers the cancelled future. Made deterministic by holding the engine
    thread inside add_request until the handler is gone."""
    engine = llm.llm_engine
    add_request = engine.add_request
    entered, release = threading.Event(), threading.Event()
    held = {"first": True}

    def slow_add(*args, **kwargs):
        if held.pop("first", False):
            entered.set()
            release.wait(10)
        return add_request(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", slow_add)

    async def scenario():
        async_engine = AsyncLLMEngine(engine, Metrics("tiny"))
        async_engine.start()
        try:
            # A: its add is taken by the engine thread, which stalls inside it; B waits behind it.
            a = asyncio.create_task(async_engine.add_request("a", [1, 2, 3], greedy(30)))
            b = asyncio.create_task(async_engine.add_request("b", [4, 5, 6], greedy(30)))
            await asyncio.to_thread(entered.wait, 10)
            a.cancel()
            b.cancel()  # B's future is cancelled before the engine thread reaches it
            await asyncio.gather(a, b, return_exceptions=True)
            release.set()
            stream = await asyncio.wait_for(async_engine.add_request("c", [7, 8, 9], greedy(5)), 60)
            final = await asyncio.wait_for(_collect(stream), 60)
            assert async_engine.dead is None and async_engine._thread.is_alive()
            assert len(final.outputs[0].token_ids) == 5
        finally:
            await async_engine.shutdown()

    asyncio.run(scenario())
    assert_idle(llm)


def test_engine_thread_fails_the_bad_request_alone_then_dies_cleanly_when_it_must(llm, monkeypatch):
    engine = llm.llm_engine
    poison(monkeypatch, engine)

    async def scenario():
        async_engine = AsyncLLMEngine(engine, Metrics("tiny"))
        died = asyncio.Event()
        async_engine.on_dead = died.set
        async_engine.start()
        try:
            good = await async_engine.add_request("good", [1, 2, 3], greedy(40))
            await good.__anext__()  # running before the poisoned one arrives
            bad = await async_engine.add_request("bad", [250, 2, 3], greedy(10))
            with pytest.raises(StepFailedError, match="poisoned"):
                await _collect(bad)
            final = await asyncio.wait_for(_collect(good), 60)
            assert len(final.outputs[0].token_ids) == 40
            assert async_engine.dead is None
            # A failure the engine cannot recover from (the KV pages lost) kills it, visibly.
            monkeypatch.setattr(engine.runner, "is_alive", lambda: False)
            doomed = await async_engine.add_request("doomed", [250, 1], greedy(3))
            with pytest.raises(EngineDeadError):
                await _collect(doomed)
            await asyncio.wait_for(died.wait(), 10)
            with pytest.raises(EngineDeadError):
                await async_engine.add_request("late", [1, 2], greedy(3))
        finally:
            await async_engine.shutdown()

    asyncio.run(scenario())


def test_server_exits_nonzero_when_the_engine_dies(llm, monkeypatch, capsys):
    """A device failure the engine cannot recover from: the request gets a 500 in OpenAI's shape,
    /health a 503, and serve() returns 1 (the process exits non-zero for a supervisor to restart)."""
    import aiohttp

    from serving.api_server import serve
    from serving.server_options import ServerOptions

    def lost(*args):
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm.llm_engine.runner, "dispatch", lost)
    monkeypatch.setattr(llm.llm_engine.runner, "is_alive", lambda: False)

    async def scenario():
        server = asyncio.create_task(serve(llm.llm_engine, ServerOptions(port=0, log_stats=False)))
        printed = ""
        while " at http" not in printed:
            await asyncio.sleep(0.05)
            printed += capsys.readouterr().out
        url = printed.split(" at ")[1].split("/v1")[0]
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}) as r:
                status, body = r.status, await r.json()
            assert status == 500 and "device lost" in body["error"]["message"], body
            try:
                async with session.get(url + "/health") as r:
                    assert r.status == 503
            except aiohttp.ClientConnectionError:
                pass  # already closed: also not healthy
        return await asyncio.wait_for(server, 30)

    assert asyncio.run(scenario()) == 1
