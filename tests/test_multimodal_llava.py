"""LLaVA-1.5 through the engine, against transformers' LlavaForConditionalGeneration (torch, fp32)
on a tiny random checkpoint written with save_pretrained (CLIP vision 2 layers, Llama text 2
layers, 56x56 images -> 16 tokens each) with its LlavaProcessor.

The engine runs with chunked prefill at 24 tokens a step, so prompts of 2-3 images are cut inside
images, and with prefix caching on."""

import copy

import numpy as np
import pytest
import torch
import transformers as tf

import jpaged
from jpaged import SamplingParams
from jpaged.core.block_manager import block_extra_keys, hash_block_tokens

SEED = 1234
IMAGE_TOKEN = 259  # the tiny byte tokenizer's 256 bytes + 3 specials, then <image>
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}USER: {% if m['content'] is string %}"
                 "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n"
                 "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %} {% else %}"
                 "ASSISTANT: {{ m['content'] }}</s>{% endif %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:"
                 "{% endif %}")


def save_random_llava(path, seed: int) -> str:
    from jpaged.models import tiny

    torch.manual_seed(seed)
    tok = copy.deepcopy(tiny.tiny_tokenizer())  # (lru_cached: the shared one stays as it is)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = CHAT_TEMPLATE
    assert tok.convert_tokens_to_ids("<image>") == IMAGE_TOKEN
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 image_size=56, patch_size=14, projection_dim=32)
    text = tf.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          tie_word_embeddings=False, eos_token_id=257, bos_token_id=256)
    config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                            vision_feature_layer=-2, vision_feature_select_strategy="default",
                            projector_hidden_act="gelu", image_seq_length=16)
    model = tf.LlavaForConditionalGeneration(config)
    with torch.no_grad():  # greedy choices far apart: stable across float orders
        model.lm_head.weight.mul_(8)
    model.save_pretrained(path)
    images = tf.CLIPImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    tf.LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
                      num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE).save_pretrained(path)
    return str(path)


