"""Offline throughput benchmark (vLLM's benchmarks/benchmark_throughput.py, for jpaged).

All requests are submitted at once; the engine runs them to completion with continuous
batching, and we report requests/s, output tokens/s and total (prompt + output) tokens/s
over the wall-clock time of generation only (model load, compilation and warm-up are
timed and reported separately).

Workload: synthetic ShareGPT-like lengths (right-skewed lognormals: prompt mean ~200,
output mean ~260 tokens before caps; prompt <= 1024, prompt + output <= 2048, both >= 4,
as vLLM filters ShareGPT), random token ids drawn from the vocabulary, fixed --seed.
Every request ignores EOS, so it produces exactly its requested number of output tokens.
Scale down for a CPU with --num-prompts, --length-scale and --max-input-len/--max-output-len,
or use fixed lengths with --input-len/--output-len.

Backends:
  jpaged  jpaged.LLM(...).generate(token-id prompts, per-request SamplingParams(max_tokens=...,
          ignore_eos=True, temperature=0)); engine flags pass through.
  hf      Hugging Face transformers' continuous batching (the engine behind
          `model.generate_batch`) on the same checkpoint and requests: torch (CUDA if available),
          the checkpoint's dtype or --dtype, greedy, eos_token_id=-1 (no EOS). generate_batch()
          takes a single max_new_tokens for all prompts, so by default (--hf-api manager) we drive
          the same ContinuousBatchingManager it wraps (init_continuous_batching / warmup / start /
          add_request(max_new_tokens=per request) / get_result / stop) — exactly what
          generate_batch does, minus the single-length restriction. --hf-api generate_batch calls
          generate_batch() itself and needs one output length (--output-len). --hf-api static is
          plain padded `model.generate` in batches of --hf-max-batch-size (the paper's / vLLM's HF
          baseline); there only each request's requested tokens count as output.
  both    runs jpaged then hf on the same requests and prints the jpaged/hf ratios.

Models: --model tiny (built in; for hf it is materialised into a temp dir), a local HF
checkpoint dir, or --random-llama {25m,1b,8b}: a randomly initialised LlamaForCausalLM built
with transformers and saved (save_pretrained) to a temp dir (or --save-dir) that both
backends load. 25m uses the tiny byte-level tokenizer (vocab 259) so that, as in real LLMs,
nearly all FLOPs are in the transformer layers rather than the vocabulary projection
(override with --vocab-size; a vocab other than 259 is saved without a tokenizer, which
is fine since prompts are token ids).

Examples (CPU):
  JAX_PLATFORMS=cpu python scripts/bench_throughput.py --random-llama 25m --num-prompts 64 \
      --length-scale 0.25 --backend both --max-num-seqs 64 --output-json /tmp/tp.json
  JAX_PLATFORMS=cpu python scripts/bench_throughput.py --model tiny --num-prompts 8 \
      --input-len 16 --output-len 16 --enforce-eager
GPU:
  python scripts/bench_throughput.py --random-llama 1b --num-prompts 1000 --backend both
"""

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import logging
import math
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scripts.bench_models import (PRESETS, TINY_VOCAB, build_random_llama,  # noqa: E402,F401
                                  build_tiny_checkpoint, model_vocab_size)

# ShareGPT-like length distributions (lognormal; mean = exp(mu + sigma^2 / 2) before caps).
PROMPT_LOGNORMAL = (math.log(200) - 0.5, 1.0)  # mean 200 uncapped, median ~121
OUTPUT_LOGNORMAL = (math.log(260) - 0.405, 0.9)  # mean 260 uncapped, median ~173
MAX_PROMPT_LEN, MAX_TOTAL_LEN, MIN_LEN = 1024, 2048, 4

logger = logging.getLogger("bench_throughput")


@dataclasses.dataclass
class Request:
    prompt_token_ids: list[int]
    output_len: int


# ---------------------------------------------------------------------------------- workload
def sample_lengths(args, rng: np.random.Generator) -> list[tuple[int, int]]:
    """(prompt_len, output_len) per request, after caps and scaling."""
    n = args.num_prompts
    prompt = rng.lognormal(*PROMPT_LOGNORMAL, size=n)
    output = rng.lognormal(*OUTPUT_LOGNORMAL, size=n)
    lengths = []
    for p, o in zip(prompt, output):
        p = int(np.clip(round(p), MIN_LEN, MAX_PROMPT_LEN))
        o = int(np.clip(round(o), MIN_LEN, MAX_TOTAL_LEN - p))
        p, o = max(1, round(p * args.length_scale)), max(1, round(o * args.length_scale))
        if args.max_input_len:
            p = min(p, args.max_input_len)
        if args.max_output_len:
            o = min(o, args.max_output_len)
        if args.input_len:
            p = args.input_len
        if args.output_len:
            o = args.output_len
        lengths.append((p, o))
    return lengths


