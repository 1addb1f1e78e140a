"""LLaVA-1.5 engine variants against transformers (test_multimodal_llava.py's tiny checkpoint):
an encoder cache of two images with a KV pool that forces preemption, weights reloaded, every
executable compiled at start, tensor parallelism, and the combinations refused at start."""

import numpy as np
import pytest
import torch

import jpaged
from jpaged import SamplingParams
from test_multimodal_llava import PROMPTS, SEED, ckpt, hf, hf_generate, random_images  # noqa: F401 (fixtures)


def test_small_encoder_cache_and_preemption_match_transformers(ckpt, hf):
    """An encoder cache of two images' rows (a 3-image prompt's chunk stops before its third image
    until a later step) and a KV pool too small for the batch (preemption by recompute, which
    encodes the images again): outputs still equal transformers'."""
    llm = jpaged.LLM(ckpt, dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                     block_size=16, num_gpu_blocks_override=11, hf_overrides={"encoder_cache_size": 32},
                     enforce_eager=True)
    engine = llm.llm_engine
    assert engine.runner.mm.cache.num_rows == 32
    rng = np.random.default_rng(SEED + 5)
    prompts = [PROMPTS[3], PROMPTS[2], PROMPTS[3], PROMPTS[0]]
    images = [random_images(rng, n) for n in (3, 2, 3, 1)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": im}} for p, im in zip(prompts, images)], sp,
                        use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0
    assert engine.runner.mm.num_encodes > 9  # some images were encoded more than once
    for prompt, ims, out in zip(prompts, images, outs):
        assert out.outputs[0].token_ids == hf_generate(hf, prompt, ims, 24)[0], prompt


def test_weights_reload_forgets_encoded_images(ckpt, hf):
    """Encoded images do not outlive the weights that encoded them: after load_weights the same
    image is encoded again (with the new projector: another output)."""
    from jpaged.models.loader import iter_safetensors

    llm = jpaged.LLM(ckpt, dtype="float32", max_model_len=256, max_num_seqs=2, block_size=16, enforce_eager=True)
    mm = llm.llm_engine.runner.mm
    rng = np.random.default_rng(SEED + 7)
    image = random_images(rng, 1)[0]
    prompt = {"prompt": PROMPTS[0], "multi_modal_data": {"image": image}}
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    before = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids
    assert before == hf_generate(hf, PROMPTS[0], [image], 6)[0]
    scaled = [(name, -t if "multi_modal_projector.linear_2" in name else t) for name, t in iter_safetensors(ckpt)]
    llm.load_weights(scaled)
    encodes = mm.num_encodes
    after = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids
    assert mm.num_encodes == encodes + 1
    model, processor = hf
    with torch.no_grad():
        for proj in (model.model.multi_modal_projector.linear_2 if hasattr(model, "model") else
                     model.multi_modal_projector.linear_2,):
            proj.weight.neg_()
            proj.bias.neg_()
    try:
        assert after == hf_generate(hf, PROMPTS[0], [image], 6)[0]
    finally:
        with torch.no_grad():
            proj.weight.neg_()
            proj.bias.neg_()


def test_unsupported_combinations_are_value_errors(ckpt):
    with pytest.raises(ValueError, match="enable_lora"):
        jpaged.LLM(ckpt, dtype="float32", max_model_len=128, enable_lora=True, enforce_eager=True)


def test_nothing_compiles_while_serving_images(ckpt, hf):
    """Every executable compiles at start-up (the encoder's one image shape with the step buckets):
    requests with 1-3 images, chunked through them, compile nothing more."""
    llm = jpaged.LLM(ckpt, dtype="float32", max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32,
                     block_size=16, background_warmup=False)
    runner = llm.llm_engine.runner
    compiled = runner.num_compilations
    assert runner.mm.batch_sizes == (1, 2, 4) and runner.mm.num_compilations == 3
    rng = np.random.default_rng(SEED + 8)
    images = [random_images(rng, n) for n in (1, 3, 2)]
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": im}}
                         for p, im in zip([PROMPTS[0], PROMPTS[3], PROMPTS[2]], images)], sp, use_tqdm=False)
    assert runner.num_compilations == compiled
    assert outs[1].outputs[0].token_ids == hf_generate(hf, PROMPTS[3], images[1], 4)[0]