def random_images(rng, n: int):
    from PIL import Image

    return [Image.fromarray(rng.integers(0, 256, (int(rng.integers(30, 90)), int(rng.integers(30, 90)), 3),
                                         dtype=np.uint8)) for _ in range(n)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    print("seed", SEED)
    return save_random_llava(tmp_path_factory.mktemp("llava"), SEED)


@pytest.fixture(scope="module")
def hf(ckpt):
    return tf.LlavaForConditionalGeneration.from_pretrained(ckpt).eval(), tf.AutoProcessor.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def llm(ckpt):
    return jpaged.LLM(ckpt, dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=24,
                      block_size=16, enable_prefix_caching=True, enforce_eager=True)


def hf_generate(hf, prompt: str, images, steps: int):
    """transformers' greedy tokens and each one's logprob."""
    model, processor = hf
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=steps, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs = [torch.log_softmax(step[0].double(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


PROMPTS = ["USER: <image>\nWhat is this? ASSISTANT:", "USER: plain text, no image. ASSISTANT:",
           "USER: <image><image>\nCompare them. ASSISTANT:", "USER: <image> and <image>\nthen <image> ASSISTANT:"]
NUM_IMAGES = [1, 0, 2, 3]


def test_images_in_a_batch_match_transformers(llm, hf):
    """1, 2 and 3 images per prompt beside a text-only prompt, prefilled 24 tokens a step (chunks
    cut through images): greedy tokens equal transformers', logprobs within 1e-4."""
    rng = np.random.default_rng(SEED)
    images = [random_images(rng, n) for n in NUM_IMAGES]
    prompts = [{"prompt": p, "multi_modal_data": {"image": im}} if im else p for p, im in zip(PROMPTS, images)]
    sp = SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    for prompt, ims, out in zip(PROMPTS, images, outs):
        tokens, logprobs = hf_generate(hf, prompt, ims, 8)
        got = out.outputs[0]
        assert got.token_ids == tokens, prompt
        mine = [lp[t] for lp, t in zip(got.logprobs, got.token_ids)]
        np.testing.assert_allclose(mine, logprobs, atol=1e-4)
        assert out.prompt == prompt
        assert out.prompt_token_ids.count(IMAGE_TOKEN) == 16 * len(ims)


def test_prefix_cache_keys_blocks_by_image(llm, hf):
    """The same image again hits the prefix cache and encodes nothing; another image with the same
    text shares no block that holds image tokens, and its output is its own (transformers')."""
    rng = np.random.default_rng(SEED + 1)
    a, b = random_images(rng, 2)
    prompt = "USER: <image>\nDescribe the picture in some detail please. ASSISTANT:"
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine = llm.llm_engine
    mm = engine.runner.mm
    first = llm.generate({"prompt": prompt, "multi_modal_data": {"image": a}}, sp, use_tqdm=False)[0]
    encodes = mm.num_encodes
    again = llm.generate({"prompt": prompt, "multi_modal_data": {"image": a.copy()}}, sp, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens >= 48
    assert mm.num_encodes == encodes  # all its image's blocks came from the prefix cache: no chunk needed it
    other = llm.generate({"prompt": prompt, "multi_modal_data": {"image": b}}, sp, use_tqdm=False)[0]
    assert other.outputs[0].token_ids == hf_generate(hf, prompt, [b], 6)[0]
    assert first.outputs[0].token_ids == hf_generate(hf, prompt, [a], 6)[0]
    assert other.num_cached_tokens == 0  # (the first block holds image tokens)
    assert mm.num_encodes == encodes + 1


def test_block_hash_extra_keys():
    """A block holding an image's tokens is keyed by the image's hash; a block without is not."""
    from jpaged.core.sequence import Sequence

    seq = Sequence(0, [1] * 8 + [IMAGE_TOKEN] * 16 + [2] * 8)
    seq.mm_ranges = ((8, 16, "aa"),)
    assert block_extra_keys(seq, 0, 8) == ()
    assert block_extra_keys(seq, 0, 16) == ("aa",)
    assert block_extra_keys(seq, 24, 32) == ()
    tokens = [IMAGE_TOKEN] * 16
    assert hash_block_tokens(None, tokens, ("aa",)) != hash_block_tokens(None, tokens, ("bb",))
    assert hash_block_tokens(None, tokens, ()) == hash_block_tokens(None, tokens)


def test_chat_with_image_parts(llm, hf):
    """LLM.chat with OpenAI image_url parts (a data: URL) equals generate on the template's prompt."""
    import base64
    import io

    rng = np.random.default_rng(SEED + 2)
    image = random_images(rng, 1)[0]
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is it?"}]}]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    out = llm.chat(messages, sp, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_generate(hf, "USER: <image>\nWhat is it? ASSISTANT:", [image], 6)[0]


def test_bad_image_requests_are_value_errors(llm):
    rng = np.random.default_rng(SEED + 3)
    image = random_images(rng, 1)[0]
    with pytest.raises(ValueError, match="multi_modal_data"):  # two images, one placeholder
        llm.generate({"prompt": "USER: <image> hi ASSISTANT:", "multi_modal_data": {"image": [image, image]}},
                     use_tqdm=False)
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "USER: <image>", "multi_modal_data": {"video": image}}, use_tqdm=False)
    with pytest.raises(ValueError, match="image"):
        llm.generate({"prompt": "USER: <image>", "multi_modal_data": {"image": "not an image"}}, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    # The engine still serves.
    assert llm.generate("USER: hi ASSISTANT:", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_limit_mm_per_prompt_names_the_option():
    from jpaged.config import EngineConfig
    from jpaged.engine.request_validator import RequestValidator

    validator = RequestValidator(300, 256, EngineConfig(model="tiny", limit_mm_per_prompt={"image": 2}), None)
    validator.check_images(2)
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        validator.check_images(3)


def test_text_only_model_refuses_images(shared_llm):
    llm = shared_llm("tiny", enforce_eager=True)
    rng = np.random.default_rng(SEED + 4)
    with pytest.raises(ValueError, match="takes no images"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": random_images(rng, 1)}}, use_tqdm=False)


def test_kv_events_carry_image_hashes(llm):
    """BlockStored events name the images whose tokens a block holds in extra_keys (None for others)."""
    from jpaged.kv_events.events import BlockStored
    from jpaged.multimodal.processing import image_hash

    engine = llm.llm_engine
    published = []

    class Recorder:  # the engine's publisher, recording what each step publishes
        def publish(self, batch):
            published.extend(batch.events)

    engine.kv_event_publisher = Recorder()
    engine.block_manager.enable_kv_events()
    rng = np.random.default_rng(SEED + 6)
    image = random_images(rng, 1)[0]
    prompt = "USER: a longer text before the image comes, to fill one block <image>\nok ASSISTANT:"
    llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, SamplingParams(max_tokens=2),
                 use_tqdm=False)
    stored = [e for e in published if isinstance(e, BlockStored)]
    keys = [k for e in stored for k in e.extra_keys]
    assert keys[0] is None  # the first block holds text only
    assert (image_hash(image.convert("RGB")),) in keys


@pytest.mark.parametrize("variant", ["layers-full-v5-names", "llava-hf-names"])
def test_image_features_of_config_and_name_variants(tmp_path, variant):
    """The image embeddings equal transformers' get_image_features for a vision_feature_layer list
    with the class token kept ("full"), and checkpoints naming their tensors as transformers 5
    does (model.language_model.*, lm_head) or as llava-hf's do (vision_tower.vision_model.*)."""
    import jax.numpy as jnp
    from safetensors.numpy import load_file, save_file

    from jpaged.models.loader import load_model

    torch.manual_seed(SEED)
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                 image_size=28, patch_size=14)
    text = tf.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2)
    full = variant.startswith("layers-full")
    config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=299,
                            vision_feature_layer=[-3, -1] if full else -2,
                            vision_feature_select_strategy="full" if full else "default", image_seq_length=4)
    model = tf.LlavaForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    if full:  # transformers 5's own names
        tensors = {("lm_head.weight" if k == "language_model.lm_head.weight" else
                    k.replace("language_model.model.", "model.language_model.", 1)): v for k, v in tensors.items()}
    else:  # llava-hf's: the CLIP tower under vision_model
        tensors = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in tensors.items()}
    save_file(tensors, path, metadata={"format": "pt"})
    loaded = load_model(str(tmp_path), dtype="float32")
    pixels = torch.randn(1, 3, 28, 28)
    with torch.no_grad():
        want = model.get_image_features(pixel_values=pixels)
    want = getattr(want, "pooler_output", want)
    want = (want[0] if isinstance(want, (list, tuple)) else want).reshape(-1, 64).numpy()
    got = np.asarray(loaded.model.embed_image(jnp.asarray(pixels.numpy())))
    assert got.shape == (5 if full else 4, 64)
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_token_id_prompts_with_images(llm, hf):
    """vLLM's {"prompt_token_ids", "multi_modal_data"}: one placeholder id per image (expanded
    here) or already expanded; both equal the text prompt's output."""
    rng = np.random.default_rng(SEED + 10)
    images = random_images(rng, 2)
    model, processor = hf
    expanded = processor(text=PROMPTS[2], images=images, return_tensors="np")["input_ids"][0].tolist()
    once = processor.tokenizer(PROMPTS[2])["input_ids"]
    assert once.count(IMAGE_TOKEN) == 2 and expanded.count(IMAGE_TOKEN) == 32
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}} for ids in (once, expanded)],
                        sp, use_tqdm=False)
    want = hf_generate(hf, PROMPTS[2], images, 6)[0]
    assert [o.outputs[0].token_ids for o in outs] == [want, want]
    assert outs[0].prompt_token_ids == expanded
    with pytest.raises(ValueError, match="multi_modal_data"):  # three placeholders, two images
        llm.generate({"prompt_token_ids": once + [IMAGE_TOKEN], "multi_modal_data": {"image": images}},
                     use_tqdm=False)