def make_requests(args, vocab_size: int) -> list[Request]:
    rng = np.random.default_rng(args.seed)
    lengths = sample_lengths(args, rng)
    return [Request(rng.integers(0, vocab_size, size=p).tolist(), o) for p, o in lengths]


# ---------------------------------------------------------------------------------- backends
def engine_kwargs(args) -> dict:
    kw = {"block_size": args.block_size, "max_num_seqs": args.max_num_seqs, "dtype": args.dtype,
          "tensor_parallel_size": args.tensor_parallel_size, "enforce_eager": args.enforce_eager, "seed": args.seed}
    for name in ("max_num_batched_tokens", "max_model_len", "num_gpu_blocks_override", "swap_space",
                 "gpu_memory_utilization", "preemption_mode"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.attention_backend:
        kw["attention_backend"] = args.attention_backend
    if args.batch_invariant:
        kw["batch_invariant"] = True
    if args.async_scheduling is not None:
        kw["async_scheduling"] = args.async_scheduling
    if args.num_scheduler_steps > 1:
        kw["num_scheduler_steps"] = args.num_scheduler_steps
    if args.quantization:
        kw["quantization"] = args.quantization
    return kw


def run_jpaged(args, model: str, requests: list[Request]) -> dict:
    import jax

    import jpaged

    kw = engine_kwargs(args)
    if "max_model_len" not in kw:  # the workload's longest request, not the model's 4k-128k positions
        kw["max_model_len"] = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    t0 = time.perf_counter()
    llm = jpaged.LLM(model, **kw)
    llm.wait_for_warmup()  # LLM() returns while its step shapes still compile in the background
    init_s = time.perf_counter() - t0
    prompts = [r.prompt_token_ids for r in requests]
    params = [jpaged.SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    if args.guided_every:  # structured output: every Nth request follows a grammar to its max_tokens (no EOS before)
        params = [jpaged.SamplingParams(temperature=0.0, max_tokens=r.output_len, guided_regex=args.guided_regex
                                        or f"[a-z ]{{{r.output_len},}}") if i % args.guided_every == 0 else sp
                  for i, (r, sp) in enumerate(zip(requests, params))]
    warmup_s = 0.0
    if args.num_warmup_prompts:
        # The first N requests' lengths with other token ids: the same schedule (the shapes the
        # timed run meets compile here), and no prefix the timed run could find cached.
        k = args.num_warmup_prompts
        rng = np.random.default_rng([args.seed, 1])
        vocab = max(max(p) for p in prompts) + 1
        warm = [rng.integers(0, vocab, size=len(p)).tolist() for p in prompts[:k]]
        t0 = time.perf_counter()
        llm.generate(warm, params[:k], use_tqdm=False)
        warmup_s = time.perf_counter() - t0
    before = llm.stats()
    compilations_before = before["num_compilations"]
    # --profile DIR: a jax.profiler trace of the timed run (TensorBoard's profile plugin or Perfetto read it).
    trace = jax.profiler.trace(args.profile) if args.profile else contextlib.nullcontext()
    with trace:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=not args.no_tqdm)
        elapsed = time.perf_counter() - t0
    stats = llm.stats()
    if stats["num_compilations"] > compilations_before:  # its seconds are in the figures: say so
        print(f"WARNING: {stats['num_compilations'] - compilations_before} executable(s) compiled during the timed "
              f"run (warm up with --num-warmup-prompts {len(prompts)}, or without --enforce-eager)", flush=True)
    from jpaged.step_clock import table

    phases = [{"phase": phase, "ms_per_step": ms, "share": share} for phase, ms, share in table(before, stats)]
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    produced = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"backend": "jpaged", "elapsed_s": elapsed, "token_ids": tokens, "init_s": init_s, "warmup_s": warmup_s,
            "output_tokens": produced, "engine": kw, "jax_backend": jax.default_backend(),
            "num_gpu_blocks": stats["num_gpu_blocks"], "num_preemptions": stats["num_preemptions"],
            "compilations_during_run": stats["num_compilations"] - compilations_before,
            "steps": stats["num_steps_timed"] - before["num_steps_timed"], "step_phases": phases}


