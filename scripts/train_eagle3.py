"""Train an EAGLE-3 head for a target by self-distillation (as SpecForge does), on the CPU, and
write it in the public layout (jpaged/spec_decode/eagle_head.py) for speculative_config
{"method": "eagle3", "model": OUT}.

  1. chat prompts ((templates + extra templates) x subjects; the held-out subjects and
     scripts/bench_spec.py's chat prompts never trained on), chat-templated;
  2. the target's own greedy answers (jpaged, batched), and
  3. its hidden states entering layers (2, L/2, L-3), recorded by the generating steps themselves
     (the runner's EAGLE-3 hook; no LM head needed: in the answers, the target's argmax is the next
     token; prompt tokens take no loss, as SpecForge's loss mask);
  4. the head, trained with optax (AdamW, cosine) on the target's argmax tokens, unrolled over
     `--ttt-steps` draft steps (EAGLE-3's training-time test: step j's hidden input is step
     j - 1's output, and its query attends the true entries before the anchor and the anchor's
     own chain, as the drafting chain does), for what `--budget-minutes` leaves after the data
     (or `--minutes`);
  5. acceptance on the held-out prompts: see scripts/eagle3_acceptance.py.

The draft vocabulary: the `--draft-vocab` most frequent target tokens of the training answers.
The head starts from the target where it can: lm_head from the target's embedding rows (tied
SmolLM2), norm from its final norm, fc selecting the high layer's features.

  python scripts/train_eagle3.py --out /tmp/eagle3-smollm2 [--budget-minutes 29] [--model DIR]
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from jpaged.spec_decode.proposer import Proposer  # noqa: E402

SUBJECTS = ["the ocean", "volcanoes", "honey bees", "the moon", "bicycles", "coffee", "chess", "rain forests",
            "the human heart", "electricity", "pyramids", "penguins", "bread", "music", "trains", "glaciers",
            "the internet", "gardening", "whales", "photosynthesis", "earthquakes", "libraries", "the Roman Empire",
            "clouds", "vaccines", "solar panels", "elephants", "friendship", "mountains", "airplanes", "recycling",
            "the brain", "deserts", "chocolate", "robots", "the printing press", "rivers", "owls", "sleep", "soap",
            "cheese", "lightning", "windmills", "ants", "the stock market", "tea", "castles", "magnets", "snow",
            "bridges", "vitamins", "the piano", "coral reefs", "time zones", "camels", "paper", "wolves", "autumn",
            "butterflies", "the Great Wall of China", "rockets", "saving money", "dogs", "cats", "rice", "football",
            "the violin", "bamboo", "frogs", "the Olympic Games", "satellites", "potatoes", "hurricanes",
            "the alphabet", "wind turbines", "sharks", "cooking pasta", "the Amazon river", "batteries", "telescopes",
            "gravity", "maps", "horses", "cameras", "spiders", "olive oil", "the moon landing", "ice cream",
            "compasses", "volcanic islands", "fireflies", "the water cycle", "clocks", "salt", "kangaroos",
            "hot air balloons", "bats", "yoga", "the Vikings", "strawberries", "traffic lights", "tigers", "wool",
            "the periodic table", "canals", "parrots", "umbrellas", "ancient Egypt"]
# Held out: never seen in training (with scripts/bench_spec.py's chat prompts).
HELD_OUT_SUBJECTS = ["dinosaurs", "the sun", "mushrooms", "submarines", "bees' wax", "tornadoes", "octopuses",
                     "lighthouses", "kites", "comets"]
TEMPLATES = ["Explain how {} works in simple terms.", "Write a short poem about {}.",
             "Tell me three interesting facts about {}.", "Write a short story about {}.",
             "What are the benefits of learning about {}?", "Describe {} to a child.",
             "Give me a short summary of the history of {}.", "Why is {} important?"]
# Training only (the held-out prompts of scripts/eagle3_acceptance.py use TEMPLATES).
EXTRA_TEMPLATES = ["What is {}?", "Write a haiku about {}.", "List five facts about {}.",
                   "How would you explain {} to a ten-year-old?", "Write a short blog post about {}.",
                   "What are some common misconceptions about {}?", "Write a limerick about {}.",
                   "Compare {} with something from everyday life.",
                   "Give me a fun quiz question about {} and its answer.",
                   "Write a short dialogue between two friends talking about {}.",
                   "What would the world be like without {}?",
                   "Summarize what scientists know about {} in a paragraph."]

def prompts_of(subjects, templates=TEMPLATES):
    return [t.format(s) for s in subjects for t in templates]


def generate(model, prompts, max_tokens, layers):
    """Chat-templated prompts, the target's greedy answers and its hidden states entering `layers`
    at every token, from the generating steps themselves (a FeatureRecorder in the proposer's
    place: no second forward): (token id lists (prompt + answer), the prompts' lengths, features
    [len, 3 * hidden] float16 per sequence; the last token, never fed, has zeros)."""
    import jpaged

    llm = jpaged.LLM(model, max_num_seqs=256, max_model_len=512, max_num_batched_tokens=2048, enforce_eager=True)
    recorder = FeatureRecorder.install(llm.llm_engine.runner, layers)
    tok = llm.get_tokenizer()
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in prompts]
    outs = llm.generate(texts, jpaged.SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    return seqs, [len(o.prompt_token_ids) for o in outs], recorder.features(seqs)


class FeatureRecorder(Proposer):
    """A proposer that drafts nothing and keeps every step's hidden states entering `layers`, by
    sequence and position (the runner's EAGLE-3 hook: Proposer.after_step)."""

    needs_hidden_states = True

    def __init__(self, runner, layers):
        self.runner, self.aux_hidden_layers = runner, tuple(layers)
        self.parts = {}  # seq_id -> [(positions, input ids, hidden states)], one per step

    @classmethod
    def install(cls, runner, layers):
        """Put a recorder in `runner`'s proposer seat (an engine without speculation; enforce_eager:
        the forwards with hidden states compile as they come)."""
        recorder = cls(runner, layers)
        runner.proposer, runner.return_hidden, runner.hidden_layers = recorder, True, recorder.aux_hidden_layers
        return recorder

    def after_step(self, num_tokens, inputs, hidden, sampled, block_table):
        step = self.runner.last_prepared
        aux, ids = (np.asarray(x) for x in hidden)
        qsl, pos = step.inputs.attn.query_start_loc, step.inputs.positions
        for j, row in enumerate(step.rows):
            a, b = qsl[j], qsl[j + 1]
            self.parts.setdefault(self.runner.input_batch.seq_ids[row], []).append(
                (pos[a:b].copy(), ids[a:b].copy(), aux[a:b].astype(np.float16)))

    def features(self, seqs):
        """Per sequence of `seqs` (in the order they were added: their sequence ids ascending)."""
        out = []
        for seq, seq_id in zip(seqs, sorted(self.parts)):
            feats, seen = np.zeros((len(seq), self.parts[seq_id][0][2].shape[1]), np.float16), np.zeros(len(seq), bool)
            for pos, ids, aux in self.parts[seq_id]:
                if not (np.asarray(seq)[pos] == ids).all():
                    raise RuntimeError(f"sequence {seq_id}: the recorded steps' tokens are not its own")
                feats[pos], seen[pos] = aux, True
            if not seen[:-1].all():
                raise RuntimeError(f"sequence {seq_id}: no hidden states at {np.flatnonzero(~seen[:-1])[:8]}")
            out.append(feats)
        return out


def next_token_labels(seqs, prompt_lens):
    """The target's argmax at each token, where it is known without its LM head: in the answer,
    the next token (the target's own greedy choice); -1 elsewhere (in the prompt, at the end)."""
    labels = []
    for s, n in zip(seqs, prompt_lens):
        a = np.full(len(s), -1, np.int32)
        a[n - 1:len(s) - 1] = s[n:]
        labels.append(a)
    return labels


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=os.path.expanduser("~/.cache/jpaged/smollm2-135m-instruct"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget-minutes", type=float, default=29.0,
                        help="data preparation + training: training takes what data preparation leaves")
    parser.add_argument("--minutes", type=float, default=None, help="training time (default: from --budget-minutes)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=640,
                        help="training prompts (of the (templates + extra templates) x subjects)")
    parser.add_argument("--draft-vocab", type=int, default=2048)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--data", default=None, help="cache of the prepared data (npz; default: OUT/data.npz)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.model, "config.json")) as f:
        tcfg = json.load(f)
    num_layers = tcfg["num_hidden_layers"]
    layers = (2, num_layers // 2, num_layers - 3)
    data_path = args.data or os.path.join(args.out, "data.npz")
    t0 = time.time()
    if os.path.exists(data_path):
        data = np.load(data_path, allow_pickle=True)
        seqs, feats, argmax = list(data["seqs"]), list(data["feats"]), list(data["argmax"])
        embed, final_norm = data["embed"], data["final_norm"]
        print(f"read {data_path}: {len(seqs)} sequences, {sum(map(len, seqs))} tokens", flush=True)
    else:
        import safetensors.numpy

        prompts = prompts_of(SUBJECTS, TEMPLATES + EXTRA_TEMPLATES)
        prompts = [prompts[i] for i in np.random.default_rng(0).permutation(len(prompts))[:args.num_prompts]]
        seqs, prompt_lens, feats = generate(args.model, prompts, args.max_tokens, layers)
        print(f"phase generate (with the hidden states): {len(seqs)} answers, "
              f"{sum(map(len, seqs)) - sum(prompt_lens)} answer tokens ({sum(prompt_lens)} prompt tokens) "
              f"in {time.time() - t0:.0f} s", flush=True)
        argmax = next_token_labels(seqs, prompt_lens)
        weights = {}
        for name in sorted(os.listdir(args.model)):
            if name.endswith(".safetensors"):
                weights.update(safetensors.numpy.load_file(os.path.join(args.model, name)))
        embed, final_norm = weights["model.embed_tokens.weight"], weights["model.norm.weight"]
        np.savez(data_path, seqs=np.array(seqs, dtype=object), feats=np.array(feats, dtype=object),
                 argmax=np.array(argmax, dtype=object), embed=embed, final_norm=final_norm)
        print(f"data ready after {time.time() - t0:.0f} s", flush=True)
    if args.minutes is None:
        args.minutes = max(1.0, args.budget_minutes - (time.time() - t0) / 60 - 0.5)
    t1 = time.time()
    from scripts.eagle3_train_lib import train_head, write_head

    params, draft_ids = train_head(tcfg, seqs, feats, argmax, embed, final_norm, args)
    print(f"phase train: {time.time() - t1:.0f} s", flush=True)
    write_head(args.out, tcfg, params, draft_ids, layers)
    print(f"wrote {args.out} after {time.time() - t0:.0f} s in all", flush=True)


if __name__ == "__main__":
    main()
