"""Gemma 3 (multimodal) through the engine against transformers' generate (torch, fp32) on a tiny
random checkpoint written with save_pretrained, with its Gemma3Processor: prompts with 1, 2 and 3
images beside a text prompt, 16-token chunks, a sliding-window layer, prefix caching on: greedy
tokens equal HF's and logprobs within 1e-4.

HF's reference runs without token_type_ids, i.e. causal attention over the image tokens: jpaged's
kernels do not yet have HF's bidirectional attention within an image (jpaged/models/gemma3_mm.py)."""

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


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    seed = int(os.environ.get("JPAGED_TEST_SEED") or 20261125) + 21
    print(f"gemma3 checkpoint seed {seed}")
    path = str(tmp_path_factory.mktemp("gemma3"))
    hf = save_gemma3_servable(path, seed)
    llm = jpaged.LLM(path, dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16,
                     block_size=16, enable_prefix_caching=True, enforce_eager=True)
    return hf, tf.AutoProcessor.from_pretrained(path), llm, np.random.default_rng(seed)


def hf_generate(hf, processor, prompt, images):
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    inputs.pop("token_type_ids")  # causal (see the module docstring)
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs = [torch.log_softmax(step[0].double(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs, inputs["input_ids"][0].tolist()


def test_images_in_a_batch_match_transformers(setup):
    hf, processor, llm, rng = setup
    images = [random_images(rng, [(int(rng.integers(30, 120)), int(rng.integers(30, 120)))] * n) for n in NUM_IMAGES]
    prompts = [{"prompt": p, "multi_modal_data": {"image": im}} if im else p for p, im in zip(PROMPTS, images)]
    sp = SamplingParams(max_tokens=STEPS, temperature=0, logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    for prompt, ims, out in zip(PROMPTS, images, outs):
        tokens, logprobs, prompt_ids = hf_generate(hf, processor, prompt, ims)
        assert out.prompt_token_ids == prompt_ids
        assert out.prompt_token_ids.count(hf.config.image_token_index) == 4 * len(ims)
        got = out.outputs[0]
        assert got.token_ids == tokens, prompt
        np.testing.assert_allclose([lp[t] for lp, t in zip(got.logprobs, got.token_ids)], logprobs, atol=1e-4)
