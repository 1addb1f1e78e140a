"""Quantized SmolLM2-135M-Instruct against bf16: perplexity of a natural text, greedy chat answers,
and the device bytes of the Linear layers.

  python scripts/quantization_accuracy.py            # on-the-fly fp8 and int8
  (with ~/.cache/jpaged/smollm2-135m-instruct-<scheme> made by scripts/make_quantized_checkpoints.py,
   llm-compressor's FP8_DYNAMIC, W8A16, W8A8, and W4A16 in 64-column groups: round-to-nearest
   symmetric and asymmetric, and GPTQ, too)

Prints one table (markdown) for docs/PERF.md.
"""

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Public domain (Lewis Carroll, Alice's Adventures in Wonderland, chapter 1).
TEXT = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do: "
    "once or twice she had peeped into the book her sister was reading, but it had no pictures or conversations "
    "in it, and what is the use of a book, thought Alice, without pictures or conversations? So she was "
    "considering in her own mind (as well as she could, for the hot day made her feel very sleepy and stupid), "
    "whether the pleasure of making a daisy-chain would be worth the trouble of getting up and picking the "
    "daisies, when suddenly a White Rabbit with pink eyes ran close by her. There was nothing so very remarkable "
    "in that; nor did Alice think it so very much out of the way to hear the Rabbit say to itself, Oh dear! Oh "
    "dear! I shall be late! But when the Rabbit actually took a watch out of its waistcoat-pocket, and looked at "
    "it, and then hurried on, Alice started to her feet, for it flashed across her mind that she had never "
    "before seen a rabbit with either a waistcoat-pocket, or a watch to take out of it, and burning with "
    "curiosity, she ran across the field after it, and fortunately was just in time to see it pop down a large "
    "rabbit-hole under the hedge. In another moment down went Alice after it, never once considering how in the "
    "world she was to get out again."
)
QUESTIONS = ["What is the capital of France?", "Give me three tips for staying healthy.",
             "Explain what a prime number is in one sentence."]


def perplexity(llm, text: str) -> float:
    """exp(mean negative log-likelihood) of `text`'s tokens after the first (prompt logprobs)."""
    import jpaged

    ids = llm.get_tokenizer()(text).input_ids
    out = llm.generate([ids], jpaged.SamplingParams(prompt_logprobs=0, max_tokens=1), use_tqdm=False)[0]
    return math.exp(-sum(entry[token] for entry, token in zip(out.prompt_logprobs[1:], ids[1:])) / (len(ids) - 1))


def linear_bytes(llm) -> int:
    """Device bytes of the Linear layers (kernel, scale, zero) but the LM head."""
    from flax import nnx

    from jpaged.models.layers import Linear
    from jpaged.quantization.scheme import array_device_bytes

    runner = llm.llm_engine.runner
    model = nnx.merge(runner.graphdef, runner.state)
    total = 0
    for _, node in nnx.iter_graph(model):
        if isinstance(node, Linear) and "vocab" not in node.kernel.logical_axes:
            for param in (node.kernel, node.kernel_scale, node.kernel_zero):
                if param is not None:
                    total += array_device_bytes(param.get_value())
    return total


def measure(model: str, **kwargs) -> dict:
    import jpaged

    llm = jpaged.LLM(model, dtype="bfloat16", max_model_len=512, max_num_seqs=4, **kwargs)
    tokenizer = llm.get_tokenizer()
    chat_ids = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False) for q in QUESTIONS]
    chats = llm.generate(chat_ids, jpaged.SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    return {"ppl": perplexity(llm, TEXT), "answers": [c.outputs[0].token_ids for c in chats],
            "text": [c.outputs[0].text for c in chats], "linear_bytes": linear_bytes(llm),
            "model_bytes": llm.llm_engine.stats()["model_memory_bytes"]}


def same_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=os.path.expanduser("~/.cache/jpaged/smollm2-135m-instruct"))
    parser.add_argument("--show-answers", action="store_true")
    parser.add_argument("--only", nargs="*", help="measure bf16 and the variants whose names contain these")
    args = parser.parse_args()
    from scripts.make_smollm2 import make_smollm2
    base = make_smollm2(args.model_dir)
    variants = {"bf16": (base, {}), "fp8 (on the fly)": (base, {"quantization": "fp8"}),
                "int8 (on the fly)": (base, {"quantization": "int8"})}
    for scheme in ("fp8-dynamic", "w8a16", "w8a8", "w4a16", "w4a16-asym", "w4a16-gptq"):
        path = f"{args.model_dir}-{scheme}"
        if os.path.isdir(path):
            variants[f"llm-compressor {scheme}"] = (path, {})
    if args.only:
        variants = {k: v for k, v in variants.items() if k == "bf16" or any(o in k for o in args.only)}
    results = {name: measure(path, **kw) for name, (path, kw) in variants.items()}
    ref = results["bf16"]
    print(f"{len(ref['answers'])} chat answers of up to 48 greedy tokens; perplexity over "
          f"{len(TEXT.split())} words of natural text\n")
    print("| weights | perplexity | vs bf16 | answers equal to bf16's (tokens in common before the first difference) "
          "| Linear bytes | vs bf16 |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        prefixes = [same_prefix(a, b) for a, b in zip(r["answers"], ref["answers"])]
        equal = sum(a == b for a, b in zip(r["answers"], ref["answers"]))
        print(f"| {name} | {r['ppl']:.3f} | {100 * (r['ppl'] / ref['ppl'] - 1):+.2f}% | {equal}/{len(prefixes)} "
              f"({', '.join(map(str, prefixes))}) | {r['linear_bytes'] / 2**20:.1f} MiB | "
              f"{r['linear_bytes'] / ref['linear_bytes']:.3f}x |")
        if args.show_answers:
            for text in r["text"]:
                print("    ", repr(text[:120]))


if __name__ == "__main__":
    main()
