"""jpaged/multimodal/chat_parts.py: the image parts of chat messages found in order, counted against
limit_mm_per_prompt (vLLM's name and JSON form) and rewritten for Hugging Face chat templates;
anything else is a ValueError naming the part. The --limit-mm-per-prompt and
--allowed-local-media-path flags reach EngineConfig."""

import random

import pytest

from jpaged.config import EngineConfig
from jpaged.models.tiny import tiny_tokenizer
from jpaged.multimodal.chat_parts import (DEFAULT_LIMIT_PER_PROMPT, ContentPartError, extract_images,
                                          parse_limit_mm_per_prompt)
from serving import cli

SEED = 20261128
# A template that renders content lists as the VLM templates (LLaVA, Qwen2-VL, Gemma 3) do: an
# image part becomes the model's image token, text parts their text, string content as is.
VLM_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{% if m['content'] is string %}{{ m['content'] }}"
                "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>"
                "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}</s>{% endfor %}")


def image_part(url: str, form: str) -> dict:
    return {"object": {"type": "image_url", "image_url": {"url": url, "detail": "auto"}},
            "untyped": {"image_url": url},
            "untyped_object": {"image_url": {"url": url}},
            "responses": {"type": "input_image", "image_url": url, "detail": "auto"}}[form]


def test_parts_found_in_order_and_rendered():
    """Random conversations of text and image parts in every accepted form: the images come out
    in order with where they came from, and a template renders <image> exactly where each was."""
    rng = random.Random(SEED)
    print("seed", SEED)
    tokenizer = tiny_tokenizer()
    for _ in range(50):
        messages, expected_text, expected_urls = [], "", []
        for i in range(rng.randint(1, 4)):
            role = rng.choice(["user", "assistant", "system"])
            if rng.random() < 0.3:
                text = f"plain {i}"
                messages.append({"role": role, "content": text})
                expected_text += f"<{role}>{text}</s>"
                continue
            parts, rendered = [], ""
            for j in range(rng.randint(0, 4)):
                if rng.random() < 0.5:
                    url = f"data:image/png;base64,{i}{j}"
                    parts.append(image_part(url, rng.choice(["object", "untyped", "untyped_object", "responses"])))
                    expected_urls.append((url, f"messages[{i}].content[{j}]"))
                    rendered += "<image>"
                else:
                    text = f"t{i}.{j} "
                    parts.append(rng.choice([{"type": "text", "text": text}, {"type": "input_text", "text": text},
                                             text]))
                    rendered += text
            messages.append({"role": role, "content": parts, "name": "kept"})
            expected_text += f"<{role}>{rendered}</s>"
        chat = extract_images(messages)
        assert [(r.source, r.what.rsplit(".image_url", 1)[0]) for r in chat.images] == expected_urls
        assert all(m.get("name") == "kept" for m in chat.messages if m is not None and "name" in m)
        for m in chat.messages:  # string content unless the message holds an image
            assert isinstance(m["content"], str) or any(p["type"] == "image" for p in m["content"])
        assert tokenizer.apply_chat_template(chat.messages, chat_template=VLM_TEMPLATE, tokenize=False) == expected_text


def test_what_names_the_url():
    chat = extract_images([{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "http://x/1.png"}},
        {"type": "input_image", "image_url": "http://x/2.png"}]}])
    assert [r.what for r in chat.images] == ["messages[0].content[1].image_url.url", "messages[0].content[2].image_url"]
    assert chat.messages[0]["content"] == [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "image"}]


