"""The engine's multimodal path: requests with images in, image embeddings into the prefill steps.

`MultimodalEngine` (held by the engine as `LLMEngine.mm`, and by its runner as `ModelRunner.mm`)
- processes a prompt and its images (processing.py, the checkpoint's AutoProcessor), checks
  `limit_mm_per_prompt`, and adds the request with its images attached: the group's `mm_items`
  (pixel inputs), the sequence's `mm_ranges` (offset, length, hash per image: prefix-cache keys);
- before each step's dispatch (`prepare`, called by ModelRunner.execute), for every prefill chunk
  that covers placeholder tokens: makes sure those images' embeddings are in the device encoder
  cache (encoding the missing ones, one jitted call per image, each a precompiled executable) and
  rewrites the chunk's placeholder ids into cache rows (`vocab_size + row`, read by the model's
  embedding: encoder_cache.py). An image evicted before its last token was prefilled, or a
  request preempted by recompute, is simply encoded again when a chunk needs it.

The encode executables compile at start-up, in a background thread (the first image waits for
them), one per pixel-input shape the model names (`encoder_input_shapes`: LLaVA-1.5 has one, its
fixed image size) and batch size, through the runner's executable cache: nothing compiles while
serving.
"""

import functools
import logging
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.multimodal.encoder_cache import EncoderCacheFull, EncoderCacheManager
from jpaged.multimodal.media import MediaOptions, check_image
from jpaged.multimodal.mm_prefix import with_key_limits
from jpaged.multimodal.mrope_step import with_mrope_positions
from jpaged.multimodal.processing import ProcessedPrompt, process_prompt, process_token_prompt

logger = logging.getLogger(__name__)


def is_multimodal(model) -> bool:
    return bool(getattr(model, "is_multimodal", False))


def _encode(graphdef, state, pixel_inputs: dict, row):
    """The state with one image's embeddings written into the model's encoder cache from `row`."""
    model = nnx.merge(graphdef, state)
    embeddings = model.embed_image(**pixel_inputs)
    cache = model.encoder_cache[...]
    model.encoder_cache.set_value(jax.lax.dynamic_update_slice(cache, embeddings.astype(cache.dtype), (row, 0)))
    return nnx.split(model)[1]


def _encode_batch(graphdef, state, pixel_inputs: dict, rows):
    """The state with a batch of images' embeddings written into the encoder cache, image i's
    from row rows[i] on (-1: a padding image, written nowhere)."""
    model = nnx.merge(graphdef, state)
    embeddings = model.embed_images(**pixel_inputs)  # [images, tokens, hidden]
    cache = model.encoder_cache[...]
    b, n, h = embeddings.shape
    index = jnp.where(rows[:, None] < 0, cache.shape[0], rows[:, None] + jnp.arange(n, dtype=rows.dtype)[None])
    cache = cache.at[index.reshape(-1)].set(embeddings.reshape(b * n, h).astype(cache.dtype), mode="drop")
    model.encoder_cache.set_value(cache)
    return nnx.split(model)[1]


def batch_sizes(model) -> tuple[int, ...]:
    """Images one encode call takes: powers of two up to the model's `max_images_per_encode`
    (a model that encodes a batch of same-shape images, `embed_images`), else one."""
    most = int(getattr(model, "max_images_per_encode", 1))
    return tuple(2 ** k for k in range(most.bit_length()) if 2 ** k <= most)


