"""Vision-language benchmark (issue 65): the image encoder's images/s and end-to-end requests/s
with one image per request, jpaged against Hugging Face transformers on the same checkpoint.

The checkpoint is a randomly initialised LLaVA-1.5 (CLIP vision tower + projector + Llama text
model) written by transformers' save_pretrained with its LlavaProcessor (the byte-level tiny
tokenizer plus <image>), in a temp dir or --save-dir; or --model, a LLaVA checkpoint directory.

  encoder   jpaged: the engine's precompiled encode executables (vision tower + projector, the
            embeddings written into the device encoder cache), one image a call and in the
            engine's batches (LLaVA: up to 4 same-size images a call), timed over --num-images
            distinct images after one warm call. hf: get_image_features, batch 1
            (what one request costs) and batch --hf-batch.
  requests  --num-prompts requests, each "USER: <image>\\n... ASSISTANT:" with its own image and
            --output-len greedy tokens (EOS ignored): jpaged LLM.generate (all submitted at once,
            continuous batching, chunked prefill) against HF generate one request at a time and
            padded in batches of --hf-batch. Images are processed (resized, normalised) inside
            the timed region for both.

Sizes: --size tiny (vision 32 wide, 2 layers, 56 px -> 16 tokens; text 64 wide, 2 layers) or
small (vision 256 wide, 4 layers, 224 px -> 256 tokens; text 256 wide, 4 layers).

  JAX_PLATFORMS=cpu python scripts/bench_mm.py --size small --num-prompts 16 --output-len 16
"""

import argparse
import copy
import json
import os
import sys
import tempfile
import time

import numpy as np

SIZES = {
    "tiny": dict(vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             image_size=56, patch_size=14),
                 text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2)),
    "small": dict(vision=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                              image_size=224, patch_size=14),
                  text=dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=4)),
}


def save_random_llava(path: str, size: str, seed: int = 0) -> str:
    import torch
    import transformers as tf

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from jpaged.models import tiny

    torch.manual_seed(seed)
    tok = copy.deepcopy(tiny.tiny_tokenizer())  # (lru_cached: the shared one stays as it is)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    spec = SIZES[size]
    vision = tf.CLIPVisionConfig(projection_dim=spec["vision"]["hidden_size"], **spec["vision"])
    text = tf.LlamaConfig(vocab_size=len(tok), max_position_embeddings=2048, tie_word_embeddings=False,
                          eos_token_id=257, bos_token_id=256, **spec["text"])
    image_tokens = (spec["vision"]["image_size"] // spec["vision"]["patch_size"]) ** 2
    config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
                            vision_feature_layer=-2, vision_feature_select_strategy="default",
                            projector_hidden_act="gelu", image_seq_length=image_tokens)
    tf.LlavaForConditionalGeneration(config).save_pretrained(path)
    side = spec["vision"]["image_size"]
    images = tf.CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    tf.LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=spec["vision"]["patch_size"],
                      vision_feature_select_strategy="default", num_additional_image_tokens=1).save_pretrained(path)
    return path


def random_images(n: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (int(rng.integers(200, 400)), int(rng.integers(200, 400)), 3),
                                         dtype=np.uint8)) for _ in range(n)]


def bench_jpaged(args, model_dir: str, images, prompts) -> dict:
    import jax

    import jpaged
    from jpaged import SamplingParams

    start = time.perf_counter()
    llm = jpaged.LLM(model_dir, dtype="float32", max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=True)
    startup = time.perf_counter() - start
    mm = llm.llm_engine.runner.mm
    runner = mm.runner
    items = [mm.process(prompts[0], [image]).items[0] for image in images[:args.num_images]]
    slots = mm.cache.num_rows // items[0].rows
    pairs = [(item, (i % slots) * item.rows) for i, item in enumerate(items)]
    mm._encode(pairs[:1])  # warm
    jax.block_until_ready(runner.state)
    start = time.perf_counter()
    for pair in pairs:  # one image a call: what a step with one new image costs
        mm._encode([pair])
    jax.block_until_ready(runner.state)
    encoder_s = time.perf_counter() - start
    start = time.perf_counter()
    mm._encode(pairs)  # the engine's batches (mm.batch_sizes) when a step brings several images
    jax.block_until_ready(runner.state)
    batched_s = time.perf_counter() - start
    mm.reset()
    sp = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    # Warm the step shapes (enforce_eager compiles what it runs) on other images, then time.
    llm.generate([{"prompt": p, "multi_modal_data": {"image": im}} for p, im in
                  zip(prompts, random_images(len(prompts), args.seed + 1))], sp, use_tqdm=False)
    llm.reset_prefix_cache()
    mm.reset()
    start = time.perf_counter()
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": im}} for p, im in zip(prompts, images)], sp,
                        use_tqdm=False)  # (zip: the first len(prompts) images)
    e2e = time.perf_counter() - start
    return {"startup_s": startup, "encoder_images_per_s": len(items) / encoder_s,
            f"encoder_images_per_s_batch{mm.batch_sizes[-1]}": len(items) / batched_s,
            "requests_per_s": len(prompts) / e2e, "output_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / e2e,
            "tokens": [o.outputs[0].token_ids for o in outs]}


