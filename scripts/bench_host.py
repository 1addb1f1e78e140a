"""Host time per decode step, split into scheduler / input preparation / output processing.

N requests (~30 prompt tokens, EOS ignored) are admitted and prefilled; then `--steps` engine steps
are timed, per decode step (with --num-scheduler-steps K, an engine step is K decode steps), split into
  scheduler  Scheduler.schedule
  input      ModelRunner.execute: the runner building the step's inputs from the plan (its
             InputBatch, the padded arrays, the sampler's metadata), including the device call's dispatch
  output     everything else in LLMEngine.step: appending the sampled ids, detokenizing, stop
             checks, RequestOutputs
With `--device stub` (the default) the device is replaced by a function that returns random token
ids at once, so the numbers are the host's alone (the goal: <= 2 ms per step at 256 sequences),
measured as the Python thread's CPU time so that a busy machine's neighbours count less.
With `--device real` the model runs (use a micro model: the host dominates) and "input" includes
waiting for the device; "total" is then the wall time per step.
With `--detokenize-off-thread` the engine runs as the server runs it: DELTA outputs, and the text of
requests that need none on the engine thread made by another thread (jpaged/core/pending_output.py);
"output_thread" is that thread's CPU time per step, not counted in "total".
With `--guided K` the first K requests of each run follow a grammar (--guided-regex): their matchers
advance and their masks are made on the engine thread; with async scheduling (on unless
`--async-scheduling false`) their steps overlap, the sampling dispatched after the read
(runner/deferred_sample.py); "overlapped_steps" counts the timed steps that left one in flight.

  JAX_PLATFORMS=cpu python scripts/bench_host.py                      # tiny, stubbed, 1/32/256 seqs
  JAX_PLATFORMS=cpu python scripts/bench_host.py --device real --model micro
  JAX_PLATFORMS=cpu python scripts/bench_host.py --num-seqs 128 --guided 1   # one grammar in 128
"""

import argparse
import json
import os
import queue
import sys
import threading
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jpaged  # noqa: E402
from jpaged.config import MAX_LOGPROBS  # noqa: E402
from jpaged.step_clock import table  # noqa: E402

PROMPT_LEN = 30
# The host's own CPU time (this thread's): on a shared machine wall time mostly measures the
# neighbours. --device real measures wall time (the device works in other threads).
CLOCK = time.thread_time


class Timer:
    """Wraps methods, summing the wall time spent inside them (outermost call only)."""

    def __init__(self):
        self.totals, self._depth = {}, 0

    def wrap(self, obj, name: str, phase: str):
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t = CLOCK()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                self.totals[phase] = self.totals.get(phase, 0.0) + CLOCK() - t

        setattr(obj, name, timed)


class SimulatedDevice:
    """--device-ms: a device stream that runs each call after the one before, taking its time;
    a call's result is ready when the stream gets there (reading it sleeps until then)."""

    def __init__(self, forward_ms: float, sample_ms: float):
        self.forward_s, self.sample_s, self.busy_until = forward_ms / 1e3, sample_ms / 1e3, 0.0

    def run(self, seconds: float) -> float:
        self.busy_until = max(time.perf_counter(), self.busy_until) + seconds
        return self.busy_until

    class Result:
        def __init__(self, array: np.ndarray, ready: float):
            self.array, self.ready = array, ready

        def addressable_data(self, _):
            time.sleep(max(self.ready - time.perf_counter(), 0.0))
            return self.array