class MultimodalEngine:
    def __init__(self, loaded, runner, background: bool = True):
        """`background`: compile the encode executables in a thread (False: before returning, as
        the memory plan's probe does: `encoder_memory`)."""
        if runner.lora_linears:  # (the tower's projections would take slots too, read outside a step)
            raise ValueError("enable_lora: not supported with a vision-language model yet")
        if runner.proposer.shared_pools() or runner.proposer.needs_hidden_states:
            raise ValueError("speculative_config: only the n-gram method runs with a vision-language model "
                             "(a draft model or EAGLE head would read image tokens as text)")
        if jax.process_count() > 1:
            raise ValueError("a vision-language model runs on one host (the encoder is not sent to followers yet)")
        self.model, self.hf_config, self.runner = loaded.model, loaded.hf_config, runner
        self.processor = loaded.processor  # the checkpoint's AutoProcessor (models/loader.py)
        self.vocab_size = self.model.vocab_size
        self.cache = EncoderCacheManager(self.model.encoder_cache.shape[0])
        self.num_encodes = 0  # images encoded (a cache hit encodes nothing)
        # Images of one shape are encoded together, in batches of these sizes (padded up): one
        # executable per (shape, size), all compiled at start-up. One image a call: `embed_image`.
        self.batch_sizes = batch_sizes(self.model)
        state_shardings = jax.tree.map(lambda x: x.sharding, runner.state)
        # (compiled against the state's shapes: the weights may be replaced or asleep meanwhile)
        self._state_avals = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                         runner.state)
        encode = _encode if self.batch_sizes == (1,) else _encode_batch
        self._jitted = jax.jit(functools.partial(encode, runner.graphdef), out_shardings=state_shardings,
                               donate_argnums=(0,))
        # Compiled in the background from now (the engine serves text meanwhile, as its step
        # shapes compile in the background too); the first image to encode waits for them.
        self._executables, self._compile_error = {}, None
        planned = [(shapes, size) for shapes in self.model.encoder_input_shapes() for size in self.batch_sizes]
        self._compiled = threading.Event()  # set when the start-up compiles are done (or failed)
        if background:
            threading.Thread(target=self._compile_all, args=(planned,), name="jpaged-encoder-compile",
                             daemon=True).start()
        else:
            self._compile_all(planned)

    def _compile_all(self, planned: list):
        try:
            for shapes, size in planned:
                self._compile(shapes, size)
        except Exception as e:  # noqa: BLE001 - reported to the first image that needs them
            logger.exception("compiling the image encoder failed")
            self._compile_error = e
        finally:
            self._compiled.set()

    def _batched(self, shape, size: int) -> tuple:
        """An input's shape for `size` images: its leading (image) axis `size` when images are
        batched; as the model gave it otherwise (Qwen2-VL's leading axis is patches)."""
        return tuple(shape) if self.batch_sizes == (1,) else (size,) + tuple(shape[1:])

    def _key(self, shapes: dict, size: int) -> tuple:
        return ("encode", size) + tuple(sorted((name, self._batched(shape, size), np.dtype(dtype).name)
                                                for name, (shape, dtype) in shapes.items()))

    def _executable(self, shapes: dict, size: int = 1):
        """The encode of `size` images whose inputs have `shapes` ({name: (shape, dtype)}, batch 1),
        once the start-up compiles are done (an unexpected shape compiles now, with a warning)."""
        key = self._key(shapes, size)
        if key not in self._executables:
            self._compiled.wait()
            if self._compile_error is not None:
                raise RuntimeError(f"the image encoder failed to compile at start-up ({self._compile_error!r}): "
                                   "requests with images cannot run") from self._compile_error
            if key not in self._executables:
                logger.warning("compiling an encoder for unexpected image input shapes %s", key)
                self._compile(shapes, size)
        return self._executables[key]

    def _compile(self, shapes: dict, size: int):
        key = self._key(shapes, size)
        if key not in self._executables:
            rep = self.runner._replicated
            args = {name: jax.ShapeDtypeStruct(self._batched(shape, size), dtype, sharding=rep)
                    for name, (shape, dtype) in shapes.items()}
            rows = jax.ShapeDtypeStruct(() if self.batch_sizes == (1,) else (size,), np.int32, sharding=rep)
            self._executables[key] = self.runner.executable_cache.compile(repr(key), self._jitted,
                                                                          (self._state_avals, args, rows))

    @property
    def num_compilations(self) -> int:
        self._compiled.wait()  # (the start-up's count, whenever asked)
        return len(self._executables)

    # ------------------------------------------------------------------ requests
    def process(self, prompt: str | list[int], images: list) -> ProcessedPrompt:
        """A prompt (text, or token ids: vLLM's prompt_token_ids) and its PIL images ->
        ProcessedPrompt (ValueError naming the field otherwise; the caller checks
        limit_mm_per_prompt first: RequestValidator.check_images)."""
        if self.processor is None:
            raise ValueError("multi_modal_data: the checkpoint has no processor (processor_config.json) to read images with")
        model_hooks = (self.model.num_image_tokens, getattr(self.model, "pixel_inputs", None),
                       getattr(self.model, "encoder_output_rows", None))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return process_token_prompt(self.processor, self.hf_config, prompt, images, *model_hooks)
        return process_prompt(self.processor, self.hf_config, prompt, images, *model_hooks)

    def attach(self, group, processed: ProcessedPrompt, whole_images: bool = False):
        """Give the just-added group its images: the pixel inputs on the group, the ranges and
        hashes on its sequence (forks copy them). `whole_images`: no prefill chunk ends inside
        one of its images (disable_chunked_mm_input; encoder_budget.py)."""
        group.mm_items = processed.items
        group.disable_chunked_mm_input = whole_images
        group.encoder_cache_rows = self.cache.num_rows  # (the scheduler's encoder budget: encoder_budget.py)
        group.prompt = processed.prompt
        for seq in group.seqs:
            seq.mm_ranges = processed.mm_ranges

    # ------------------------------------------------------------------ steps
    def prepare(self, batch):
        """Encode the images the step's chunks cover (those not cached) and point their
        placeholder tokens at the cache rows. Called after the StepBatch is built, before dispatch."""
        pinned, todo = set(), []
        for scheduled, first, _ in batch.groups:
            items = getattr(scheduled.seq_group, "mm_items", None)
            if not items:
                continue
            for j in range(first, first + len(scheduled.seqs)):
                start, ids = batch.start_pos[j], batch.token_ids[j]
                end = start + len(ids)
                hits = [item for item in items if item.offset < end and start < item.offset + item.length]
                if hits:
                    todo.append((j, hits))
                    pinned.update(item.mm_hash for item in hits)
        if not todo:
            return
        rows, missing = self._rows([item for _, hits in todo for item in hits], pinned)
        for j, hits in todo:
            start, ids = batch.start_pos[j], list(batch.token_ids[j])
            for item in hits:
                lo, hi = max(start, item.offset), min(start + len(ids), item.offset + item.length)
                base = self.vocab_size + rows[item.mm_hash] - item.offset
                ids[lo - start:hi - start] = range(base + lo, base + hi)
            batch.token_ids[j] = ids
        if missing:
            self._encode(missing)

    def step_inputs(self, batch, inputs):
        """The step's inputs (numpy, prepare_step's) with what images change in them: M-RoPE
        positions (`uses_mrope`: Qwen2-VL), key limits (`is_mm_prefix_lm`: Gemma 3; mm_prefix.py)."""
        if getattr(self.model, "uses_mrope", False):
            inputs = with_mrope_positions(self.model, batch, inputs)
        if getattr(self.model, "is_mm_prefix_lm", False):
            inputs = with_key_limits(batch, inputs)
        return inputs

    def _rows(self, items: list, pinned: set) -> tuple[dict, list]:
        """The step's images' first rows {mm_hash: row}, and the (item, row) pairs to encode:
        those not cached, in rows freed of the least recently used others. Should the free rows
        be too scattered for one (images of different sizes), the cache starts over with this
        step's images alone, from row 0 up, all encoded again: the scheduler's budget keeps them
        within its rows."""
        needed = {item.mm_hash: item for item in items}
        rows, missing = {}, []
        try:
            for mm_hash, item in needed.items():
                row = self.cache.lookup(mm_hash)
                if row is None:
                    row = self.cache.allocate(mm_hash, item.rows, pinned)
                    missing.append((item, row))
                rows[mm_hash] = row
        except EncoderCacheFull:
            logger.info("encoder cache fragmented: re-encoding the step's %d images from row 0", len(needed))
            self.cache.clear()
            rows = {mm_hash: self.cache.allocate(mm_hash, item.rows, set()) for mm_hash, item in needed.items()}
            missing = [(item, rows[mm_hash]) for mm_hash, item in needed.items()]
        return rows, missing

    def _encode(self, missing: list):
        """Encode (item, row) pairs into their rows: images of one shape together, in batches of
        `batch_sizes` (the last padded with zeros and written nowhere)."""
        by_shape = {}
        for item, row in missing:
            shapes = {name: (value.shape, value.dtype) for name, value in item.pixel_inputs.items()}
            by_shape.setdefault(self._key(shapes, 1), (shapes, []))[1].append((item, row))
        most = self.batch_sizes[-1]
        for shapes, pairs in by_shape.values():
            for at in range(0, len(pairs), most):
                part = pairs[at:at + most]
                self.num_encodes += len(part)
                if self.batch_sizes == (1,):
                    (item, row), = part
                    self._run(self._executable(shapes), item.pixel_inputs, np.int32(row))
                    continue
                size = next(b for b in self.batch_sizes if b >= len(part))
                pad = size - len(part)
                inputs = {name: np.concatenate([item.pixel_inputs[name] for item, _ in part]
                                               + [np.zeros((pad,) + shape[1:], dtype)] * bool(pad))
                          for name, (shape, dtype) in shapes.items()}
                rows = np.array([row for _, row in part] + [-1] * pad, np.int32)
                self._run(self._executable(shapes, size), inputs, rows)

    def _run(self, executable, inputs: dict, rows):
        """One encode call, the runner's state donated to it. Should it fail after taking the
        weights, the KV pages go too, so that the engine sees a dead runner (ModelRunner.is_alive)
        rather than failing every later step."""
        runner = self.runner
        try:
            runner.state = executable(runner.state, inputs, rows)
        except Exception:
            if any(x.is_deleted() for x in jax.tree.leaves(runner.state) if isinstance(x, jax.Array)):
                for pages in jax.tree.leaves(runner.kv_cache):
                    if isinstance(pages, jax.Array) and not pages.is_deleted():
                        pages.delete()
            raise

    def reset(self):
        """Forget every cached image (weights changed: their embeddings are stale)."""
        self.cache.clear()


