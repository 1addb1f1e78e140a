"""Images through `jpaged serve` with the openai SDK (issue 65), a tiny random LLaVA-1.5
(test_multimodal_llava.save_random_llava): chat.completions with image_url parts (one and two
images, data: URLs) and responses.create with input_image parts give transformers' greedy tokens
and logprobs (fp32, within 1e-4), concurrently with a text-only request."""

import base64
import concurrent.futures
import io

import numpy as np
import openai
import pytest

from test_multimodal_llava import hf_generate, random_images, save_random_llava
from test_server import Server

SEED = 2468


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import transformers as tf

    print("seed", SEED)
    ckpt = save_random_llava(tmp_path_factory.mktemp("llava_sdk"), SEED)
    server = Server("--model", ckpt, "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4",
                    "--max-num-batched-tokens", "32", "--enable-prefix-caching", "--enforce-eager",
                    "--served-model-name", "llava")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    hf = tf.LlavaForConditionalGeneration.from_pretrained(ckpt).eval(), tf.AutoProcessor.from_pretrained(ckpt)
    yield client, hf
    assert server.stop() == 0, "".join(server.log[-30:])


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat_tokens(client, content, steps: int):
    """The greedy tokens (each as its bytes, from the logprobs) and their logprobs."""
    out = client.chat.completions.create(
        model="llava", messages=[{"role": "user", "content": content}], max_tokens=steps, temperature=0,
        logprobs=True, extra_body={"ignore_eos": True})
    entries = out.choices[0].logprobs.content
    return [e.bytes for e in entries], [e.logprob for e in entries]


def as_bytes(hf, tokens: list[int]) -> list:
    from serving.logprobs import LogprobFormatter

    formatter = LogprobFormatter(hf[1].tokenizer)
    return [list(formatter.token_bytes(t)) for t in tokens]


@pytest.mark.parametrize("num_images", [1, 2])
def test_chat_image_parts_match_transformers(setup, num_images):
    client, hf = setup
    rng = np.random.default_rng(SEED + num_images)
    images = random_images(rng, num_images)
    parts = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
    content = parts + [{"type": "text", "text": "What are these?"}]
    prompt = "USER: " + "<image>\n" * num_images + "What are these? ASSISTANT:"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # a text request beside it
        text = pool.submit(client.chat.completions.create, model="llava", max_tokens=4,
                           messages=[{"role": "user", "content": "plain words"}])
        tokens, logprobs = chat_tokens(client, content, 6)
        assert text.result().choices[0].message.content is not None
    want_tokens, want_logprobs = hf_generate(hf, prompt, images, 6)
    assert tokens == as_bytes(hf, want_tokens)
    np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4)
    # Again: its image blocks come from the prefix cache, the same answer.
    assert chat_tokens(client, content, 6)[0] == as_bytes(hf, want_tokens)


def test_responses_input_image_matches_transformers(setup):
    client, hf = setup
    image = random_images(np.random.default_rng(SEED + 7), 1)[0]
    out = client.responses.create(
        model="llava", max_output_tokens=6, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": data_url(image)},
                                            {"type": "input_text", "text": "Describe it."}]}])
    tokens = hf_generate(hf, "USER: <image>\nDescribe it. ASSISTANT:", [image], 6)[0]
    eos = 257
    tokens = tokens[:tokens.index(eos)] if eos in tokens else tokens
    # (a last byte that ends no character is held back by the server, shown as U+FFFD by decode)
    assert out.output_text == hf[1].tokenizer.decode(tokens, skip_special_tokens=True).removesuffix("\ufffd")


def test_bad_image_is_a_400_naming_the_part(setup):
    client, _ = setup
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="llava", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}]}])
    assert "messages[0].content[0]" in str(e.value)