def run_hf(args, model_dir: str, requests: list[Request]) -> dict:
    import torch
    import transformers
    from transformers import (
        AutoModelForCausalLM,
        ContinuousBatchingConfig,
        GenerationConfig,
    )
    from transformers.generation.continuous_batching.utils import WorkloadHints

    device = "cuda" if torch.cuda.is_available() and not args.hf_cpu else "cpu"
    # The checkpoint's dtype (or --dtype), as jpaged uses: fp32 for the 25m preset, bf16 for 1b/8b.
    dtype = "auto" if args.dtype in (None, "auto") else getattr(torch, args.dtype)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=args.hf_attn).to(device)
    model.eval()
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                                  max_new_tokens=max(r.output_len for r in requests))
    cb_kw = {}
    if args.hf_page_size:
        cb_kw["page_size"] = args.hf_page_size
    if args.hf_max_batch_tokens:
        cb_kw["max_batch_tokens"] = args.hf_max_batch_tokens
    if args.hf_num_blocks:
        cb_kw["num_blocks"] = args.hf_num_blocks
    if args.hf_max_requests_per_batch:
        cb_kw["max_requests_per_batch"] = args.hf_max_requests_per_batch
    cb_config = ContinuousBatchingConfig(**cb_kw)
    inputs = [r.prompt_token_ids for r in requests]
    load_s = time.perf_counter() - t0

    if args.hf_api == "static":
        return run_hf_static(args, model, load_s, requests)
    if args.hf_api == "generate_batch":
        lens = {r.output_len for r in requests}
        if len(lens) != 1:
            raise SystemExit("--hf-api generate_batch needs one output length for all requests (--output-len)")
        t0 = time.perf_counter()
        results = model.generate_batch(inputs=inputs, generation_config=gen_config,
                                       continuous_batching_config=cb_config, progress_bar=not args.no_tqdm)
        elapsed = time.perf_counter() - t0  # includes the manager's warm-up (CUDA graphs; little on CPU)
        warmup_s = 0.0
        tokens = [list(res.generated_tokens) for res in results.values()]
    else:
        hints = WorkloadHints(max_prompt_length=max(len(x) for x in inputs),
                              max_generated_length=gen_config.max_new_tokens, num_requests=len(inputs))
        manager = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config,
                                                 workload_hints=hints)
        t0 = time.perf_counter()
        manager.warmup()
        warmup_s = time.perf_counter() - t0
        results = {}
        t0 = time.perf_counter()
        manager.start()
        try:
            ids = [manager.add_request(x, request_id=f"r{i}", max_new_tokens=r.output_len)
                   for i, (x, r) in enumerate(zip(inputs, requests))]
            while len(results) < len(ids):
                res = manager.get_result(timeout=1)
                if res is not None and res.is_finished():
                    if res.error is not None:
                        raise RuntimeError(f"hf request {res.request_id} failed: {res.error}")
                    results[res.request_id] = res
                elif res is None and not manager.is_running():
                    raise RuntimeError("hf continuous batching thread died")
            elapsed = time.perf_counter() - t0
        finally:
            manager.stop(block=True, timeout=30)
            manager.destroy()
        tokens = [list(results[f"r{i}"].generated_tokens) for i in range(len(requests))]
    return {"backend": "hf", "elapsed_s": elapsed, "token_ids": tokens, "init_s": load_s, "warmup_s": warmup_s,
            "output_tokens": sum(len(t) for t in tokens), "device": device, "dtype": str(model.dtype),
            "attn_implementation": args.hf_attn, "hf_api": args.hf_api, "torch_threads": torch.get_num_threads(),
            "transformers": transformers.__version__, "continuous_batching_config": dict(cb_kw)}


