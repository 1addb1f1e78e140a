"""Images through `jpaged serve` (issue 65), a tiny random LLaVA-1.5 written by save_pretrained
with its processor (test_multimodal_llava.py's): the chat API's image_url parts (data:, http(s)
from a loopback server, file: under --allowed-local-media-path) and the Responses API's
input_image give transformers' greedy tokens; every bad image is a 400 in OpenAI's shape naming
the part, and the server stays healthy, idle (no KV block held) and answers text requests."""

import asyncio
import base64
import io

import pytest
from PIL import Image

from jpaged.multimodal.chat_parts import ChatImages
from serving.images import ServerImages
from serving.logprobs import LogprobFormatter
from serving.protocol import APIError
from test_media import MiB, LoopbackServer, encode, png_header_only, random_image
from test_multimodal_llava import hf_generate, save_random_llava
from test_server import Server, post, run, stream_events
from test_server_robustness import assert_healthy_and_idle, assert_openai_error

SEED = 4321
LIMIT = 2  # --limit-mm-per-prompt
FETCH_TIMEOUT = 2  # $JPAGED_IMAGE_FETCH_TIMEOUT


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    print("seed", SEED)
    root = tmp_path_factory.mktemp("mm")
    ckpt = save_random_llava(root / "llava", SEED)
    allowed, outside = root / "media", root / "outside"
    allowed.mkdir()
    outside.mkdir()
    image = random_image(SEED, size=(61, 47))
    png = encode(image, "PNG")
    (allowed / "a.png").write_bytes(png)
    (outside / "b.png").write_bytes(png)
    (allowed / "link.png").symlink_to(outside / "b.png")
    web = LoopbackServer()
    server = Server("--model", ckpt, "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4",
                    "--enforce-eager", "--allowed-local-media-path", str(allowed),
                    "--limit-mm-per-prompt", f'{{"image": {LIMIT}}}', "--served-model-name", "llava",
                    env={"JPAGED_IMAGE_FETCH_TIMEOUT": str(FETCH_TIMEOUT), "JPAGED_MAX_IMAGE_BYTES": str(4 * MiB)})
    yield {"ckpt": ckpt, "server": server, "web": web, "png": png, "allowed": allowed, "outside": outside}
    web.stop()
    assert server.stop() == 0, "".join(server.log[-30:])


