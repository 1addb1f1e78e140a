"""Train an EAGLE-3 head for a target by self-distillation (as SpecForge does), on the CPU, and
write it in the public layout (jpaged/spec_decode/eagle_head.py) for speculative_config
{"method": "eagle3", "model": OUT}.

  1. chat prompts (templates x subjects, split into train and held-out by subject), chat-templated;
  2. the target's own greedy answers (jpaged, batched);
  3. the target's hidden states entering layers (2, L/2, L-3) and its argmax at every token
     (Hugging Face transformers, float32);
  4. the head, trained with optax (AdamW, cosine) on the target's argmax tokens, unrolled over
     `--ttt-steps` draft steps (EAGLE-3's training-time test: step j's hidden input is step
     j - 1's output, and its query attends the true entries before the anchor and the anchor's
     own chain, as the drafting chain does), for `--minutes`;
  5. acceptance on the held-out prompts: see scripts/eagle3_acceptance.py.

The draft vocabulary: the `--draft-vocab` most frequent target tokens of the training answers.
The head starts from the target where it can: lm_head from the target's embedding rows (tied
SmolLM2), norm from its final norm, fc selecting the high layer's features.

  python scripts/train_eagle3.py --out /tmp/eagle3-smollm2 [--minutes 20] [--model DIR]
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

SUBJECTS = ["the ocean", "volcanoes", "honey bees", "the moon", "bicycles", "coffee", "chess", "rain forests",
            "the human heart", "electricity", "pyramids", "penguins", "bread", "music", "trains", "glaciers",
            "the internet", "gardening", "whales", "photosynthesis", "earthquakes", "libraries", "the Roman Empire",
            "clouds", "vaccines", "solar panels", "elephants", "friendship", "mountains", "airplanes", "recycling",
            "the brain", "deserts", "chocolate", "robots", "the printing press", "rivers", "owls", "sleep", "soap",
            "cheese", "lightning", "windmills", "ants", "the stock market", "tea", "castles", "magnets", "snow",
            "bridges", "vitamins", "the piano", "coral reefs", "time zones", "camels", "paper", "wolves", "autumn"]
# Held out: never seen in training (with scripts/bench_spec.py's chat prompts).
HELD_OUT_SUBJECTS = ["dinosaurs", "the sun", "mushrooms", "submarines", "bees' wax", "tornadoes", "octopuses",
                     "lighthouses", "kites", "comets"]
TEMPLATES = ["Explain how {} works in simple terms.", "Write a short poem about {}.",
             "Tell me three interesting facts about {}.", "Write a short story about {}.",
             "What are the benefits of learning about {}?", "Describe {} to a child.",
             "Give me a short summary of the history of {}.", "Why is {} important?"]
HIDDEN_EPS = 1e-5


def prompts_of(subjects):
    return [t.format(s) for s in subjects for t in TEMPLATES]


def generate(model, prompts, max_tokens):
    """Chat-templated prompts and the target's greedy answers, as token id lists (prompt + answer)."""
    import jpaged

    llm = jpaged.LLM(model, max_num_seqs=64, max_model_len=512, max_num_batched_tokens=2048, enforce_eager=True)
    tok = llm.get_tokenizer()
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in prompts]
    outs = llm.generate(texts, jpaged.SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]


def target_features(model, seqs, layers, batch=8):
    """Per sequence: the hidden states entering `layers` [len, 3 * hidden] (float16) and the
    target's argmax at each token [len]."""
    import torch
    import transformers

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    target = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    feats, argmax = [], []
    for start in range(0, len(seqs), batch):
        part = seqs[start:start + batch]
        width = max(map(len, part))
        ids = torch.tensor([s + [0] * (width - len(s)) for s in part])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in part])
        with torch.no_grad():
            out = target(ids, attention_mask=mask, output_hidden_states=True)
        for i, s in enumerate(part):
            feats.append(torch.cat([out.hidden_states[j][i, :len(s)] for j in layers], -1).numpy().astype(np.float16))
            argmax.append(out.logits[i, :len(s)].argmax(-1).numpy().astype(np.int32))
    return feats, argmax, target


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=os.path.expanduser("~/.cache/jpaged/smollm2-135m-instruct"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--minutes", type=float, default=20.0, help="training time (data preparation apart)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=160, help="training prompts (of the templates x subjects)")
    parser.add_argument("--draft-vocab", type=int, default=2048)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--data", default=None, help="cache of the prepared data (npz; default: OUT/data.npz)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.model, "config.json")) as f:
        tcfg = json.load(f)
    num_layers, hidden = tcfg["num_hidden_layers"], tcfg["hidden_size"]
    layers = (2, num_layers // 2, num_layers - 3)
    data_path = args.data or os.path.join(args.out, "data.npz")
    t0 = time.time()
    if os.path.exists(data_path):
        data = np.load(data_path, allow_pickle=True)
        seqs, feats, argmax = list(data["seqs"]), list(data["feats"]), list(data["argmax"])
        embed, final_norm = data["embed"], data["final_norm"]
    else:
        prompts = prompts_of(SUBJECTS)
        prompts = [prompts[i] for i in np.random.default_rng(0).permutation(len(prompts))[:args.num_prompts]]
        seqs = generate(args.model, prompts, args.max_tokens)
        print(f"generated {len(seqs)} answers, {sum(map(len, seqs))} tokens in {time.time() - t0:.0f} s", flush=True)
        feats, argmax, target = target_features(args.model, seqs, layers)
        embed = target.model.embed_tokens.weight.detach().numpy()
        final_norm = target.model.norm.weight.detach().numpy()
        np.savez(data_path, seqs=np.array(seqs, dtype=object), feats=np.array(feats, dtype=object),
                 argmax=np.array(argmax, dtype=object), embed=embed, final_norm=final_norm)
        print(f"features ready after {time.time() - t0:.0f} s", flush=True)
    from scripts.eagle3_train_lib import train_head, write_head

    params, draft_ids = train_head(tcfg, seqs, feats, argmax, embed, final_norm, args)
    write_head(args.out, tcfg, params, draft_ids, layers)
    print(f"wrote {args.out} after {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
