"""The per-step model context: what every layer may read about the step, set once per forward.

The step function sets it around the model call; LayerStack narrows it to each layer inside its
scan; Attention reads its attention metadata. A feature that needs per-token data deep in the
model (LoRA adapter ids in every projection, speculative positions) adds a field here instead of
an argument to every layer's signature. It holds traced arrays: it exists only while a step is
traced (a context variable, like vLLM's forward context).
"""

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["slot_mapping", "block_tables", "context_lens", "query_start_loc", "decode", "layer",
                                "key_limits"],
                   meta_fields=[])
@dataclasses.dataclass
class AttentionMetadata:
    """Where a step's tokens live in the KV pages (one entry per token or per sequence).

    slot_mapping: int32[tokens], page * page_size + offset of each new token (-1: padding).
    block_tables: int32[seqs, max_blocks], physical page of each logical block.
    context_lens: int32[seqs], tokens in pages after this step (cached + new); 0 for padding.
    query_start_loc: int32[seqs + 1], where each sequence's new tokens start in the token axis.
    decode: bool[] or None: every sequence has exactly one new token (traced, so decode and mixed
      steps share one executable); given only when the token and sequence axes have the same
      length, where the Pallas decode kernel can take the step. Python's True: the step is known
      to be a decode when tracing (multi-step decode): the Pallas backends run their decode
      kernel alone, with no cond.
    layer: int32 scalar, the decoder layer being run (set by the layer stack's scan), for the
      layers that differ by layer (Gemma's alternating local and global attention).
    key_limits: int32[tokens] or None: the last key each new token may see when past its own
      position (-1: causal), for models whose image tokens attend to each other both ways
      (`is_mm_prefix_lm`, Gemma 3: an image's tokens see up to its last token; vLLM's
      mm_prefix_range). None (every other model): causal prefill kernels, compiled as before.
      Decode kernels ignore it (a decoding token is never inside an image).
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array
    query_start_loc: jax.Array
    decode: jax.Array | None = None
    layer: jax.Array | None = None
    key_limits: jax.Array | None = None

    def for_layer(self, layer, pages_per_layer: int, page_size: int) -> "AttentionMetadata":
        """The same step in layer `layer`'s part of the stacked pool, whose page axis holds every
        layer's pages one layer after another (page p of layer l is page l * pages_per_layer + p)."""
        first_page = layer * pages_per_layer
        slots = jnp.where(self.slot_mapping < 0, -1, self.slot_mapping + first_page * page_size)
        return dataclasses.replace(self, slot_mapping=slots, block_tables=self.block_tables + first_page, layer=layer)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["attn", "lora_slots"], meta_fields=[])
@dataclasses.dataclass
class ForwardContext:
    attn: AttentionMetadata  # where the step's tokens live in the KV pages (this layer's, inside the stack)
    lora_slots: jax.Array | None = None  # int32[tokens]: each token's LoRA slot (-1: the base model)

    def replace(self, **changes) -> "ForwardContext":
        return dataclasses.replace(self, **changes)


_current: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("jpaged_forward_context",
                                                                                 default=None)


@contextlib.contextmanager
def forward_context(ctx: ForwardContext):
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def get_forward_context() -> ForwardContext:
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError("the model was called outside forward_context(...): the step sets it")
    return ctx


# EAGLE-3's auxiliary hidden states: a step that asks (capture_hidden_states) gets the residual
# stream entering each of the given decoder layers, at every token (LayerStack records it).
# In a step's list of layers (step_functions.forward), MODEL_OUTPUT stands for the model's output
# after its final norm, what the LM head reads: EAGLE-1/2's feature.
MODEL_OUTPUT = -1
_aux_capture: contextvars.ContextVar[dict | None] = contextvars.ContextVar("jpaged_aux_hidden", default=None)


@contextlib.contextmanager
def capture_hidden_states(layers: tuple[int, ...]):
    """Within: the model's layer stack records the hidden states entering `layers` into the
    yielded dict's "states" ([len(layers), tokens, hidden]); a traced value, read after the call."""
    capture = {"layers": tuple(layers), "states": None}
    token = _aux_capture.set(capture)
    try:
        yield capture
    finally:
        _aux_capture.reset(token)


def hidden_states_capture() -> dict | None:
    return _aux_capture.get()
