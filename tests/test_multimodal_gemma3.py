"""Gemma 3 (multimodal) through the engine against transformers' generate (torch, fp32) on a tiny
random checkpoint written with save_pretrained, with its Gemma3Processor: prompts with 1, 2 and 3
images beside a text prompt, 16-token chunks, a sliding-window layer: greedy tokens equal HF's and
logprobs within 1e-4, with prefix caching on and off (and the two equal).

HF's reference takes the processor's token_type_ids, as its generate does by default: an image's
tokens attend to each other both ways (jpaged: per-token key limits, multimodal/mm_prefix.py; the
scheduler keeps each image in one chunk). Without them in jpaged (a causal mask) the logprobs
differ from HF's by far more than 1e-4. A second round reuses the first round's images behind the
same prefix, laid out so that the prefix cache's hit stops inside an image."""

import os

import numpy as np
import pytest
import torch
import transformers as tf

import jpaged
from jpaged import SamplingParams
from tests.vision_checkpoints import random_images, save_gemma3_servable

PROMPTS = ["Look: <start_of_image> what is it?", "plain text, no image at all.",
           "<start_of_image><start_of_image> compare", "a <start_of_image> b <start_of_image> c <start_of_image>"]
NUM_IMAGES = [1, 0, 2, 3]
STEPS = 8
BLOCK = 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    seed = int(os.environ.get("JPAGED_TEST_SEED") or 20261125) + 21
    print(f"gemma3 checkpoint seed {seed}")
    path = str(tmp_path_factory.mktemp("gemma3"))
    hf = save_gemma3_servable(path, seed)
    llms = {caching: jpaged.LLM(path, dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16,
                                block_size=BLOCK, enable_prefix_caching=caching, enforce_eager=True)
            for caching in (True, False)}
    return hf, tf.AutoProcessor.from_pretrained(path), llms, seed, path