@pytest.fixture(scope="module")
def hf(setup):
    import transformers as tf

    return (tf.LlavaForConditionalGeneration.from_pretrained(setup["ckpt"]).eval(),
            tf.AutoProcessor.from_pretrained(setup["ckpt"]))


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(setup, parts, **extra):
    body = {"model": "llava", "messages": [{"role": "user", "content": parts}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "logprobs": True, **extra}
    return run(post(setup["server"].url, "/v1/chat/completions", body))


def text_of(parts):
    return {"type": "text", "text": parts}


def expected(hf, prompt: str, png: bytes):
    """transformers' greedy tokens (as the bytes chat's logprobs give for each) and prompt length
    for one PNG image."""
    model, processor = hf
    image = Image.open(io.BytesIO(png)).convert("RGB")
    tokens = hf_generate(hf, prompt, [image], 6)[0]
    prompt_len = processor(text=prompt, images=[image], return_tensors="pt")["input_ids"].shape[1]
    formatter = LogprobFormatter(processor.tokenizer)
    return [list(formatter.token_bytes(t)) for t in tokens], prompt_len


def token_bytes(choice: dict) -> list:
    return [entry["bytes"] for entry in choice["logprobs"]["content"]]


def test_image_sources_give_transformers_tokens(setup, hf):
    """One image by data: URL and by file: URL (the same bytes): transformers' greedy tokens for
    the template's prompt, and its prompt length; /tokenize counts the same."""
    text, prompt_len = expected(hf, "USER: <image>\nWhat is it? ASSISTANT:", setup["png"])
    for url in (data_url(setup["png"]), f"file://{setup['allowed']}/a.png", str(setup["allowed"] / "a.png")):
        parts = [{"type": "image_url", "image_url": {"url": url}}, text_of("What is it?")]
        status, body = chat(setup, parts)
        assert status == 200, body
        assert token_bytes(body["choices"][0]) == text
        assert body["usage"]["prompt_tokens"] == prompt_len
        status, tokens = run(post(setup["server"].url, "/tokenize", {
            "model": "llava", "messages": [{"role": "user", "content": parts}], "add_generation_prompt": True}))
        assert status == 200 and tokens["count"] == prompt_len, tokens
    # Streamed: the same text, in pieces.
    events = run(stream_events(setup["server"].url, "/v1/chat/completions", {
        "model": "llava", "messages": [{"role": "user", "content": parts}], "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "stream": True}))
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert streamed == body["choices"][0]["message"]["content"]


def test_http_image_and_responses_input_image(setup, hf):
    """An http image (loopback server), in chat and as the Responses API's input_image."""
    web = setup["web"]
    text, prompt_len = expected(hf, "USER: <image>\nHi ASSISTANT:", web.image)
    status, body = chat(setup, [{"type": "image_url", "image_url": {"url": web.url("/image.png")}}, text_of("Hi")])
    assert status == 200, body
    assert token_bytes(body["choices"][0]) == text and body["usage"]["prompt_tokens"] == prompt_len
    status, response = run(post(setup["server"].url, "/v1/responses", {
        "model": "llava", "max_output_tokens": 6, "temperature": 0, "ignore_eos": True, "store": False,
        "include": ["message.output_text.logprobs"],
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": web.url("/image.png")},
                                               {"type": "input_text", "text": "Hi"}]}]}))
    assert status == 200, response
    assert [entry["bytes"] for entry in response["output"][0]["content"][0]["logprobs"]] == text


def bad_cases(setup):
    web, allowed, outside = setup["web"], setup["allowed"], setup["outside"]
    png = setup["png"]
    one = "messages[0].content[0].image_url.url"
    return [  # (parts, the error's param, what its message says)
        ([{"type": "image_url", "image_url": {"url": data_url(png[:len(png) // 2])}}], one, "corrupt or truncated"),
        ([{"type": "image_url", "image_url": {"url": data_url(b"just some text")}}], one, "not an image"),
        ([{"type": "image_url", "image_url": {"url": data_url(png_header_only(100_000, 100_000))}}], one,
         "pixels is over the limit"),
        ([{"type": "image_url", "image_url": {"url": data_url(png)}}] * (LIMIT + 1), f"messages[0].content[{LIMIT}]",
         "limit_mm_per_prompt"),
        ([{"type": "image_url", "image_url": {"url": web.url("/slow")}}], one, f"not fetched within {FETCH_TIMEOUT} s"),
        ([{"type": "image_url", "image_url": {"url": web.url("/endless")}}], one, "more than the limit of 4194304 bytes"),
        ([{"type": "image_url", "image_url": {"url": web.url("/loop/0")}}], one, "more than 5 redirects"),
        ([{"type": "image_url", "image_url": {"url": web.url("/missing")}}], one, "HTTP 404"),
        ([{"type": "image_url", "image_url": {"url": "ftp://127.0.0.1/a.png"}}], one, "scheme 'ftp' is not supported"),
        ([{"type": "image_url", "image_url": {"url": f"file://{outside}/b.png"}}], one, "outside --allowed-local"),
        ([{"type": "image_url", "image_url": {"url": f"file://{allowed}/../outside/b.png"}}], one, "outside"),
        ([{"type": "image_url", "image_url": {"url": f"file://{allowed}/link.png"}}], one, "outside"),
        ([{"type": "image_url", "image_url": {"url": f"file://{allowed}/nothing.png"}}], one, "cannot be opened"),
        ([{"type": "audio_url", "audio_url": {"url": data_url(png)}}], "messages[0].content[0].type", "audio_url"),
        ([{"type": "image", "image": "x"}], "messages[0].content[0].type", "'image' is not supported"),
        ([text_of("<image>"), {"type": "image_url", "image_url": {"url": data_url(png)}}], "messages",
         "could not be processed"),  # the text's own placeholder: two for one image
    ]


def test_bad_images_are_400s_and_harm_nothing(setup):
    """Each bad image is a 400 naming the part, sent all at once with a text request beside them:
    the text request answers, and the server ends healthy with no request or block held."""
    url = setup["server"].url
    cases = bad_cases(setup)
    text_body = {"model": "llava", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
                 "temperature": 0}

    async def all_at_once():
        bad = [post(url, "/v1/chat/completions", {"model": "llava", "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": parts}]})
               for parts, _, _ in cases]
        return await asyncio.gather(post(url, "/v1/chat/completions", text_body), *bad)

    (status, body), *answers = run(all_at_once())
    assert status == 200 and body["choices"][0]["message"]["content"] is not None, body
    for (parts, param, message), (status, got) in zip(cases, answers):
        assert_openai_error(status, got, 400, param)
        assert message in got["error"]["message"], (message, got)
    assert setup["web"].done["endless"].wait(30)
    print(f"the endless URL got {setup['web'].sent['endless'] / MiB:.1f} MiB out before the server stopped reading")
    assert setup["web"].sent["endless"] < 4 * MiB + 32 * MiB
    assert_healthy_and_idle(url)
    assert chat(setup, [text_of("still there?")])[0] == 200


def test_text_only_model_refuses_images():
    """A text-only model (no multimodal path): any image part is a 400 naming it and the model."""
    class Engine:
        engine = None

    images = ServerImages(Engine(), "tiny", None)
    assert images.find([{"role": "user", "content": [{"type": "text", "text": "a"}]}]).images == []
    with pytest.raises(APIError, match=r"^messages\[0\]\.content\[1\]: tiny is not a vision-language model") as e:
        images.find([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "image_url", "image_url": {"url": "data:,"}}]}])
    assert e.value.status == 400 and e.value.param == "messages[0].content[1]"
    assert images.find("not a list") == ChatImages("not a list", [])


def test_data_parallel_front_refuses_images_saying_why():
    """A data-parallel front end (no runner: the replicas hold the models) of a VLM checkpoint."""
    class Front:
        hf_config = type("Config", (), {"vision_config": object()})()

    class Engine:
        engine = Front()

    with pytest.raises(APIError, match=r"^messages\[0\]\.content\[0\]: images are not served with data parallelism"):
        ServerImages(Engine(), "llava", None).find([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:,"}}]}])


def test_responses_bad_image_names_the_input(setup):
    status, got = run(post(setup["server"].url, "/v1/responses", {
        "model": "llava", "max_output_tokens": 4, "store": False,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                               {"type": "input_image", "image_url": data_url(b"GIF89a broken")}]}]}))
    assert_openai_error(status, got, 400, "input[0].content[1].image_url")
    assert got["error"]["message"].startswith("input[0].content[1].image_url: not an image"), got
    status, got = run(post(setup["server"].url, "/v1/responses", {
        "model": "llava", "max_output_tokens": 4, "store": False,
        "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]}))
    assert_openai_error(status, got, 400, "input[0].content[0].image_url")


def test_decodes_gated(monkeypatch):
    """At most MAX_CONCURRENT_DECODES prompts have decoded images at once (decoding to processed);
    the others wait with their bytes only. Each fake decode waits until 4 are in (or 5 s)."""
    import threading
    import time

    from serving import images as server_images

    inside, most, lock = [0], [0], threading.Lock()

    def decode(items, whats, options):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        deadline = time.monotonic() + 5
        while inside[0] < server_images.MAX_CONCURRENT_DECODES and time.monotonic() < deadline:
            time.sleep(0.01)
        return items

    class MM:
        processor = None

        @staticmethod
        def process(text, images):
            with lock:
                inside[0] -= 1
            return len(images)

    class Engine:
        class engine:
            class runner:
                mm = MM()

    monkeypatch.setattr(server_images, "decode_images", decode)
    serving = ServerImages(Engine(), "llava", None)
    chat = serving.find([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(b"x")}}]}])

    async def many():
        return await asyncio.gather(*[serving.prompt("t", chat) for _ in range(10)])

    assert run(many()) == [1] * 10
    assert most[0] == server_images.MAX_CONCURRENT_DECODES == 4
