"""Python pieces of scripts/gpu_check.sh (each runs on a CPU too, with small sizes).

  python scripts/gpu_check.py devices --device cuda [--attention-backend B] [--kv-cache-dtype fp8]
                                                        # what jax sees, then a tiny engine on it
  python scripts/gpu_check.py devices --device cuda --jax-only            # what jax sees (seconds)
  python scripts/gpu_check.py devices --device cuda --configs auto/auto,mosaic/fp8   # several engines
  python scripts/gpu_check.py features --device cuda     # every engine feature on the GPU, checked
  python scripts/gpu_check.py compare JPAGED.json HF.json [HF2.json ...]   # throughput ratios
  python scripts/gpu_check.py build-model DIR [--size 1b]   # random Llama + the tiny tokenizer (CPU)
  python scripts/gpu_check.py report LOGS OUT               # LOGS/steps.tsv + logs -> OUT/results.{json,md}

`devices` exits non-zero unless the engine starts on the requested device (device="cuda" is the
engine's own loud check: no silent fallback to the CPU) and generates; it prints jax's devices,
their compute capability and memory, and the engine's start-up line (backend, device, kernels,
KV pool). `--jax-only` stops after jax's devices (asserting the GPU backend with --device cuda);
`--configs` runs one tiny engine per attention_backend/kv_cache_dtype pair in one process (one jax
start-up for all), going on after a failure. `features` runs the tiny model through each feature on
the GPU and checks what must hold there: speculation (n-gram, draft model) against plain greedy
decoding (reported; under batch_invariant=True n-gram's must all be equal), quantized weights (fp8, int8) generating, a LoRA adapter changing the output and a mixed
batch equal to each request alone, and batch invariance (a prompt's logprobs bitwise equal alone
and in a batch of 8). `compare` reads bench_throughput.py --output-json files run in separate
processes (HF in its own, so neither starves the other's memory) and prints one markdown row per HF
run. `build-model` writes bench_throughput.py's random Llama preset (1b: Llama-3.2-1B's shapes,
bf16, 128,256-token vocabulary, and here its 131,072 positions) with jpaged's byte-level tiny
tokenizer and its special ids, so that `jpaged serve` can take text, chat and grammars on it (ids
past the tokenizer's 259 decode to no text; grammars mask them). `report` turns gpu_check.sh's step records into results.json (step ->
status, exit, seconds, limit, figures parsed from its log or JSON) and results.md.
"""

import argparse
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))  # gpu_check_report


def devices(args) -> int:
    import jax

    if not args.jax_only:
        import jpaged  # noqa: F401 (before jax picks its backends, as an engine's process does)

    print(f"jax {jax.__version__}; default backend {jax.default_backend()}")
    for d in jax.devices():
        stats = d.memory_stats() or {}
        limit = stats.get("bytes_limit")
        print(f"  {d}: {d.device_kind}, compute capability {getattr(d, 'compute_capability', '-')}"
              + (f", {limit / 2**30:.1f} GiB for jax" if limit else ""))
    if args.jax_only:
        if args.device == "cuda" and jax.default_backend() != "gpu":
            print(f"device='cuda' but jax's default backend is {jax.default_backend()!r}")
            return 1
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not args.configs:
        return _one_engine(args, args.attention_backend, args.kv_cache_dtype)
    failures = 0
    for config in args.configs.split(","):
        backend, _, kv_cache_dtype = config.partition("/")
        try:
            failures += _one_engine(args, backend, kv_cache_dtype or "auto") != 0
        except Exception as e:  # noqa: BLE001 (reported, the next configuration runs)
            failures += 1
            print(f"engine attention_backend={backend!r}, kv_cache_dtype={kv_cache_dtype or 'auto'!r}: FAILED "
                  f"({type(e).__name__}: {str(e)[:500]})")
    return 1 if failures else 0


