"""Images in chat and Responses requests (issue 65): their content parts found and counted
(jpaged/multimodal/chat_parts.py), the images loaded without blocking the event loop (media.py:
http(s) through aiohttp, files, base64 and decoding in threads), then the rendered prompt and its
images processed by the checkpoint's processor in the tokenizer's thread (multimodal/runner.py),
into the ProcessedPrompt the engine adds, MAX_CONCURRENT_DECODES prompts at a time. Every bad input
is a 400 naming the part; nothing is added to the engine until all of a request's images have loaded.
"""

import asyncio

from jpaged.multimodal.chat_parts import ChatImages, ContentPartError, extract_images
from jpaged.multimodal.media import MediaError, MediaOptions, decode_images, fetch_images_async
from serving.protocol import APIError

# Prompts whose images are decoded and processed at once (each up to max_request_pixels, ~256 MiB
# as RGB): the others wait, their fetched bytes only (each request's bounded by max_request_bytes).
MAX_CONCURRENT_DECODES = 4


class ServerImages:
    """One server's image handling: its model's multimodal path (None: a text-only model, whose
    requests with images get a 400), limit_mm_per_prompt and where media may come from."""

    def __init__(self, engine, model_name: str, pool):
        llm = getattr(engine, "engine", None)  # the LLMEngine (a data-parallel front has no runner)
        config = getattr(llm, "config", None)
        self.mm = getattr(getattr(llm, "runner", None), "mm", None)
        self.limits = getattr(config, "limit_mm_per_prompt", None)
        self.refusal = None  # why images are refused, when not because the model is text-only
        if not hasattr(llm, "runner") and getattr(getattr(llm, "hf_config", None), "vision_config", None) is not None:
            self.refusal = "images are not served with data parallelism (--data-parallel-size > 1) yet"
        self.options = MediaOptions.from_env(getattr(config, "allowed_local_media_path", None),
                                             getattr(config, "allowed_media_domains", None))
        self.model_name, self.pool = model_name, pool
        self.gate = asyncio.Semaphore(MAX_CONCURRENT_DECODES)

    @property
    def chat_template(self) -> str | None:
        """The processor's chat template (a VLM checkpoint keeps it there), if it has one."""
        processor = getattr(self.mm, "processor", None)
        return getattr(processor, "chat_template", None)

    def find(self, messages) -> ChatImages:
        """`messages` with their image parts taken out (content [{"type": "image"}, ...] where
        they were) and the images in order; a 400 naming a bad part, too many images, or any image
        for a text-only model."""
        if not isinstance(messages, list):  # protocol.parse_messages says what is wrong
            return ChatImages(messages, [])
        try:
            return extract_images(messages, self.limits, accepts_images=self.mm is not None, model=self.model_name,
                                  refusal=self.refusal)
        except ContentPartError as e:
            raise APIError(str(e), param=e.param, code="invalid_value") from None

    async def prompt(self, text: str, chat: ChatImages):
        """The rendered chat `text` and its images -> a ProcessedPrompt (token ids with each
        image's placeholders expanded, the images' pixel inputs)."""
        whats = [ref.what for ref in chat.images]
        try:
            fetched = await fetch_images_async([ref.source for ref in chat.images], self.options, whats)
            async with self.gate:  # the decoded pixels exist from here until processed
                images = await asyncio.to_thread(decode_images, fetched, whats, self.options)
                del fetched
                try:
                    return await asyncio.get_running_loop().run_in_executor(self.pool, self.mm.process, text, images)
                except ValueError as e:
                    raise APIError(f"the images could not be processed: {e}", param="messages") from None
        except MediaError as e:
            raise APIError(str(e), param=str(e).split(":", 1)[0], code="invalid_image") from None