def test_text_only_messages_unchanged_in_meaning():
    """No image: the content is a string, text parts joined as protocol.parse_messages joins them."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None}, {"role": "user", "content": "c"}]
    chat = extract_images(messages)
    assert chat.images == []
    assert chat.messages == [{"role": "user", "content": "ab"}, {"role": "assistant", "content": None},
                             {"role": "user", "content": "c"}]


def test_limit_mm_per_prompt():
    messages = [{"role": "user", "content": [image_part(f"http://x/{i}", "object") for i in range(2)]},
                {"role": "user", "content": [image_part("http://x/2", "untyped")]}]
    assert len(extract_images(messages, {"image": 3}).images) == 3
    assert len(extract_images(messages, {"video": 0}).images) == 3  # image not named: vLLM's 999
    with pytest.raises(ContentPartError, match=r"^messages\[1\]\.content\[0\]: more than 2 image\(s\) in one prompt: "
                                               r"limit_mm_per_prompt is \{\"image\": 2\}") as e:
        extract_images(messages, {"image": 2})
    assert e.value.param == "messages[1].content[0]"
    with pytest.raises(ContentPartError, match=r"more than 0 image\(s\)"):
        extract_images(messages, {"image": 0})
    assert DEFAULT_LIMIT_PER_PROMPT == 999


def test_text_only_model_refuses_images():
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, image_part("http://x", "object")]}]
    with pytest.raises(ContentPartError, match=r"^messages\[0\]\.content\[1\]: tiny is not a vision-language model"):
        extract_images(messages, accepts_images=False, model="tiny")
    assert extract_images([{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                          accepts_images=False).messages[0]["content"] == "hi"


@pytest.mark.parametrize("part,message,param", [
    ({"type": "audio_url", "audio_url": {"url": "x"}}, "content part type 'audio_url' is not supported",
     "messages[0].content[0].type"),
    ({"type": "video_url", "video_url": {"url": "x"}}, "type 'video_url' is not supported", None),
    ({"type": "input_audio", "input_audio": {}}, "type 'input_audio' is not supported", None),
    ({"type": "image_pil", "image_pil": "x"}, "type 'image_pil' is not supported", None),  # offline only
    ({"type": 3}, r"\.type must be a string", None),
    ({"text": "no type"}, "a content part needs a 'type'", None),
    ({"type": "text", "text": 5}, r"\.text must be a string", "messages[0].content[0].text"),
    ({"type": "image_url", "image_url": {"url": ""}}, "expected the image's URL as a non-empty string",
     "messages[0].content[0].image_url.url"),
    ({"type": "image_url", "image_url": {}}, "expected the image's URL", None),
    ({"type": "image_url"}, "expected the image's URL", None),
    ({"type": "input_image", "file_id": "file-1"}, "input_image with a file_id is not supported", None),
    (7, "a content part must be an object or a string", "messages[0].content[0]"),
])
def test_bad_parts(part, message, param):
    with pytest.raises(ContentPartError, match=message) as e:
        extract_images([{"role": "user", "content": [part]}])
    assert str(e.value).startswith("messages[0].content[0]")
    if param is not None:
        assert e.value.param == param


def test_offline_pil_parts():
    image = object()  # passed through as is; media.check_image checks it is a PIL image
    chat = extract_images([{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                                        {"image_pil": image}]}], allow_pil=True)
    assert [r.source for r in chat.images] == [image, image]
    assert chat.images[0].what == "messages[0].content[0].image_pil"


def test_parse_limit_mm_per_prompt():
    assert parse_limit_mm_per_prompt(None) is None
    assert parse_limit_mm_per_prompt('{"image": 2, "video": 0}') == {"image": 2, "video": 0}
    assert parse_limit_mm_per_prompt({"image": {"count": 3, "width": 512, "height": 512}}) == {"image": 3}
    for bad, message in [("image=2", "not valid JSON"), ("[1]", "must be a dict"), ('{"imgs": 1}', "unknown modality"),
                         ('{"image": -1}', "must be a count >= 0"), ('{"image": true}', "must be a count"),
                         ('{"image": 1.5}', "must be a count")]:
        with pytest.raises(ValueError, match=f"^limit_mm_per_prompt.*{message}"):
            parse_limit_mm_per_prompt(bad)


def test_flags_reach_engine_config(tmp_path):
    args = cli.build_parser().parse_args(["serve", "--limit-mm-per-prompt", '{"image": 2}',
                                          "--allowed-local-media-path", str(tmp_path),
                                          "--allowed-media-domains", "a.example,b.example"])
    config, _ = cli.serve_options(args)
    assert config.limit_mm_per_prompt == {"image": 2} and config.allowed_local_media_path == str(tmp_path)
    assert config.allowed_media_domains == ["a.example", "b.example"]
    assert EngineConfig().limit_mm_per_prompt is None and EngineConfig().allowed_local_media_path is None
    with pytest.raises(ValueError, match="limit_mm_per_prompt: unknown modality"):
        EngineConfig(limit_mm_per_prompt='{"picture": 1}')
    with pytest.raises(ValueError, match="allowed_local_media_path=.*expected None or an existing directory"):
        EngineConfig(allowed_local_media_path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="allowed_media_domains=.*expected None or a list of host names"):
        EngineConfig(allowed_media_domains=[3])