def encoder_memory(loaded, probe) -> list:
    """The image encoder's executables' device memory (runner/step_memory.StepMemory each),
    compiled on the memory plan's abstract runner `probe` (engine/start_up.measure_step_memory):
    the KV pool is sized after the largest of these too. [] for a text-only model."""
    if not is_multimodal(loaded.model):
        return []
    from jpaged.runner.step_memory import StepMemory

    mm = MultimodalEngine(loaded, probe, background=False)
    if mm._compile_error is not None:
        raise mm._compile_error
    held = sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(probe.state))  # (the weights and the encoder cache: resident)
    return [StepMemory(key, stats.argument_size_in_bytes, stats.output_size_in_bytes, stats.alias_size_in_bytes,
                       stats.temp_size_in_bytes, held)
            for key, stats in ((key, executable.memory_analysis()) for key, executable in mm._executables.items())]


PROMPT_KEYS = {"prompt", "prompt_token_ids", "multi_modal_data"}


def add_request(mm: "MultimodalEngine | None", engine, request_id: str, prompt, sampling_params, arrival_time=None,
                lora_request=None):
    """LLMEngine.add_request for a prompt that is neither a str nor token ids: vLLM's dict
    ({"prompt": ..., "multi_modal_data": {"image": PIL image or list}}, or {"prompt_token_ids": ...})
    or a ProcessedPrompt (the server processes images off its event loop). `mm`: the engine's
    multimodal path, None for a text-only model (an image is then a ValueError)."""
    if isinstance(prompt, dict):
        unknown = sorted(set(prompt) - PROMPT_KEYS)
        if unknown:
            raise ValueError(f"prompt: unknown key(s) {unknown}; expected {sorted(PROMPT_KEYS)}")
        data = prompt.get("multi_modal_data") or {}
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError("multi_modal_data: expected {'image': a PIL image or a list of them}")
        text = prompt.get("prompt", prompt.get("prompt_token_ids"))
        images = data.get("image")
        if images is None:
            return engine.add_request(request_id, text, sampling_params, arrival_time, lora_request)
        if mm is None:
            raise ValueError("multi_modal_data: this model takes no images (a text-only model)")
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        images = [check_image(image, f"multi_modal_data.image[{i}]", MediaOptions().max_pixels)
                  for i, image in enumerate(images)]
        engine.request_validator.check_images(len(images))
        prompt = mm.process(text, images)
    if not isinstance(prompt, ProcessedPrompt):
        raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")
    if mm is None:
        raise ValueError("multi_modal_data: this model takes no images (a text-only model)")
    engine.request_validator.check_images(len(prompt.items))
    # Gemma 3's image tokens attend to each other both ways: each image is computed in one chunk.
    whole = bool(getattr(mm.model, "is_mm_prefix_lm", False) or engine.config.disable_chunked_mm_input)
    if whole:
        engine.request_validator.check_whole_images([item.length for item in prompt.items],
                                                    engine.scheduler.max_num_batched_tokens)
    engine.add_request(request_id, prompt.token_ids, sampling_params, arrival_time, lora_request)
    mm.attach(engine._groups[request_id], prompt, whole)  # (this thread added it: no step has seen it yet)
