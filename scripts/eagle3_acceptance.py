"""Acceptance of an EAGLE-3 head (scripts/train_eagle3.py) on chat prompts it was not trained on:
the mean accepted length (tokens per verified run, the bonus token counted) and the acceptance
per draft position (how often the i-th draft of a run was accepted, over runs), the figures the
EAGLE papers report. Greedy; the outputs are checked against the target's without speculation.

  python scripts/eagle3_acceptance.py --head /tmp/eagle3-smollm2 [--k 3] [--max-tokens 128]
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jpaged  # noqa: E402
from scripts.bench_spec import CHAT  # noqa: E402
from scripts.train_eagle3 import HELD_OUT_SUBJECTS, prompts_of  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=os.path.expanduser("~/.cache/jpaged/smollm2-135m-instruct"))
    parser.add_argument("--head", required=True)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--no-check", action="store_true", help="skip the run without speculation")
    args = parser.parse_args(argv)
    questions = (CHAT + prompts_of(HELD_OUT_SUBJECTS))[:args.num_prompts]
    shape = dict(max_num_seqs=16, max_model_len=512, max_num_batched_tokens=2048, enforce_eager=True)
    llm = jpaged.LLM(args.model, speculative_config={"method": "eagle3", "model": args.head,
                                                     "num_speculative_tokens": args.k}, **shape)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
               for q in questions]
    sp = jpaged.SamplingParams(temperature=0, max_tokens=args.max_tokens)
    start = time.time()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    s = llm.stats()
    runs, accepted = s["spec_decode_num_drafts"], s["spec_decode_num_accepted_tokens"]
    per_pos = [round(a / runs, 3) for a in s["spec_decode_num_accepted_tokens_per_pos"]]
    print(f"{len(prompts)} held-out chat prompts, greedy, k={args.k}, {time.time() - start:.0f} s: "
          f"{runs} verified runs, mean accepted length {1 + accepted / runs:.2f}, "
          f"acceptance by position {per_pos}, draft acceptance rate {accepted / s['spec_decode_num_draft_tokens']:.3f}")
    if not args.no_check:
        plain = jpaged.LLM(args.model, **shape).generate(prompts, sp, use_tqdm=False)
        same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, plain))
        print(f"same outputs as without speculation: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
