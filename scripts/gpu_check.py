"""Python pieces of scripts/gpu_check.sh (each runs on a CPU too, with small sizes).

  python scripts/gpu_check.py devices --device cuda [--attention-backend B] [--kv-cache-dtype fp8]
                                                        # what jax sees, then a tiny engine on it
  python scripts/gpu_check.py features --device cuda     # every engine feature on the GPU, checked
  python scripts/gpu_check.py compare JPAGED.json HF.json [HF2.json ...]   # throughput ratios

`devices` exits non-zero unless the engine starts on the requested device (device="cuda" is the
engine's own loud check: no silent fallback to the CPU) and generates; it prints jax's devices,
their compute capability and memory, and the engine's start-up line (backend, device, kernels,
KV pool). `features` runs the tiny model through each feature on the GPU and checks what must hold there:
speculation (n-gram, draft model) equal to plain greedy decoding, quantized weights (fp8, int8)
generating, a LoRA adapter changing the output and a mixed batch equal to each request alone, and
batch invariance (a prompt's logprobs bitwise equal alone and in a batch of 8). `compare` reads bench_throughput.py --output-json files run in separate processes
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
    try:
        llm = jpaged.LLM("tiny", device=args.device, dtype="bfloat16", max_model_len=256, max_num_seqs=4,
                         num_gpu_blocks_override=64, attention_backend=args.attention_backend, enforce_eager=True,
                         kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.kv_cache_dtype != "auto")
    except ValueError as e:
        if args.expect_refused and "sm_90" in str(e):
            print(f"refused at start-up, as it must be here: {e}")
            return 0
        raise
    if args.expect_refused:
        print(f"attention_backend={args.attention_backend!r} started on a GPU that cannot run it")
        return 1
    out = llm.generate([[1, 2, 3, 4]], jpaged.SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    print(f"generated {len(out[0].outputs[0].token_ids)} tokens on {args.device or jax.default_backend()} with "
          f"attention_backend={args.attention_backend!r}, kv_cache_dtype={args.kv_cache_dtype!r}")
    return 0


def _adapter(directory: str, config, rank: int = 8) -> str:
    """A PEFT LoRA adapter of the tiny model on q/v (random A and B), written by hand: the GPU
    image has no peft."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    head_dim = config.hidden_size // config.num_attention_heads
    outs = {"q_proj": config.num_attention_heads * head_dim, "v_proj": config.num_key_value_heads * head_dim}
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for name, out in outs.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, 0.5, (rank, config.hidden_size)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.5, (out, rank)).astype(np.float32)
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(outs),
                   "bias": "none", "base_model_name_or_path": "tiny"}, f)
    return directory


def features(args) -> int:
    import tempfile

    import numpy as np

    import jpaged
    from jpaged.models import tiny

    limits = dict(device=args.device, dtype="bfloat16", max_model_len=256, max_num_seqs=8,
                  num_gpu_blocks_override=128, enforce_eager=True)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 250, int(n))] for n in rng.integers(4, 40, 8)]
    # Repetitive prompts give the n-gram proposer something to match.
    prompts[:2] = [[7, 8, 9, 10] * 6, [20, 21, 22] * 9]
    greedy = jpaged.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    failures = 0

    def report(name, ok, detail):
        nonlocal failures
        failures += not ok
        print(f"feature {name}: {'ok' if ok else 'FAIL'} ({detail})", flush=True)

    def tokens(llm, sp=greedy, **kw):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False, **kw)]

    plain = tokens(jpaged.LLM("tiny", **limits))
    for method, extra in (("ngram", {"prompt_lookup_max": 3}), ("draft_model", {"model": "tiny"})):
        try:
            spec = jpaged.LLM("tiny", num_scheduler_steps=1, **limits,
                              speculative_config={"method": method, "num_speculative_tokens": 3, **extra})
            same = sum(a == b for a, b in zip(tokens(spec), plain))
            report(f"speculation {method}", same == len(plain), f"{same}/{len(plain)} equal to plain greedy")
        except Exception as e:
            report(f"speculation {method}", False, f"{type(e).__name__}: {e}")
    for quantization in ("fp8", "int8"):
        try:
            out = tokens(jpaged.LLM("tiny", quantization=quantization, **limits))
            agree = np.mean([np.mean(np.array(a) == np.array(b)) for a, b in zip(out, plain)])
            report(f"weights {quantization}", all(len(t) == 24 for t in out), f"token agreement with bf16 {agree:.2f}")
        except Exception as e:
            report(f"weights {quantization}", False, f"{type(e).__name__}: {e}")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            lora = jpaged.LoRARequest("gpu-check", 1, _adapter(tmp, tiny.tiny_config()))
            llm = jpaged.LLM("tiny", enable_lora=True, max_lora_rank=8, **limits)
            alone = tokens(llm, lora_request=lora)
            mixed = tokens(llm, lora_request=[lora if i % 2 else None for i in range(len(prompts))])
            base = tokens(llm)
            expect = [alone[i] if i % 2 else base[i] for i in range(len(prompts))]
            report("LoRA", mixed == expect and alone != base,
                   f"adapter changes {sum(a != b for a, b in zip(alone, base))}/{len(base)} outputs; "
                   f"mixed batch equal to each alone: {mixed == expect}")
    except Exception as e:
        report("LoRA", False, f"{type(e).__name__}: {e}")
    try:
        llm = jpaged.LLM("tiny", batch_invariant=True, **limits)
        sp = jpaged.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)

        def logprobs(batch):
            out = llm.generate(batch, sp, use_tqdm=False)[0].outputs[0]
            return out.token_ids, [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]

        alone, batched = logprobs(prompts[2:3]), logprobs(prompts[2:])
        from pallas_kernels import invariant
        tiles = invariant.invariant_tiles(2, 64)  # what the loader measured for tiny (group 2, head dim 64)
        report("batch invariance", alone == batched, "a prompt's tokens and logprobs alone vs in a batch of "
               f"{len(prompts) - 2}: {'bitwise equal' if alone == batched else 'different'}; "
               f"attention tiles (decode, prefill) {tiles}")
    except Exception as e:
        report("batch invariance", False, f"{type(e).__name__}: {e}")
    return 1 if failures else 0


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
    p.add_argument("--expect-refused", action="store_true", help="succeed only if the engine refuses the backend")
    p = sub.add_parser("features")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p = sub.add_parser("compare")
    p.add_argument("jpaged")
    p.add_argument("hf", nargs="+")
    args = parser.parse_args(argv)
    return {"devices": devices, "features": features, "compare": compare}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