def run_hf_static(args, model, load_s: float, requests: list[Request]) -> dict:
    """Plain `model.generate` with static batches (the paper's HF baseline, and vLLM's `--backend hf`):
    consecutive requests are grouped into batches of at most --hf-max-batch-size, left-padded, and
    each batch generates max(output_len in batch) tokens (min_new_tokens = max_new_tokens, so EOS never
    stops it). As in vLLM's benchmark_throughput, only the tokens each request asked for count as
    output; the rest is the padding waste continuous batching removes."""
    import torch

    device = model.device
    tokens, elapsed = [], 0.0
    for start in range(0, len(requests), args.hf_max_batch_size):
        batch = requests[start:start + args.hf_max_batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids):] = 1
        new = max(r.output_len for r in batch)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                 max_new_tokens=new, min_new_tokens=new, pad_token_id=0, use_cache=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed += time.perf_counter() - t0
        tokens += [out[i, width:width + r.output_len].tolist() for i, r in enumerate(batch)]
    return {"backend": "hf", "elapsed_s": elapsed, "token_ids": tokens, "init_s": load_s, "warmup_s": 0.0,
            "output_tokens": sum(len(t) for t in tokens), "device": str(device), "dtype": str(model.dtype),
            "attn_implementation": args.hf_attn, "hf_api": "static", "hf_max_batch_size": args.hf_max_batch_size,
            "torch_threads": torch.get_num_threads()}


def summarise(res: dict, requests: list[Request]) -> dict:
    n = len(requests)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    expected = sum(r.output_len for r in requests)
    t = res["elapsed_s"]
    res.update(num_requests=n, prompt_tokens=prompt_tokens, expected_output_tokens=expected,
               requests_per_s=n / t, output_tokens_per_s=res["output_tokens"] / t,
               total_tokens_per_s=(prompt_tokens + res["output_tokens"]) / t)
    return res


def print_summary(res: dict):
    print(f"[{res['backend']}] Throughput: {res['requests_per_s']:.2f} requests/s, "
          f"{res['total_tokens_per_s']:.2f} total tokens/s, {res['output_tokens_per_s']:.2f} output tokens/s "
          f"({res['num_requests']} requests, {res['prompt_tokens']} prompt + {res['output_tokens']} output tokens "
          f"in {res['elapsed_s']:.2f} s; init {res['init_s']:.1f} s, warm-up {res['warmup_s']:.1f} s)", flush=True)
    if res.get("step_phases"):  # jpaged: where the engine thread's time went, per step
        print(f"[{res['backend']}] {res['steps']} steps; per step: " + ", ".join(
            f"{p['phase']} {p['ms_per_step']:.3f} ms ({p['share']:.0%})" for p in res["step_phases"]), flush=True)
    if res["output_tokens"] != res["expected_output_tokens"]:
        print(f"[{res['backend']}] WARNING: produced {res['output_tokens']} output tokens, "
              f"requested {res['expected_output_tokens']}", flush=True)


