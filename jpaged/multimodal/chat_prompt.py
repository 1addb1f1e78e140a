"""Offline `LLM.chat`: OpenAI-style messages (text, and image_url / input_image / image_pil parts)
-> the prompt vLLM's LLM.chat would run: the chat template's text, and the images (loaded through
media.py) as `multi_modal_data`."""

from jpaged.multimodal.chat_parts import extract_images
from jpaged.multimodal.media import MediaOptions, load_images


def chat_prompt(engine, messages: list, *, chat_template: str | None = None, add_generation_prompt: bool = True,
                chat_template_kwargs: dict | None = None):
    """One conversation -> a str prompt (no images) or {"prompt", "multi_modal_data"}. ValueError
    (naming the message part) for a bad part, too many images, or any image for a text-only model."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError("messages: expected a list of {'role': ..., 'content': ...} objects")
    config = engine.config
    mm = getattr(engine.runner, "mm", None)
    found = extract_images(messages, config.limit_mm_per_prompt, accepts_images=mm is not None, model=config.model,
                           allow_pil=True)
    template_owner = mm.processor if mm is not None and mm.processor is not None else engine.tokenizer
    if template_owner is None:
        raise ValueError("messages: this model has no tokenizer to apply a chat template with")
    text = template_owner.apply_chat_template(found.messages, chat_template=chat_template, tokenize=False,
                                              add_generation_prompt=add_generation_prompt,
                                              **(chat_template_kwargs or {}))
    if not found.images:
        return text
    options = MediaOptions.from_env(config.allowed_local_media_path, getattr(config, "allowed_media_domains", None))
    images = load_images([ref.source for ref in found.images], options, [ref.what for ref in found.images])
    return {"prompt": text, "multi_modal_data": {"image": images}}