def hf_generate(hf, inputs):
    """HF's greedy tokens and their logprobs; `inputs` with token_type_ids: an image's tokens
    attend to each other both ways during the prefill (HF's default)."""
    assert "token_type_ids" in inputs
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs = [torch.log_softmax(step[0].double(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def check(out, reference, label):
    tokens, logprobs = reference
    got = out.outputs[0]
    assert got.token_ids == tokens, label
    mine = [lp[t] for lp, t in zip(got.logprobs, got.token_ids)]
    print(f"{label}: max |logprob - HF's| {np.abs(np.subtract(mine, logprobs)).max():.2e}")
    np.testing.assert_allclose(mine, logprobs, atol=1e-4, err_msg=label)
    return mine


SP = SamplingParams(max_tokens=STEPS, temperature=0, logprobs=0, ignore_eos=True)


def test_images_in_a_batch_match_transformers(setup):
    hf, processor, llms, seed, _ = setup
    rng = np.random.default_rng(seed)
    images = [random_images(rng, [(int(rng.integers(30, 120)), int(rng.integers(30, 120)))] * n) for n in NUM_IMAGES]
    prompts = [{"prompt": p, "multi_modal_data": {"image": im}} if im else p for p, im in zip(PROMPTS, images)]
    refs = []
    for prompt, ims in zip(PROMPTS, images):
        inputs = processor(text=prompt, images=ims or None, return_tensors="pt")
        refs.append((inputs["input_ids"][0].tolist(), hf_generate(hf, inputs)))
    results = {}
    for caching, llm in llms.items():
        outs = llm.generate(prompts, SP, use_tqdm=False)
        for prompt, ims, out, (prompt_ids, ref) in zip(PROMPTS, images, outs, refs):
            assert out.prompt_token_ids == prompt_ids
            assert out.prompt_token_ids.count(hf.config.image_token_index) == 4 * len(ims)
            results.setdefault(prompt, []).append(check(out, ref, f"{prompt!r} prefix caching {caching}"))
    for prompt, (on, off) in results.items():
        np.testing.assert_allclose(on, off, atol=2e-5, err_msg=prompt)


def token_prompt(rng, lead: int, image_ids: list[int], tail: int):
    """Token ids: `lead` text tokens, then per image <boi>, its placeholders, <eoi> and 3 text
    tokens, then `tail` more."""
    text = lambda n: rng.integers(3, 250, n).tolist()  # noqa: E731 (byte tokens)
    ids = text(lead)
    for boi, placeholders, eoi in image_ids:
        ids += [boi] + placeholders + [eoi] + text(3)
    return ids + text(tail)


def test_prefix_hit_inside_an_image_matches_transformers(setup):
    """Round 1 computes prompts with 1 and 2 images; round 2 sends the same leading tokens and
    images with other tails, the first image's 4 tokens across a block boundary (positions
    14..17): the prefix cache hits block 0 (two of the image's tokens) and the next chunk
    computes the image's other two seeing the cached ones. Both rounds equal HF's generate, and
    the caching engine's outputs equal the other's."""
    hf, processor, llms, seed, _ = setup
    rng = np.random.default_rng(seed + 1)
    cfg = hf.config
    image = (cfg.boi_token_index, [cfg.image_token_index] * 4, cfg.eoi_token_index)
    lead = BLOCK - 3  # <boi> at 13, the image at 14..17: block 0 ends inside it
    pictures = random_images(rng, [(60, 90), (100, 50)])
    pixels = processor.image_processor(images=pictures, return_tensors="pt")["pixel_values"]
    leads = [token_prompt(rng, lead, [], 0) for _ in range(2)]
    rounds = []
    for _ in range(2):  # the same leads and images, other tails
        rounds.append([(leads[0] + token_prompt(rng, 0, [image], 5), pictures[:1]),
                       (leads[1] + token_prompt(rng, 0, [image] * 2, 2), pictures[:2])])
    results = {}
    for caching, llm in llms.items():
        llm.reset_prefix_cache()
        for r, prompts in enumerate(rounds):
            outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": ims}} for ids, ims in prompts],
                                SP, use_tqdm=False)
            for i, ((ids, ims), out) in enumerate(zip(prompts, outs)):
                inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                          "pixel_values": pixels[:len(ims)],
                          "token_type_ids": (torch.tensor([ids]) == cfg.image_token_index).long()}
                results.setdefault((r, i), []).append(check(out, hf_generate(hf, inputs), f"round {r} prompt {i}"))
                if caching and r == 1:  # the hit: block 0, two of the first image's four tokens
                    assert out.num_cached_tokens == BLOCK and lead + 1 < BLOCK < lead + 5, out.num_cached_tokens
    for key, (on, off) in results.items():
        np.testing.assert_allclose(on, off, atol=2e-5, err_msg=str(key))


def test_triton_kernels_match_transformers(setup):
    """The same through the Pallas Triton kernels (interpret mode on a CPU): 2 images and a text
    prompt, the images across chunk boundaries of 16 tokens."""
    hf, processor, _, seed, path = setup
    rng = np.random.default_rng(seed + 2)
    llm = jpaged.LLM(path, dtype="float32", max_model_len=128, max_num_seqs=2, max_num_batched_tokens=16,
                     block_size=BLOCK, enforce_eager=True, attention_backend="pallas")
    pictures = random_images(rng, [(50, 70), (80, 40)])
    prompts = [("x <start_of_image> y <start_of_image> z", pictures), ("only words here", [])]
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": ims}} if ims else p for p, ims in prompts], SP,
                        use_tqdm=False)
    for (prompt, ims), out in zip(prompts, outs):
        check(out, hf_generate(hf, processor(text=prompt, images=ims or None, return_tensors="pt")), f"pallas {prompt!r}")


def test_an_image_larger_than_a_step_is_refused(setup, monkeypatch):
    """Gemma 3's images are computed in one step each: an image of more tokens than
    max_num_batched_tokens is a ValueError naming it, and the engine serves on."""
    hf, _, llms, seed, _ = setup
    llm = llms[True]
    monkeypatch.setattr(llm.llm_engine.scheduler, "max_num_batched_tokens", 3)
    picture = random_images(np.random.default_rng(seed), [(40, 40)])
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        llm.generate({"prompt": "see <start_of_image>", "multi_modal_data": {"image": picture}}, SP, use_tqdm=False)
    monkeypatch.undo()
    out = llm.generate({"prompt": "see <start_of_image>", "multi_modal_data": {"image": picture}}, SP, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == STEPS
