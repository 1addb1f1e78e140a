"""Images in chat messages: the content parts vLLM's chat API takes, found, counted against
limit_mm_per_prompt and taken out, the messages rewritten for Hugging Face chat templates.

Parts taken (as vLLM's chat_utils takes them):
- text: {"type": "text", "text": ...}, the Responses API's input_text / output_text, refusal, and a
  plain string;
- images: {"type": "image_url", "image_url": {"url": ...}} (OpenAI's chat form), the same without
  "type", or with "image_url" a string (vLLM takes both), and the Responses API's
  {"type": "input_image", "image_url": "..."}; offline, {"type": "image_pil", "image_pil": image}.
Any other part type is an error naming it. A message with images comes back with content
[{"type": "image"}, {"type": "text", "text": ...}, ...] in order, which the templates of LLaVA,
Qwen2-VL and Gemma 3 render with their image tokens; a message without images keeps string
content (its text parts joined, as protocol.parse_messages joins them).

Imports nothing beyond the standard library: EngineConfig checks limit_mm_per_prompt with it.
"""

import dataclasses
import json

MODALITIES = ("image", "video", "audio")  # vLLM's names; jpaged serves images
DEFAULT_LIMIT_PER_PROMPT = 999  # vLLM's, for a modality limit_mm_per_prompt does not name
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
_IMAGE_PARTS = ("image_url", "input_image")


class ContentPartError(ValueError):
    """A content part that cannot be taken; `param` names it (e.g. "messages[0].content[2]")."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def parse_limit_mm_per_prompt(value) -> dict[str, int] | None:
    """vLLM's limit_mm_per_prompt: {"image": 2} or its JSON text (also vLLM's newer
    {"image": {"count": 2, ...}}); None when unset. A ValueError naming limit_mm_per_prompt otherwise."""
    if value is None:
        return None
    name = "limit_mm_per_prompt"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON ({e}); expected e.g. '{{\"image\": 2}}'") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict or a JSON object such as {{\"image\": 2}}, got {type(value).__name__}")
    limits = {}
    for modality, limit in value.items():
        if modality not in MODALITIES:
            raise ValueError(f"{name}: unknown modality {str(modality)[:40]!r}; expected some of {list(MODALITIES)}")
        if isinstance(limit, dict):  # vLLM's {"count": n, "width": ..., "height": ...}
            limit = limit.get("count", DEFAULT_LIMIT_PER_PROMPT)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"{name}: {modality!r} must be a count >= 0, got {limit!r:.40}")
        limits[modality] = limit
    return limits


def limit_for(limits: dict[str, int] | None, modality: str = "image") -> int:
    return (limits or {}).get(modality, DEFAULT_LIMIT_PER_PROMPT)


def check_count(count: int, limits: dict[str, int] | None, where: str, modality: str = "image"):
    """A ValueError naming limit_mm_per_prompt when `count` items of `modality` are over it."""
    limit = limit_for(limits, modality)
    if count > limit:
        raise ContentPartError(f"{where}: more than {limit} {modality}(s) in one prompt: limit_mm_per_prompt is "
                               f"{{\"{modality}\": {limit}}} (--limit-mm-per-prompt)", where)


@dataclasses.dataclass
class ImageRef:
    source: object  # a URL or path (str), or offline a PIL image
    what: str  # where it came from, e.g. "messages[0].content[1].image_url", for errors


@dataclasses.dataclass
class ChatImages:
    messages: list[dict]  # for the chat template
    images: list[ImageRef]  # in the order the template renders them


def _image_source(part: dict, kind: str, param: str):
    if kind == "image_pil":
        if "image_pil" not in part or part["image_pil"] is None:
            raise ContentPartError(f"{param}: an image_pil part needs 'image_pil' (a PIL image)", param)
        return part["image_pil"], f"{param}.image_pil"
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
        param = f"{param}.image_url.url"
    else:
        param = f"{param}.image_url"
    if url is None and kind == "input_image" and part.get("file_id") is not None:
        raise ContentPartError(f"{param}: input_image with a file_id is not supported; pass image_url (a data: or "
                               "http(s) URL)", param)
    if not isinstance(url, str) or not url:
        raise ContentPartError(f"{param}: expected the image's URL as a non-empty string (a data:, http(s) or "
                               "file: URL)", param)
    return url, param


def _part_kind(part: dict, param: str, allow_pil: bool) -> str:
    kind = part.get("type")
    if kind is None:  # vLLM's forms without a type
        kind = "image_url" if "image_url" in part else "image_pil" if allow_pil and "image_pil" in part else None
        if kind is None:
            raise ContentPartError(f"{param}: a content part needs a 'type' (text or image_url)", param)
    if not isinstance(kind, str):
        raise ContentPartError(f"{param}.type must be a string", f"{param}.type")
    if kind in _TEXT_PARTS or kind in _IMAGE_PARTS or (allow_pil and kind == "image_pil"):
        return kind
    raise ContentPartError(f"{param}: content part type {kind[:40]!r} is not supported; expected text or image_url "
                           "(input_text or input_image in the Responses API)", f"{param}.type")


def extract_images(messages: list, limit_mm_per_prompt: dict[str, int] | None = None, *,
                   accepts_images: bool = True, model: str = "this model", where: str = "messages",
                   allow_pil: bool = False, refusal: str | None = None) -> ChatImages:
    """`messages` with their image parts found and taken out (see the module's docstring).
    `accepts_images` False (a text-only model): any image is an error naming the model (or saying
    `refusal`, when the reason is another).
    `allow_pil`: image_pil parts (offline LLM.chat only). Messages that are not objects or have
    no content list are passed through untouched (protocol.parse_messages checks them)."""
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts, has_image = [], False
        for j, part in enumerate(content):
            param = f"{where}[{i}].content[{j}]"
            if isinstance(part, str):
                parts.append({"type": "text", "text": part})
                continue
            if not isinstance(part, dict):
                raise ContentPartError(f"{param}: a content part must be an object or a string", param)
            kind = _part_kind(part, param, allow_pil)
            if kind in _TEXT_PARTS:
                text = part.get(_TEXT_PARTS[kind])
                if not isinstance(text, str):
                    raise ContentPartError(f"{param}.{_TEXT_PARTS[kind]} must be a string",
                                           f"{param}.{_TEXT_PARTS[kind]}")
                parts.append({"type": "text", "text": text})
                continue
            if not accepts_images:
                raise ContentPartError(f"{param}: {refusal or f'{model} is not a vision-language model; it takes no images'}",
                                       param)
            source, what = _image_source(part, kind, param)
            images.append(ImageRef(source, what))
            check_count(len(images), limit_mm_per_prompt, param)
            parts.append({"type": "image"})
            has_image = True
        if has_image:
            out.append({**message, "content": parts})
        else:
            out.append({**message, "content": "".join(p["text"] for p in parts)})
    return ChatImages(out, images)