def test_tensor_parallel_2_matches_transformers(ckpt, hf):
    """Tensor parallelism: the text model's heads split over two devices, the encoder replicated;
    two images chunked through equal transformers."""
    llm = jpaged.LLM(ckpt, dtype="float32", max_model_len=128, max_num_seqs=2, max_num_batched_tokens=24,
                     block_size=16, tensor_parallel_size=2, enforce_eager=True)
    rng = np.random.default_rng(SEED + 9)
    images = random_images(rng, 2)
    out = llm.generate({"prompt": PROMPTS[2], "multi_modal_data": {"image": images}},
                       SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_generate(hf, PROMPTS[2], images, 6)[0]


def test_swap_preemption_and_forks_with_images(ckpt, hf):
    """Preemption by swap (a group swapped out mid-prefill comes back and reads its images again)
    equals transformers; n=2 sampling forks after a prompt with images (each fork its own tokens)."""
    llm = jpaged.LLM(ckpt, dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32,
                     block_size=16, num_gpu_blocks_override=11, preemption_mode="swap", swap_space=1,
                     hf_overrides={"encoder_cache_size": 32}, enforce_eager=True)
    rng = np.random.default_rng(SEED + 11)
    images = [random_images(rng, n) for n in (3, 3, 2)]
    prompts = [PROMPTS[3], PROMPTS[3], PROMPTS[2]]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": im}} for p, im in zip(prompts, images)], sp,
                        use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for prompt, ims, out in zip(prompts, images, outs):
        assert out.outputs[0].token_ids == hf_generate(hf, prompt, ims, 24)[0], prompt
    forks = llm.generate({"prompt": PROMPTS[0], "multi_modal_data": {"image": images[2][:1]}},
                         SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=3, ignore_eos=True),
                         use_tqdm=False)[0].outputs
    assert len(forks) == 2 and all(len(f.token_ids) == 8 for f in forks)


def test_memory_plan_measures_the_encoder(ckpt):
    """The KV pool's memory plan measures the image encoder's executables beside the steps' (each
    batch size; nothing for a text-only model)."""
    from jpaged.models.kv_cache import KVCacheSpec
    from jpaged.models.loader import load_model
    from jpaged.multimodal.runner import encoder_memory
    from jpaged.runner.model_runner import ModelRunner

    shape = dict(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128)
    for model, expected in ((ckpt, 3), ("tiny", 0)):
        loaded = load_model(model, dtype="float32")
        spec = KVCacheSpec.of_model(loaded.model, 16, loaded.dtype)
        probe = ModelRunner(loaded, spec, **shape, num_gpu_blocks=8, num_cpu_blocks=0, abstract=True)
        found = encoder_memory(loaded, probe)
        assert sorted(m.key[:2] for m in found) == [("encode", 1), ("encode", 2), ("encode", 4)][:expected]
        assert all(m.temp > 0 and m.transient >= m.temp for m in found)


def test_disable_chunked_mm_input_keeps_each_image_in_one_chunk(ckpt, hf):
    """vLLM's disable_chunked_mm_input on a LLaVA engine (16 tokens an image, a 20-token budget):
    no prefill chunk ends inside an image (several stop right before one), and the outputs still
    equal transformers'."""
    llm = jpaged.LLM(ckpt, dtype="float32", max_model_len=256, max_num_seqs=2, max_num_batched_tokens=20,
                     block_size=16, enforce_eager=True, disable_chunked_mm_input=True)
    scheduler = llm.llm_engine.scheduler
    plans, schedule = [], scheduler.schedule
    scheduler.schedule = lambda *a, **kw: plans.append(schedule(*a, **kw)) or plans[-1]
    rng = np.random.default_rng(SEED + 9)
    prompts, images = [PROMPTS[3], PROMPTS[2]], [random_images(rng, 3), random_images(rng, 2)]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": im}} for p, im in zip(prompts, images)], sp,
                        use_tqdm=False)
    cuts = 0
    for sg in (sg for plan in plans for sg in plan.scheduled_seq_groups):
        end = sg.start + sg.token_chunk_size
        for item in sg.seq_group.mm_items:
            assert not item.offset < end < item.offset + item.length, (sg.seq_group.request_id, sg.start, end)
            cuts += end == item.offset
    assert cuts >= 2
    for prompt, ims, out in zip(prompts, images, outs):
        assert out.outputs[0].token_ids == hf_generate(hf, prompt, ims, 6)[0], prompt