def bench_hf(args, model_dir: str, images, prompts) -> dict:
    import torch
    import transformers as tf

    if args.hf_threads:
        torch.set_num_threads(args.hf_threads)
    model = tf.LlavaForConditionalGeneration.from_pretrained(model_dir).eval()
    processor = tf.AutoProcessor.from_pretrained(model_dir)
    processor.tokenizer.padding_side = "left"
    result = {}
    with torch.no_grad():
        pixel = [processor.image_processor(images=[im], return_tensors="pt")["pixel_values"]
                 for im in images[:args.num_images]]
        model.get_image_features(pixel_values=pixel[0])  # warm
        start = time.perf_counter()
        for p in pixel:
            model.get_image_features(pixel_values=p)
        result["encoder_images_per_s_batch1"] = len(pixel) / (time.perf_counter() - start)
        batched = torch.cat(pixel)
        start = time.perf_counter()
        for i in range(0, len(pixel), args.hf_batch):
            model.get_image_features(pixel_values=batched[i:i + args.hf_batch])
        result[f"encoder_images_per_s_batch{args.hf_batch}"] = len(pixel) / (time.perf_counter() - start)
        gen = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False)
        start = time.perf_counter()
        tokens = []
        for prompt, im in zip(prompts, images):  # (the first len(prompts) images)
            x = processor(text=prompt, images=[im], return_tensors="pt")
            tokens.append(model.generate(**x, **gen)[0, x["input_ids"].shape[1]:].tolist())
        result["requests_per_s_batch1"] = len(prompts) / (time.perf_counter() - start)
        result["tokens"] = tokens
        start = time.perf_counter()
        for i in range(0, len(prompts), args.hf_batch):
            x = processor(text=prompts[i:i + args.hf_batch], images=images[i:i + args.hf_batch], return_tensors="pt",
                          padding=True)
            model.generate(**x, **gen)
        result[f"requests_per_s_batch{args.hf_batch}"] = len(prompts) / (time.perf_counter() - start)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a LLaVA checkpoint directory (default: a random one of --size)")
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--save-dir", help="where the random checkpoint goes (default: a temp dir)")
    parser.add_argument("--num-images", type=int, default=32, help="images the encoder benchmark encodes")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument("--hf-threads", type=int, default=0,
                        help="torch's CPU threads (0: its default; 1 is much faster on a loaded 2-core machine)")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--backend", choices=("jpaged", "hf", "both"), default="both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json")
    args = parser.parse_args(argv)
    model_dir = args.model or save_random_llava(args.save_dir or tempfile.mkdtemp(prefix="bench_mm_"), args.size,
                                                args.seed)
    images = random_images(max(args.num_images, args.num_prompts), args.seed)
    prompts = [f"USER: <image>\nDescribe picture {i} in a few words. ASSISTANT:" for i in range(args.num_prompts)]
    report = {"model": model_dir, "size": None if args.model else args.size, "num_prompts": args.num_prompts,
              "output_len": args.output_len}
    if args.backend in ("jpaged", "both"):
        report["jpaged"] = bench_jpaged(args, model_dir, images, prompts)
    if args.backend in ("hf", "both"):
        report["hf"] = bench_hf(args, model_dir, images, prompts)
    tokens = {backend: report[backend].pop("tokens") for backend in ("jpaged", "hf") if backend in report}
    if len(tokens) == 2:  # greedy on the same fp32 checkpoint: the same tokens
        report["same_tokens"] = sum(a == b for a, b in zip(tokens["jpaged"], tokens["hf"]))
        print(f"same greedy tokens: {report['same_tokens']} of {args.num_prompts} requests")
    for backend in ("jpaged", "hf"):
        if backend in report:
            print(backend, json.dumps({k: round(v, 3) for k, v in report[backend].items()}))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
