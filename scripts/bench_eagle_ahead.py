"""EAGLE or draft-model speculative steps from the host's side: device reads between a step's
schedule and its target step's launch, the wall time from schedule to launch, and the step clock's
phases (ms per step), over a greedy batch. With the drafts computed right after the step that
sampled (spec_decode/eagle_ahead.py, draft_ahead.py) a speculative step reads nothing before its
launch; before it, the head's chain or the draft model's k-step loop ran in the dispatch and its
drafts were read there (one blocking read per step).

  python scripts/bench_eagle_ahead.py [--method eagle3|draft_model] [--model tiny] [--eagle3 DIR]
      [--draft DIR] [--batch 8] [--max-tokens 64] [--k 3] [--temperature 0]

Without --eagle3 on the tiny model: a random head (tests/eagle3_head.py; drafts are rarely accepted,
the host's side is what is measured). On a GPU: --model DIR --eagle3 HEAD (scripts/train_eagle3.py).
--method draft_model: the draft checkpoint --draft (default: the tiny model cut to its first 2
layers, tests/test_spec_decode_draft.py's write_tiny; "tiny": the model itself, every draft accepted).
"""

import argparse
import hashlib
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jpaged  # noqa: E402
from jpaged.step_clock import table  # noqa: E402


def instrument(engine) -> list:
    """Per target step launched: (whether it verifies drafts, device reads since its schedule,
    seconds since its schedule began)."""
    runner, scheduler, steps, state = engine.runner, engine.scheduler, [], {"reads": 0, "t": None, "drafts": False}

    class Counted:
        def __init__(self, value):
            self.value = value

        def __array__(self, dtype=None, copy=None):
            state["reads"] += 1
            return np.asarray(self.value, dtype=dtype)

        def __getattr__(self, name):
            return getattr(self.value, name)

    dispatch_op, collect, schedule, execute, run_step = (runner.dispatch_op, runner.collect, scheduler.schedule,
                                                         runner.execute, runner._run_step)

    def dispatching(op, *args):
        out = dispatch_op(op, *args)
        return Counted(out) if isinstance(out, jax.Array) else out

    def collecting(handle):
        state["reads"] += 1
        return collect(handle)

    def scheduling(*args):
        state["reads"], state["t"] = 0, time.perf_counter()
        return schedule(*args)

    def executing(plan, *args):
        state["drafts"] = any(s.spec_token_ids for s in plan.scheduled_seq_groups)
        return execute(plan, *args)

    def launching(*args):
        if state["t"] is not None:
            steps.append((state["drafts"], state["reads"], time.perf_counter() - state["t"]))
            state["t"] = None
        return run_step(*args)

    runner.dispatch_op, runner.collect, scheduler.schedule, runner.execute, runner._run_step = \
        dispatching, collecting, scheduling, executing, launching
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", choices=("eagle3", "draft_model"), default="eagle3")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--draft", default=None, help="--method draft_model: the draft's checkpoint")
    parser.add_argument("--temperature", type=float, default=0.0, help="> 0: seeded sampling, one seed per request")
    parser.add_argument("--eagle3", default=None, help="an EAGLE-3 head's directory (default: a random tiny head)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.method == "draft_model":
        model = args.draft
        if model is None:
            from test_spec_decode_draft import write_tiny
            model = write_tiny(pathlib.Path(tempfile.mkdtemp()) / "tiny-2-layers", num_layers=2)
    else:
        model = args.eagle3
        if model is None:
            from eagle3_head import write_head
            from jpaged.models import tiny
            model = str(write_head(pathlib.Path(tempfile.mkdtemp()) / "head", tiny.tiny_config()))
    llm = jpaged.LLM(args.model, speculative_config={"method": args.method, "model": model,
                                                     "num_speculative_tokens": args.k},
                     max_model_len=512, max_num_seqs=max(args.batch, 8), max_num_batched_tokens=512,
                     background_warmup=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 200, 24).tolist() for _ in range(args.batch)]
    sp = [jpaged.SamplingParams(temperature=args.temperature, top_p=0.9 if args.temperature else 1.0, seed=i,
                                max_tokens=args.max_tokens, ignore_eos=True) for i in range(args.batch)]
    llm.generate(prompts, sp, use_tqdm=False)  # every shape met once
    steps = instrument(llm.llm_engine)
    before = llm.stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - start
    after = llm.stats()
    spec = [s for s in steps if s[0]]
    result = {
        "speculative_steps": len(spec), "steps": len(steps), "wall_s": round(wall, 3),
        "reads_before_launch_per_spec_step": statistics.mean(s[1] for s in spec) if spec else None,
        "schedule_to_launch_ms_per_spec_step": round(1000 * statistics.mean(s[2] for s in spec), 3) if spec else None,
        "phases_ms_per_step": {p: round(ms, 3) for p, ms, _ in table(before, after)},
        "draft_tokens": after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"],
        "accepted_tokens": after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"],
        # The outputs, in one number: equal across runs (before/after a change) when the tokens are.
        "tokens_hash": hashlib.sha256(json.dumps([o.outputs[0].token_ids for o in outputs]).encode()).hexdigest()[:16],
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