def stub_device(runner, vocab_size: int, eos: int | None = None, simulated: SimulatedDevice | None = None):
    """Replace the device step by random token ids of the right shape, returned at once (or, with
    `simulated`, once its simulated stream has run it); a grammar row's token drawn from those its
    mask allows (EOS only if nothing else is). A grammar step behind a step in flight is two
    device calls (runner/deferred_sample.py): both stubbed."""
    rng = np.random.default_rng(0)
    kept = {}

    def run_step(key, inputs, smeta):
        num_tokens, full = key[:2]
        rows, k = runner.buckets.sample_rows(runner.buckets.seqs(num_tokens)), MAX_LOGPROBS if full else 0
        packed = np.zeros(rows * (3 + 2 * k), np.int32)
        packed[:rows] = rng.integers(0, vocab_size, rows)
        if full:
            masked_tokens(packed, np.asarray(smeta), runner.buckets.sample_rows(num_tokens), key[4])
        if simulated is not None:
            return simulated.Result(packed, simulated.run((0 if inputs is None else simulated.forward_s)
                                                          + simulated.sample_s))
        return jax.device_put(packed)  # a device array, as the real step returns

    def masked_tokens(packed, smeta, rows, greedy):
        meta = runner.sampling_metadata(None, rows, True, greedy)
        leaves = jax.tree.leaves(meta)
        offset = sum(leaf.size for leaf in leaves[:next(i for i, x in enumerate(leaves) if x is meta.allowed_bitmask)])
        masks = smeta[offset:offset + meta.allowed_bitmask.size].reshape(meta.allowed_bitmask.shape)
        for r in np.flatnonzero((masks != -1).any(1)):
            allowed = np.flatnonzero(np.unpackbits(masks[r].view(np.uint8), bitorder="little")[:vocab_size])
            if len(allowed) > 1:
                allowed = allowed[allowed != eos]
            packed[r] = rng.choice(allowed)

    def run_forward(key, ident, inputs):
        kept[ident] = key
        if simulated is not None:
            simulated.run(simulated.forward_s)

    def run_sample(ident, smeta):
        return run_step(kept.pop(ident), None, smeta)

    def run_multi_step(num_tokens, inputs):
        rows, num_steps = runner.buckets.sample_rows(num_tokens), runner.buckets.num_scheduler_steps
        packed = np.zeros((num_steps, rows * 3), np.int32)
        packed[:, :rows] = rng.integers(0, vocab_size, (num_steps, rows))
        return jax.device_put(packed.reshape(-1))

    runner._run_step = run_step
    runner._run_forward, runner._run_sample = run_forward, run_sample
    runner._run_multi_step = run_multi_step


def micro_model(work_dir: str) -> str:
    """hidden 128, 2 layers, vocabulary 384: a Llama small enough that the host dominates."""
    from bench_models import build_random_llama

    path = os.path.join(work_dir, "micro")
    if not os.path.exists(os.path.join(path, "config.json")):
        build_random_llama("micro", path, seed=0)
    return path


class OutputThread:
    """The server's output thread (serving/async_engine.py): completes PendingOutputs off the
    engine thread, timing its own CPU time."""

    def __init__(self, engine):
        from jpaged.core.pending_output import PendingOutput, complete

        self.handed, self.seconds = queue.SimpleQueue(), 0.0

        def run():
            while (outputs := self.handed.get()) is not None:
                if isinstance(outputs, threading.Event):  # drain(): all before it is done
                    outputs.set()
                    continue
                start = time.thread_time()
                for out in outputs:
                    if type(out) is PendingOutput:
                        complete(out, engine.detokenizer)
                self.seconds += time.thread_time() - start

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def drain(self):
        done = threading.Event()
        self.handed.put(done)
        done.wait()