def _one_engine(args, attention_backend: str, kv_cache_dtype: str) -> int:
    import gc

    import jax

    import jpaged

    expect_refused = args.expect_refused or attention_backend in args.expect_refused_backends.split(",")
    try:
        llm = jpaged.LLM("tiny", device=args.device, dtype="bfloat16", max_model_len=256, max_num_seqs=4,
                         num_gpu_blocks_override=64, attention_backend=attention_backend, enforce_eager=True,
                         kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=kv_cache_dtype != "auto")
    except ValueError as e:
        if expect_refused and "sm_90" in str(e):
            print(f"refused at start-up, as it must be here: {e}")
            return 0
        raise
    if expect_refused:
        print(f"attention_backend={attention_backend!r} started on a GPU that cannot run it")
        return 1
    out = llm.generate([[1, 2, 3, 4]], jpaged.SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    print(f"generated {len(out[0].outputs[0].token_ids)} tokens on {args.device or jax.default_backend()} with "
          f"attention_backend={attention_backend!r}, kv_cache_dtype={kv_cache_dtype!r}")
    del llm, out
    gc.collect()  # the next configuration's engine gets the memory back
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
    # In bf16 a verification step rounds differently from one-token decode steps: the agreement is
    # reported (vLLM documents the same caveat); under batch_invariant=True (n-gram only) it must be whole.
    for method, extra in (("ngram", {"prompt_lookup_max": 3}), ("draft_model", {"model": "tiny"})):
        try:
            spec = jpaged.LLM("tiny", num_scheduler_steps=1, **limits,
                              speculative_config={"method": method, "num_speculative_tokens": 3, **extra})
            same = sum(a == b for a, b in zip(tokens(spec), plain))
            report(f"speculation {method}", True, f"{same}/{len(plain)} equal to plain greedy (reported, bf16)")
        except Exception as e:
            report(f"speculation {method}", False, f"{type(e).__name__}: {e}")
    try:
        invariant = {**limits, "batch_invariant": True}
        plain_invariant = tokens(jpaged.LLM("tiny", **invariant))
        spec = jpaged.LLM("tiny", num_scheduler_steps=1, **invariant,
                          speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
        same = sum(a == b for a, b in zip(tokens(spec), plain_invariant))
        report("speculation ngram, batch_invariant", same == len(plain_invariant),
               f"{same}/{len(plain_invariant)} equal to plain greedy")
    except Exception as e:
        report("speculation ngram, batch_invariant", False, f"{type(e).__name__}: {e}")
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


# Llama-3.2-1B's context: the engine's default max_model_len on it (the preset has 8192). Its
# rope_scaling (llama3, factor 32) is left out: it changes the numbers, not the shapes or the memory.
LLAMA_3_2_1B_POSITIONS = 131072


def set_config(directory: str, name: str = "config.json", **values):
    """Set `values` in the checkpoint's JSON file `name` (if there is one)."""
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        return
    with open(path) as f:
        config = json.load(f)
    config.update(values)
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def add_tiny_tokenizer(directory: str):
    """jpaged's byte-level tiny tokenizer (with its chat template) into a checkpoint directory, and
    its special ids (<s>=256, </s>=257, <pad>=258) into config.json and generation_config.json, so the
    model stops where a grammar ends and the server takes text and chat."""
    from jpaged.models.tiny import tiny_tokenizer

    tiny_tokenizer().save_pretrained(directory)
    special = {"bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258}
    set_config(directory, **special)
    set_config(directory, "generation_config.json", **special)


def build_model(args) -> int:
    import time

    from scripts.bench_models import build_random_llama

    t0 = time.perf_counter()
    if not os.path.exists(os.path.join(args.dir, "config.json")):
        build_random_llama(args.size, args.dir, 0)
    add_tiny_tokenizer(args.dir)
    if args.size == "1b":
        set_config(args.dir, max_position_embeddings=LLAMA_3_2_1B_POSITIONS)
    print(f"random Llama {args.size} with the tiny tokenizer in {args.dir} ({time.perf_counter() - t0:.1f} s)")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("devices")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--configs", help="comma-separated BACKEND/KV_CACHE_DTYPE pairs, one engine each")
    p.add_argument("--jax-only", action="store_true", help="only what jax sees (with --device cuda: a GPU backend)")
    p.add_argument("--expect-refused", action="store_true", help="succeed only if the engine refuses the backend")
    p.add_argument("--expect-refused-backends", default="", help="with --configs: these backends must be refused")
    p = sub.add_parser("features")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p = sub.add_parser("compare")
    p.add_argument("jpaged")
    p.add_argument("hf", nargs="+")
    p = sub.add_parser("build-model")
    p.add_argument("dir")
    p.add_argument("--size", default="1b", help="a bench_throughput.py preset")
    p = sub.add_parser("report")
    p.add_argument("logs")
    p.add_argument("out")
    args = parser.parse_args(argv)
    if args.command == "report":
        from gpu_check_report import report
        return report(args.logs, args.out)
    commands = {"devices": devices, "features": features, "compare": compare, "build-model": build_model}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
