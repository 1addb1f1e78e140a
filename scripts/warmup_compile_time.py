"""The warm-up's compile time for a GPU, measured on a machine without one: every executable the
warm-up compiles (runner/warmup.py's need_order, at the engine's defaults for the workload)
traced, lowered and compiled deviceless for an H100 or H200 (scripts/gpu_targets), each one timed.
The sum is the CPU part of the warm-up on that GPU; autotuning on the device comes on top.

    JAX_PLATFORMS=cpu python scripts/warmup_compile_time.py --target h200 --model llama-3.2-1b \
        [--max-num-seqs 128] [--max-model-len 640] [--layers unroll|scan] [--only forward] \
        [--threads N] [--warmup]

Needs jax with the CUDA plugin (scripts/gpu_targets/README.md). The defaults are gpu_check.sh's
tp_jpaged workload (256 requests of 512 + 128 tokens, max_num_seqs 128: max_model_len 640).
`--layers`: the decoder's LayerStack scanned or unrolled (the loader unrolls on a GPU; with
JPAGED_SCAN_LAYERS=1 it keeps the scan). Per forward, the optimized HLO's weight copies (fusions
that dynamic-slice a layer's weights out of the stack) and XLA's in-place dynamic-slice fusions
are counted (weight_copies).
`--threads N`: the compiles run N side by side (after all are lowered) and the wall time is given.
`--warmup`: the real WarmUp (runner/warmup.py) runs the keys, JPAGED_WARMUP_COMPILE_THREADS as set.
"""

import argparse
import concurrent.futures
import os
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_gpu_deviceless_cub_mode" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deviceless_cub_mode=DEVICELESS_CUB_DISABLED").strip()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from gpu_memory_plan import abstract_model, target_mesh  # noqa: E402
from jpaged.engine.llm_engine import DEFAULT_MAX_NUM_BATCHED_TOKENS  # noqa: E402
from jpaged.models.kv_cache import KVCacheSpec  # noqa: E402
from jpaged.models.stacked import LayerStack  # noqa: E402
from jpaged.runner.executable_cache import ExecutableCache  # noqa: E402
from jpaged.runner.model_runner import ModelRunner  # noqa: E402
from jpaged.runner.warmup import need_order  # noqa: E402

COMPUTATION = re.compile(r"^%?([\w.-]+) \((.*?)\) -> (.*) \{$")
CALL = re.compile(r"= .*?\b(?:fusion|fusion-start)\(.*?kind=(\w+), calls=%?([\w.-]+)")
BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "pred": 1}


def _bytes(shape: str) -> int:
    total = 0
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * BYTES.get(dtype, 0)
    return total


