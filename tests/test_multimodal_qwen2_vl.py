"""Qwen2-VL and Qwen2.5-VL through the engine against transformers' generate (torch, fp32) on
tiny random checkpoints written with save_pretrained (tests/vision_checkpoints.py): prompts with
1, 2 and 3 images of different sizes (different grids, different vision buckets) in one batch
with a text-only prompt, prefilled 24 tokens a step (chunks cut inside images), prefix caching
on: greedy tokens equal HF's and logprobs within 1e-4. M-RoPE positions run through the whole
generation (the decode tokens' delta)."""

import os

import numpy as np
import pytest
import torch

import jpaged
from jpaged import SamplingParams
from jpaged.models.qwen2_vl_processor import Qwen2VLPromptProcessor
from tests.vision_checkpoints import random_images, save_qwen_servable

FAMILIES = ("qwen2_vl", "qwen2_5_vl")
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPTS = [f"<|im_start|>user\n{IMAGE}What is this?<|im_end|>\n<|im_start|>assistant\n",
           "<|im_start|>user\nplain text, no image.<|im_end|>\n<|im_start|>assistant\n",
           f"<|im_start|>user\n{IMAGE}{IMAGE}Compare.<|im_end|>\n<|im_start|>assistant\n",
           f"<|im_start|>user\n{IMAGE} and {IMAGE} then {IMAGE}<|im_end|>\n<|im_start|>assistant\n"]
SIZES = [[(100, 60)], [], [(57, 200), (150, 150)], [(60, 60), (120, 90), (30, 200)]]
STEPS = 8


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, tmp_path_factory):
    seed = int(os.environ.get("JPAGED_TEST_SEED") or 20261125) + 11 + FAMILIES.index(request.param)
    print(f"{request.param} checkpoint seed {seed}")
    path = str(tmp_path_factory.mktemp(request.param))
    hf = save_qwen_servable(path, request.param, seed)
    llm = jpaged.LLM(path, dtype="float32", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=24,
                     block_size=16, enable_prefix_caching=True, enforce_eager=True)
    return hf, Qwen2VLPromptProcessor.from_pretrained(path), llm, np.random.default_rng(seed), path


def hf_generate(hf, processor, prompt: str, images):
    inputs = {k: torch.tensor(v) for k, v in processor(text=prompt, images=images).items()}
    with torch.no_grad():
        out = hf.generate(**inputs, attention_mask=torch.ones_like(inputs["input_ids"]), max_new_tokens=STEPS,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs = [torch.log_softmax(step[0].double(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs, inputs["input_ids"][0].tolist()


def test_images_in_a_batch_match_transformers(setup):
    hf, processor, llm, rng, _ = setup
    images = [random_images(rng, sizes) for sizes in SIZES]
    prompts = [{"prompt": p, "multi_modal_data": {"image": im}} if im else p for p, im in zip(PROMPTS, images)]
    sp = SamplingParams(max_tokens=STEPS, temperature=0, logprobs=0, ignore_eos=True)
    for _ in range(2):  # the second time from the prefix cache (the same images)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        for prompt, ims, out in zip(PROMPTS, images, outs):
            tokens, logprobs, prompt_ids = hf_generate(hf, processor, prompt, ims)
            assert out.prompt_token_ids == prompt_ids
            got = out.outputs[0]
            assert got.token_ids == tokens, prompt
            mine = [lp[t] for lp, t in zip(got.logprobs, got.token_ids)]
            np.testing.assert_allclose(mine, logprobs, atol=1e-4)


def test_chat_with_images_matches_transformers(setup):
    """LLM.chat with image parts (a PIL image and a data: URL) through the checkpoint's chat template."""
    import base64
    import io

    hf, processor, llm, rng, _ = setup
    a, b = random_images(rng, [(70, 90), (140, 60)])
    png = io.BytesIO()
    b.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": a}, {"type": "text", "text": "and"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    out = llm.chat(messages, SamplingParams(max_tokens=STEPS, temperature=0, logprobs=0, ignore_eos=True),
                   use_tqdm=False)[0]
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                                                        {"type": "image"}]}],
                                         tokenize=False, add_generation_prompt=True)
    tokens, logprobs, prompt_ids = hf_generate(hf, processor, text, [a, b])
    assert out.prompt_token_ids == prompt_ids
    assert out.outputs[0].token_ids == tokens
    np.testing.assert_allclose([lp[t] for lp, t in zip(out.outputs[0].logprobs, tokens)], logprobs, atol=1e-4)


def test_tensor_parallel(setup):
    """tensor_parallel_size=2 (the decoder split over 2 devices, the tower replicated): the same."""
    hf, processor, _, rng, path = setup
    if hf.config.model_type != "qwen2_5_vl":
        pytest.skip("one family is enough (the vision tower is replicated either way)")
    llm = jpaged.LLM(path, dtype="float32", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=24,
                     block_size=16, tensor_parallel_size=2, enforce_eager=True)
    _text_and_three_images_equal_hf(llm, hf, processor, rng)


def _text_and_three_images_equal_hf(llm, hf, processor, rng):
    """A text-only prompt and one with 3 images: greedy tokens equal HF's, logprobs within 1e-4."""
    texts, images = PROMPTS[1:4:2], [[], random_images(rng, SIZES[3])]  # text only, and 3 images
    prompts = [{"prompt": p, "multi_modal_data": {"image": im}} if im else p for p, im in zip(texts, images)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=STEPS, temperature=0, logprobs=0, ignore_eos=True),
                        use_tqdm=False)
    for prompt, ims, out in zip(texts, images, outs):
        tokens, logprobs, _ = hf_generate(hf, processor, prompt, ims)
        assert out.outputs[0].token_ids == tokens, prompt
        np.testing.assert_allclose([lp[t] for lp, t in zip(out.outputs[0].logprobs, tokens)], logprobs, atol=1e-4)


@pytest.mark.parametrize("options", [
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                            "prompt_lookup_min": 1}},
    {"num_scheduler_steps": 4}], ids=["ngram", "multi_step"])
def test_ngram_speculation_and_multi_step(setup, options):
    """n-gram drafts and multi-step decodes with M-RoPE: both add to positions past the prompt
    (position + delta in all three; a multi-step decode's + j on the device)."""
    hf, processor, _, rng, path = setup
    if hf.config.model_type != "qwen2_vl":
        pytest.skip("one family is enough")
    llm = jpaged.LLM(path, dtype="float32", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=24,
                     block_size=16, enforce_eager=True, **options)
    _text_and_three_images_equal_hf(llm, hf, processor, rng)