def measure(llm, num_seqs: int, steps: int, vocab_size: int, output_kind: str, output_thread=None,
            guided: int = 0, guided_regex: str = "") -> dict:
    engine = llm.llm_engine
    rng = np.random.default_rng(num_seqs)
    num_steps = engine.config.num_scheduler_steps
    params = jpaged.SamplingParams(temperature=0, max_tokens=steps * num_steps + 8, ignore_eos=True,
                                   output_kind=jpaged.RequestOutputKind[output_kind])
    with_grammar = jpaged.SamplingParams(temperature=0, max_tokens=steps * num_steps + 8, ignore_eos=True,
                                         output_kind=jpaged.RequestOutputKind[output_kind], guided_regex=guided_regex)
    for i in range(num_seqs):
        engine.add_request(f"r{num_seqs}-{i}", rng.integers(0, vocab_size, PROMPT_LEN).tolist(),
                           with_grammar if i < guided else params)
    while any(g.is_prefill() for g in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    timer = Timer()
    timer.wrap(engine.scheduler, "schedule", "scheduler")
    timer.wrap(engine.runner, "execute", "input")
    seqs = [seq for group in engine.scheduler.running for seq in group.seqs]
    generated = -sum(seq.get_output_len() for seq in seqs)
    before = engine.stats()
    hand = output_thread.handed.put if output_thread is not None else (lambda outputs: None)
    off_thread = output_thread.seconds if output_thread is not None else 0.0
    overlapped = 0
    t = CLOCK()
    for _ in range(steps):
        hand(engine.step())
        overlapped += engine._in_flight is not None
    total = CLOCK() - t
    if output_thread is not None:
        output_thread.drain()
        off_thread = output_thread.seconds - off_thread
    phases = {p: round(ms, 3) for p, ms, _ in table(before, engine.stats())}  # the engine's clock (wall time)
    # Per decode step (a multi-step decode's call counts as its K steps).
    decode_steps = (generated + sum(seq.get_output_len() for seq in seqs)) / num_seqs
    engine.scheduler.__dict__.pop("schedule", None)  # unwrap
    engine.runner.__dict__.pop("execute", None)
    while engine.has_unfinished_requests():
        hand(engine.step())
    ms = {phase: 1e3 * v / decode_steps for phase, v in timer.totals.items()}
    ms["output"] = 1e3 * total / decode_steps - sum(ms.values())
    ms["total"] = 1e3 * total / decode_steps
    if output_thread is not None:
        ms["output_thread"] = 1e3 * off_thread / decode_steps
    return {"num_seqs": num_seqs, "guided": min(guided, num_seqs), **{k: round(v, 3) for k, v in ms.items()},
            "overlapped_steps": overlapped, "phases_ms_per_step": phases}


def measure_churn(llm, num_seqs: int, requests: int, steps: int, vocab_size: int, output_kind: str,
                  output_thread=None, prompt_len: int = PROMPT_LEN) -> dict:
    """--churn: `requests` requests through `num_seqs` seats, their output lengths drawn from 8 to
    `steps` (seeded), so that seats free and waiting requests are admitted all along (online
    serving's steady state): the wall time of the whole run, its steps, and how many of them left
    a step in flight (overlapped). `prompt_len` above max_num_batched_tokens: prompts in chunks."""
    engine = llm.llm_engine
    rng = np.random.default_rng(requests)
    for i in range(requests):
        engine.add_request(f"c{num_seqs}-{i}", rng.integers(0, vocab_size, prompt_len).tolist(),
                           jpaged.SamplingParams(temperature=0, max_tokens=int(rng.integers(8, steps + 1)),
                                                 ignore_eos=True, output_kind=jpaged.RequestOutputKind[output_kind]))
    hand = output_thread.handed.put if output_thread is not None else (lambda outputs: None)
    num_steps = overlapped = 0
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        hand(engine.step())
        num_steps += 1
        overlapped += engine._in_flight is not None
    wall = time.perf_counter() - t
    if output_thread is not None:
        output_thread.drain()
    return {"num_seqs": num_seqs, "churn_requests": requests, "steps": num_steps, "overlapped_steps": overlapped,
            "wall_s": round(wall, 3), "ms_per_step": round(1e3 * wall / num_steps, 3)}


def main():
    global CLOCK
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help='"tiny", "micro" or a local HF checkpoint dir')
    p.add_argument("--device", choices=("stub", "real"), default="stub")
    p.add_argument("--device-ms", help="FORWARD,SAMPLER: the stub simulates a device stream taking this long per "
                   "call (results ready when it gets there); figures are then wall time per step")
    p.add_argument("--num-seqs", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--output-kind", choices=[k.name for k in jpaged.RequestOutputKind], default="CUMULATIVE",
                   help="what each step's RequestOutputs carry (the server asks for DELTA)")
    p.add_argument("--max-model-len", type=int, help="the engine's (default: what the run needs); a model's own "
                   "limit (131072 for Llama 3) makes block tables 8192 entries wide")
    p.add_argument("--detokenize-off-thread", action="store_true",
                   help="as the server: DELTA outputs, text made on another thread where nothing needs it here")
    p.add_argument("--guided", type=int, default=0, help="this many of each run's requests follow --guided-regex "
                   "(structured output; the stub draws their tokens from their masks)")
    p.add_argument("--guided-regex", default="[a-z ]*")
    p.add_argument("--churn", type=int, default=0, help="instead: this many requests through max(--num-seqs) seats, "
                   "output lengths 8 to --steps, admitted as seats free; wall time of the whole run")
    p.add_argument("--prompt-len", type=int, default=PROMPT_LEN, help="--churn's prompt length")
    p.add_argument("--work-dir", default="/tmp/jpaged_bench_host")
    p.add_argument("--output-json")
    args, engine_args = p.parse_known_args()
    kwargs = {}
    for flag, value in zip(engine_args[::2], engine_args[1::2]):  # e.g. --num-scheduler-steps 4
        kwargs[flag.lstrip("-").replace("-", "_")] = int(value) if value.isdigit() else \
            {"true": True, "false": False}.get(value.lower(), value)
    model = micro_model(args.work_dir) if args.model == "micro" else args.model
    max_num_seqs = max(args.num_seqs)
    needed = max(PROMPT_LEN, args.prompt_len) + args.steps * kwargs.get("num_scheduler_steps", 1) + 16
    max_model_len = args.max_model_len or needed
    # Every sequence's blocks fit: the figures are decode steps of max(--num-seqs) running sequences,
    # not preemptions (a CPU's default pool, 32k tokens, holds 256 x 446 tokens of a K=8 run only in part).
    kwargs.setdefault("num_gpu_blocks_override", max_num_seqs * -(-needed // kwargs.get("block_size", 16)) + 64)
    llm = jpaged.LLM(model=model, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                     enforce_eager=args.device == "stub", **kwargs)
    llm.wait_for_warmup()  # timed steps never wait on a background compile
    vocab_size = llm.llm_engine.hf_config.vocab_size
    if args.device == "stub":
        simulated = SimulatedDevice(*map(float, args.device_ms.split(","))) if args.device_ms else None
        stub_device(llm.llm_engine.runner, vocab_size, llm.llm_engine.eos_token_id, simulated)
        if simulated is not None:
            CLOCK = time.perf_counter
    else:
        CLOCK = time.perf_counter
    results, output_thread = [], None
    if args.detokenize_off_thread:
        llm.llm_engine.detokenize_later, args.output_kind = True, "DELTA"
        output_thread = OutputThread(llm.llm_engine)
    if args.churn:
        n = max(args.num_seqs)
        churn = (args.steps, vocab_size, args.output_kind, output_thread, args.prompt_len)
        measure_churn(llm, n, n, *churn)  # warm the Python paths
        results.append(measure_churn(llm, n, args.churn, *churn))
        print(json.dumps(results[-1]), flush=True)
    for n in [] if args.churn else args.num_seqs:
        guided = (args.guided, args.guided_regex)
        measure(llm, n, 5, vocab_size, args.output_kind, output_thread, *guided)  # warm the Python paths
        results.append(measure(llm, n, args.steps, vocab_size, args.output_kind, output_thread, *guided))
        print(json.dumps(results[-1]), flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model": args.model, "device": args.device, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
