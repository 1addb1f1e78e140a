"""Python pieces of scripts/gpu_check.sh (each runs on a CPU too, with small sizes).

  python scripts/gpu_check.py devices --device cuda [--attention-backend B] [--kv-cache-dtype fp8]
                                                        # what jax sees, then a tiny engine on it
  python scripts/gpu_check.py compare JPAGED.json HF.json [HF2.json ...]   # throughput ratios

`devices` exits non-zero unless the engine starts on the requested device (device="cuda" is the
engine's own loud check: no silent fallback to the CPU) and generates; it prints jax's devices,
their compute capability and memory, and the engine's start-up line (backend, device, kernels,
KV pool). `compare` reads bench_throughput.py --output-json files run in separate processes
(HF in its own, so neither starves the other's memory) and prints one markdown row per HF run.
"""

import argparse
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def devices(args) -> int:
    import jax

    import jpaged

    print(f"jax {jax.__version__}; default backend {jax.default_backend()}")
    for d in jax.devices():
        stats = d.memory_stats() or {}
        limit = stats.get("bytes_limit")
        print(f"  {d}: {d.device_kind}, compute capability {getattr(d, 'compute_capability', '-')}"
              + (f", {limit / 2**30:.1f} GiB for jax" if limit else ""))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    llm = jpaged.LLM("tiny", device=args.device, dtype="bfloat16", max_model_len=256, max_num_seqs=4,
                     num_gpu_blocks_override=64, attention_backend=args.attention_backend, enforce_eager=True,
                     kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.kv_cache_dtype != "auto")
    out = llm.generate([[1, 2, 3, 4]], jpaged.SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    print(f"generated {len(out[0].outputs[0].token_ids)} tokens on {args.device or jax.default_backend()} with "
          f"attention_backend={args.attention_backend!r}, kv_cache_dtype={args.kv_cache_dtype!r}")
    return 0


def compare(args) -> int:
    def load(path):
        with open(path) as f:
            report = json.load(f)
        [result] = report["results"]
        return report, result

    report, mine = load(args.jpaged)
    if mine["backend"] != "jpaged":
        raise SystemExit(f"{args.jpaged} holds a {mine['backend']} run, not jpaged")
    w = report["workload"]
    print(f"model {report['model']}, {w['num_requests']} requests, mean prompt {w['mean_prompt_len']:.0f} / "
          f"output {w['mean_output_len']:.0f} tokens; jpaged {mine['output_tokens_per_s']:.0f} output tokens/s")
    print("| baseline | its output tok/s | jpaged output tok/s | jpaged / baseline |")
    print("|---|---|---|---|")
    for path in args.hf:
        hf_report, theirs = load(path)
        if hf_report["workload"] != w:
            raise SystemExit(f"{path} ran another workload: {hf_report['workload']} vs {w}")
        name = f"hf {hf_report['args'].get('hf_api')} ({hf_report['args'].get('hf_attn')})"
        ratio = mine["output_tokens_per_s"] / theirs["output_tokens_per_s"]
        print(f"| {name} | {theirs['output_tokens_per_s']:.0f} | {mine['output_tokens_per_s']:.0f} | {ratio:.2f}x |")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("devices")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p = sub.add_parser("compare")
    p.add_argument("jpaged")
    p.add_argument("hf", nargs="+")
    args = parser.parse_args(argv)
    return {"devices": devices, "compare": compare}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