# ---------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["jpaged", "hf", "both"], default="jpaged")
    p.add_argument("--model", default="tiny", help='"tiny" or a local HF checkpoint dir')
    p.add_argument("--random-llama", choices=sorted(PRESETS), help="benchmark a random Llama of this size instead")
    p.add_argument("--vocab-size", type=int, help="override the --random-llama preset's vocabulary")
    p.add_argument("--save-dir", help="keep the --random-llama checkpoint here (reused if it has a config.json)")
    # workload
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--length-scale", type=float, default=1.0, help="multiply sampled prompt/output lengths")
    p.add_argument("--max-input-len", type=int)
    p.add_argument("--max-output-len", type=int)
    p.add_argument("--input-len", type=int, help="fixed prompt length (overrides the distribution)")
    p.add_argument("--output-len", type=int, help="fixed output length (overrides the distribution)")
    # jpaged engine flags
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--max-model-len", type=int, help="default: the workload's longest prompt + output")
    p.add_argument("--num-gpu-blocks-override", type=int)
    p.add_argument("--gpu-memory-utilization", type=float)
    p.add_argument("--swap-space", type=float)
    p.add_argument("--preemption-mode", choices=["swap", "recompute"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--attention-backend", choices=["auto", "pallas", "xla"])
    p.add_argument("--batch-invariant", action="store_true", help="jpaged: bitwise batch-invariant mode")
    p.add_argument("--enforce-eager", action="store_true", help="compile step shapes on first use (not at start-up)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap the host's work with the device's (default: the engine's, on)")
    p.add_argument("--num-scheduler-steps", type=int, default=1, help="multi-step decode: steps per device call")
    p.add_argument("--guided-every", type=int, default=0, help="jpaged: every Nth request follows --guided-regex "
                   "(structured output; the model needs a tokenizer: --random-llama with --vocab-size 259)")
    p.add_argument("--guided-regex", help="default: [a-z ]{OUTPUT_LEN,} (a grammar allows EOS when it "
                   "may end, whatever min_tokens says)")
    p.add_argument("--quantization", choices=["fp8", "int8"], help="jpaged: weights quantized while loading")
    p.add_argument("--num-warmup-prompts", type=int, default=0,
                   help="jpaged: run N requests of the first N's lengths (other token ids: nothing cached) "
                        "once, untimed, before the timed run; all of them (= --num-prompts) compiles every "
                        "shape the timed run meets")
    # hf flags
    p.add_argument("--hf-api", choices=["manager", "generate_batch", "static"], default="manager",
                   help="manager: continuous batching with per-request lengths (default); generate_batch: the "
                        "one-call API (one output length); static: plain padded model.generate batches")
    p.add_argument("--hf-max-batch-size", type=int, default=64, help="--hf-api static: requests per batch")
    p.add_argument("--hf-attn", default="sdpa", help='attn_implementation: "sdpa" or "paged|eager" (or flash on GPU)')
    p.add_argument("--hf-cpu", action="store_true", help="run hf on the CPU even if CUDA is available")
    p.add_argument("--hf-page-size", type=int)
    p.add_argument("--hf-max-batch-tokens", type=int)
    p.add_argument("--hf-num-blocks", type=int)
    p.add_argument("--hf-max-requests-per-batch", type=int)
    # output
    p.add_argument("--profile", metavar="DIR", help="jpaged: write a jax.profiler trace of the timed run to DIR")
    p.add_argument("--output-json")
    p.add_argument("--no-tqdm", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if (args.random_llama or args.backend != "jpaged") and importlib.util.find_spec("torch") is None:
        sys.exit('error: bench_throughput.py --random-llama and --backend hf need torch (transformers builds '
                 'and runs the models): pip install ".[reference]"')
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tmp = None
    try:
        model = args.model
        if args.random_llama:
            model = args.save_dir or (tmp := tempfile.mkdtemp(prefix=f"jpaged-llama-{args.random_llama}-"))
            if not os.path.exists(os.path.join(model, "config.json")):
                t0 = time.perf_counter()
                build_random_llama(args.random_llama, model, args.seed, args.vocab_size)
                logger.info("built in %.1f s", time.perf_counter() - t0)
        requests = make_requests(args, model_vocab_size(model))
        p_lens = [len(r.prompt_token_ids) for r in requests]
        o_lens = [r.output_len for r in requests]
        print(f"workload: {len(requests)} requests; prompt len mean {np.mean(p_lens):.1f} (max {max(p_lens)}), "
              f"output len mean {np.mean(o_lens):.1f} (max {max(o_lens)}); seed {args.seed}", flush=True)

        results = []
        if args.backend in ("jpaged", "both"):
            results.append(summarise(run_jpaged(args, model, requests), requests))
            print_summary(results[-1])
        if args.backend in ("hf", "both"):
            hf_model = model
            if model == "tiny":
                hf_model = build_tiny_checkpoint(tmp := tmp or tempfile.mkdtemp(prefix="jpaged-tiny-"))
            results.append(summarise(run_hf(args, hf_model, requests), requests))
            print_summary(results[-1])
        report = {"model": args.random_llama and f"random-llama-{args.random_llama}" or args.model,
                  "args": vars(args), "host": platform.node(), "python": platform.python_version(),
                  "workload": {"num_requests": len(requests), "mean_prompt_len": float(np.mean(p_lens)),
                               "mean_output_len": float(np.mean(o_lens)), "max_prompt_len": max(p_lens),
                               "max_output_len": max(o_lens)},
                  "results": results}
        try:
            import jax
            report["jax"] = jax.__version__
        except ImportError:
            pass
        if len(results) == 2:
            j, h = results
            report["ratio_jpaged_over_hf"] = {k: j[k] / h[k] for k in
                                              ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")}
            # Same checkpoint, greedy: outputs should mostly agree (random weights have near-ties, and
            # fp32 summation order differs, so a few may diverge after some tokens).
            same = sum(a == b for a, b in zip(j["token_ids"], h["token_ids"]))
            report["identical_outputs"] = f"{same}/{len(requests)}"
            print(f"jpaged / hf: {report['ratio_jpaged_over_hf']['output_tokens_per_s']:.2f}x output tokens/s "
                  f"(identical greedy outputs: {same}/{len(requests)})", flush=True)
        if args.output_json:
            slim = dict(report, results=[{k: v for k, v in r.items() if k != "token_ids"} for r in results])
            with open(args.output_json, "w") as f:
                json.dump(slim, f, indent=2, default=str)
        return report
    finally:
        if tmp and not args.save_dir:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