def weight_copies(hlo: str, num_layers: int) -> dict:
    """In an optimized HLO module: `weight_copies`, the fusions (plain or async: fusion-start; not
    GEMMs) that read an array stacked over the layers (a leading dimension of `num_layers`) through
    a slice (dynamic when scanned): a layer's weights copied out of the stack (a slice, or a concatenation for
    merged GEMMs), counted per appearance in the text (in a scanned forward's loop body: per layer;
    a step runs it num_layers times), and `copied_mib`, their outputs' size; `in_place_slices`: XLA's
    dynamic-slice fusions (a cuBLAS GEMM reading the slice where it lies); `while_loops` left."""
    bodies, outputs, current = {}, {}, None
    for line in hlo.splitlines():
        header = COMPUTATION.match(line.strip()) if not line.startswith(" ") else None
        if header:
            current = header.group(1)
            bodies[current], outputs[current] = [header.group(2)], header.group(3)
        elif current is not None:
            bodies[current].append(line)
    stacked = re.compile(rf"\w+\[{num_layers},[\d,]*\]")
    copies, copied, in_place = 0, 0, 0
    for kind, called in CALL.findall(hlo):
        text = "\n".join(bodies.get(called, ()))
        if kind == "kCustom":
            in_place += "dynamic-slice-fusion" in called or "address_computation" in called
        elif ("dynamic-slice(" in text or " slice(" in text) and stacked.search(bodies.get(called, [""])[0]):
            copies += 1
            copied += _bytes(outputs.get(called, ""))
    return {"weight_copies": copies, "copied_mib": round(copied / 2**20, 1), "in_place_slices": in_place,
            "while_loops": len(re.findall(r"\bwhile\(", hlo))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=("h100", "h200"), default="h200")
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=640)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--layers", choices=("unroll", "scan"), default="unroll")
    parser.add_argument("--only", default="", help="keys whose repr contains this (';'-separated)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", action="store_true", help="run runner/warmup.py's WarmUp over the keys")
    parser.add_argument("--hlo-dir", help="write each forward's optimized HLO here")
    args = parser.parse_args()

    mesh, _ = target_mesh(args.target)
    loaded = abstract_model(args.model, mesh)  # unrolled, as the loader builds it on a GPU
    for _, node in nnx.iter_graph(loaded.model):
        if isinstance(node, LayerStack):
            node.unroll = args.layers == "unroll"
    spec = KVCacheSpec.of_model(loaded.model, 16, jnp.bfloat16)
    runner = ModelRunner(loaded, spec, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                         max_num_batched_tokens=args.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS,
                                                                                   args.max_num_seqs),
                         num_gpu_blocks=args.num_blocks, num_cpu_blocks=0,
                         executable_cache=ExecutableCache(None, ""), abstract=True)
    base = [k for k in runner.buckets.keys() if k[0] not in ("forward", "multi_step", "sample")]
    keys = need_order(runner.buckets, runner.forward_keys, base)
    if args.only:
        keys = [k for k in keys if any(s in repr(k) for s in args.only.split(";"))]
    print(f"jax {jax.__version__}, {mesh.devices.flat[0].device_kind}, {args.model} bf16, layers {args.layers}, "
          f"max_num_seqs {args.max_num_seqs}, max_model_len {args.max_model_len}, tokens {runner.buckets.tokens}, "
          f"rows {runner.buckets.rows}; {len(keys)} executables; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)

    start = time.perf_counter()
    if args.warmup:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            plan = runner._warm_up_plan(None, keys)
            plan.run()
        print(f"WarmUp ({os.environ.get('JPAGED_WARMUP_COMPILE_THREADS', 'default')} threads): {len(keys)} in "
              f"{time.perf_counter() - start:.1f} s wall, load {os.getloadavg()[0]:.2f}", flush=True)
        return 0

    lowered = []
    for key in keys:
        t0 = time.perf_counter()
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # Pallas lowers for the abstract GPU
            jitted, jit_args = runner._jitted_and_args(key)
            lowered.append((key, jitted.trace(*jit_args).lower(), time.perf_counter() - t0))

    def compile_one(item):
        key, low, _ = item
        t0 = time.perf_counter()
        compiled = low.compile()
        seconds = time.perf_counter() - t0
        counts = weight_copies(compiled.as_text(), spec.num_layers) if key[0] in ("forward", "multi_step") else {}
        if args.hlo_dir and counts:
            os.makedirs(args.hlo_dir, exist_ok=True)
            with open(os.path.join(args.hlo_dir, "_".join(map(str, key)) + f"_{args.layers}.hlo"), "w") as f:
                f.write(compiled.as_text())
        temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
        return key, seconds, counts, temp

    compile_start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.threads) as pool:
        results = list(pool.map(compile_one, lowered))
    compile_wall = time.perf_counter() - compile_start
    total_lower, total_compile = sum(x[2] for x in lowered), sum(r[1] for r in results)
    print(f"\n{'executable':36} {'lower s':>8} {'compile s':>9} {'temp MiB':>9}  weight copies")
    for (key, _, lower_s), (_, seconds, counts, temp) in zip(lowered, results):
        print(f"{' '.join(map(str, key)):36} {lower_s:8.1f} {seconds:9.1f} {temp:9.1f}  {counts or ''}", flush=True)
    by_kind = {}
    for key, seconds, _, _ in results:
        by_kind[key[0]] = by_kind.get(key[0], 0.0) + seconds
    print(f"\nlowering {total_lower:.1f} s; compiles {total_compile:.1f} s summed, {compile_wall:.1f} s wall on "
          f"{args.threads} thread(s); by kind: " + ", ".join(f"{k} {v:.1f} s" for k, v in
                                                               sorted(by_kind.items(), key=lambda kv: -kv[1]))
          + f"; total wall {time.perf_counter() - start:.1f} s; load {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
