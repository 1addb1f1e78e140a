"""The device side of a step, the functions the runner jits: the model forward (new K/V and the
logits of the rows to sample), the sampler on packed metadata, the multi-step decode loop, the
token-history upload, the LoRA slot write, and the packing of the sampler's outputs into one
int32 array (and back)."""

import contextlib
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.models.forward_context import (MODEL_OUTPUT, AttentionMetadata, ForwardContext, capture_hidden_states,
                                          forward_context)
from jpaged.runner import sampler
from jpaged.runner.input_batch import Layout, unpack


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["rows", "prompt_lens", "lens", "dst_rows"], meta_fields=[])
@dataclasses.dataclass
class HistoryInputs:
    """Where each sampling row's penalty tokens are in the device's token history (full sampler)."""

    rows: np.ndarray  # int32[sampling rows]: the history row of the row's sequence (-1: no penalties)
    prompt_lens: np.ndarray  # int32[sampling rows]: its first tokens are the prompt's ...
    lens: np.ndarray  # int32[sampling rows]: ... and the rest, up to here, the outputs so far
    dst_rows: np.ndarray  # int32[sampling rows]: append the sampled token to this history row (-1: no)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["input_ids", "positions", "attn", "logits_indices", "src_rows", "lora_slots",
                                "table_rows"],
                   meta_fields=[])
@dataclasses.dataclass
class StepInputs:
    """One step's inputs. As sent, `attn.block_tables` is None and `table_rows` says which row of
    the runner's device block table (ModelRunner.block_table) each sequence reads; inside the
    step, `resolve` gathers those rows into attn.block_tables."""

    input_ids: jax.Array  # int32[tokens]
    positions: jax.Array  # int32[tokens]
    attn: AttentionMetadata
    logits_indices: jax.Array  # int32[rows]: token row whose logits each sampling row uses
    src_rows: jax.Array  # int32[tokens]: >= 0: the token is last_tokens[row] (sampled by a step in flight)
    lora_slots: jax.Array | None = None  # int32[tokens]: each token's LoRA slot, -1: none (with LoRA enabled)
    table_rows: jax.Array | None = None  # int32[seqs]: each sequence's block-table row (padding: a row of zeros)


def forward(graphdef, logits_sharding, state, kv_cache, packed, last_tokens, block_table, *, layout: Layout,
            return_hidden: bool | tuple = False, decode: bool = False):
    """The model's part of a step: write the new K/V, attend, and the fp32 logits of the rows to
    sample. They stay on the device for the sampler executable. `return_hidden` (static): also
    the final hidden states of those rows, [rows, hidden] (for a proposer that drafts from the
    target's hidden states, EAGLE-style); a tuple of layer ids: instead the hidden states
    entering those layers at every token, [tokens, len(ids) * hidden], with the step's input ids
    (pending ones resolved), as EAGLE-3 reads them (MODEL_OUTPUT: the model's output, EAGLE-1's);
    off, the executable is the one it always was. `decode` (static): every sequence has one new
    token (the host knows): the decode kernel alone, no branch on the device."""
    inputs = resolve(unpack(packed, layout), last_tokens, block_table)
    if decode:
        inputs = dataclasses.replace(inputs, attn=dataclasses.replace(inputs.attn, decode=True))
    if not isinstance(return_hidden, tuple):
        return _model_logits(graphdef, logits_sharding, state, kv_cache, inputs, return_hidden)
    layers = tuple(i for i in return_hidden if i != MODEL_OUTPUT)
    capture = capture_hidden_states(layers) if layers else contextlib.nullcontext({"states": None})
    with capture as captured:
        logits, kv_cache, output = _model_logits(graphdef, logits_sharding, state, kv_cache, inputs, "tokens")
    states = {MODEL_OUTPUT: output, **{i: captured["states"][j] for j, i in enumerate(layers)}}  # [tokens, hidden] each
    aux = jnp.concatenate([states[i] for i in return_hidden], axis=-1)
    return logits, kv_cache, (jax.lax.with_sharding_constraint(aux, logits_sharding), inputs.input_ids)


def forward_kv(graphdef, state, kv_cache, packed, last_tokens, block_table, *, layout: Layout):
    """A draft model's forward over the target's step (same packed inputs and the target's block
    table): only its new K/V, so that its pages hold every token the target's do (no logits: XLA
    drops the LM head)."""
    inputs = resolve(unpack(packed, layout), last_tokens, block_table)
    model = nnx.merge(graphdef, state)
    with forward_context(ForwardContext(attn=inputs.attn, lora_slots=inputs.lora_slots)):
        _, kv_cache = model(inputs.input_ids, inputs.positions, kv_cache)
    return kv_cache


def resolve(inputs: StepInputs, last_tokens, block_table) -> StepInputs:
    """The inputs as the model reads them: each pending token (sampled by a step in flight) read
    from last_tokens (None: none pending), and each sequence's block table gathered from the
    device's table by its row."""
    if last_tokens is not None:
        input_ids = jnp.where(inputs.src_rows >= 0, last_tokens[jnp.maximum(inputs.src_rows, 0)], inputs.input_ids)
        inputs = dataclasses.replace(inputs, input_ids=input_ids)
    if inputs.table_rows is None:
        return inputs
    attn = dataclasses.replace(inputs.attn, block_tables=block_table[inputs.table_rows])
    return dataclasses.replace(inputs, attn=attn, table_rows=None)


def write_block_table(block_table, rows, cols, values):
    """The device's block table with entries (rows, cols) set to `values`; row -1: skipped."""
    rows = jnp.where(rows < 0, block_table.shape[0], rows)
    return block_table.at[rows, cols].set(values, mode="drop")


def _model_logits(graphdef, logits_sharding, state, kv_cache, inputs: StepInputs, return_hidden: bool | str = False):
    """The logits of the rows to sample; `return_hidden` True: also those rows' final hidden
    states; "tokens": every token's."""
    model = nnx.merge(graphdef, state)
    with forward_context(ForwardContext(attn=inputs.attn, lora_slots=inputs.lora_slots)):  # what every layer may read of the step
        output, kv_cache = model(inputs.input_ids, inputs.positions, kv_cache)
    hidden = output[inputs.logits_indices]
    # Vocabulary-parallel logits are gathered: every device samples the same full rows.
    logits = jax.lax.with_sharding_constraint(model.compute_logits(hidden), logits_sharding)
    if return_hidden == "tokens":
        return logits, kv_cache, output
    if return_hidden:
        return logits, kv_cache, jax.lax.with_sharding_constraint(hidden, logits_sharding)
    return logits, kv_cache


def sample(logits, packed, last_tokens, token_history, *, layout: Layout):
    """The sampler on packed metadata; its outputs come back packed too (`pack_output`). Each
    row's token also goes to its `dst_rows` entry of last_tokens (-1: none), for the next step.
    The full sampler takes the penalties' tokens from the token history and appends to it."""
    meta, dst_rows, history = unpack(packed, layout)
    if history is not None and meta.do_penalties:  # (penalties first, as sampler.sample applies them)
        counts, in_prompt = history_counts(token_history, history, logits.shape[1])
        logits = sampler.penalize(logits.astype(jnp.float32), counts, in_prompt, meta)
        meta = dataclasses.replace(meta, do_penalties=False)
    out = sampler.sample(logits, meta)
    if history is not None:
        dst = jnp.where(history.dst_rows < 0, token_history.shape[0], history.dst_rows)
        token_history = token_history.at[dst, history.lens].set(out.token_ids, mode="drop")
    return pack_output(out), _keep_last_tokens(last_tokens, dst_rows, out.token_ids), token_history


# Token-history columns read at once by the penalties' counts: what a step holds besides the
# [rows, vocab] counts is [rows, HISTORY_CHUNK], whatever max_model_len is.
HISTORY_CHUNK = 4096


def history_counts(token_history, history: HistoryInputs, vocab_size: int):
    """Each sampling row's output token counts (int32[rows, vocab]) and prompt tokens
    (bool[rows, vocab]) from its token-history row, read HISTORY_CHUNK columns at a time (a scan
    of a fixed trip count: no host sync on a GPU), so that no [rows, max_model_len] array is made."""
    num_rows, width = history.rows.shape[0], token_history.shape[1]
    chunk = min(HISTORY_CHUNK, width)
    rows = jnp.maximum(history.rows, 0)
    used = (history.rows >= 0)[:, None]
    row_ids = jnp.arange(num_rows)[:, None]

    def one_chunk(carry, i):
        counts, in_prompt = carry
        start = jnp.minimum(i * chunk, width - chunk)  # (the last chunk may overlap the one before)
        pos = start + jnp.arange(chunk, dtype=jnp.int32)[None, :]
        tokens = token_history[rows[:, None], pos]  # [rows, chunk]
        new = used & (pos >= i * chunk)  # (columns an overlapping last chunk already counted: not again)
        prompt = new & (pos < history.prompt_lens[:, None])
        output = new & ~prompt & (pos < history.lens[:, None])
        drop = jnp.int32(vocab_size)
        counts = counts.at[row_ids, jnp.where(output, tokens, drop)].add(1, mode="drop")
        in_prompt = in_prompt.at[row_ids, jnp.where(prompt, tokens, drop)].set(True, mode="drop")
        return (counts, in_prompt), None

    init = (jnp.zeros((num_rows, vocab_size), jnp.int32), jnp.zeros((num_rows, vocab_size), jnp.bool_))
    (counts, in_prompt), _ = jax.lax.scan(one_chunk, init, jnp.arange(-(-width // chunk), dtype=jnp.int32))
    return counts, in_prompt


def write_history(token_history, rows, tokens):
    """Rows' token histories, their first tokens.shape[1] positions (-1 padded; the sampler reads
    a row only up to its sequence's length); row -1: skipped."""
    rows = jnp.where(rows < 0, token_history.shape[0], rows)
    return token_history.at[rows, :tokens.shape[1]].set(tokens, mode="drop")


def multi_step(graphdef, logits_sharding, state, kv_cache, packed, last_tokens, block_table, *, layout: Layout,
               num_steps: int):
    """`num_steps` decode steps (forward + fast sampler) in one call: each step's sampled tokens
    are the next one's inputs, at the next position, writing into the precomputed lookahead
    slots. Returns the steps' packed outputs, one after another."""
    inputs, meta, dst_rows, lookahead_slots = unpack(packed, layout)
    inputs = resolve(inputs, last_tokens, block_table)
    slots = jnp.concatenate([inputs.attn.slot_mapping[None], lookahead_slots])
    live = inputs.attn.context_lens > 0  # padding rows stay empty
    num_tokens = inputs.input_ids.shape[0]

    def one_step(carry, j):
        kv_cache, token_ids, _ = carry
        attn = dataclasses.replace(inputs.attn, slot_mapping=slots[j], decode=True,
                                   context_lens=jnp.where(live, inputs.attn.context_lens + j, 0))
        step = dataclasses.replace(inputs, input_ids=token_ids, positions=inputs.positions + j, attn=attn)
        logits, kv_cache = _model_logits(graphdef, logits_sharding, state, kv_cache, step)
        out = sampler.sample(logits, dataclasses.replace(meta, sample_index=meta.sample_index + j))
        return (kv_cache, out.token_ids[:num_tokens], out.token_ids), pack_output(out)

    num_rows = inputs.logits_indices.shape[0]
    carry = (kv_cache, inputs.input_ids, jnp.zeros(num_rows, jnp.int32))
    (kv_cache, _, sampled), outs = jax.lax.scan(one_step, carry, jnp.arange(num_steps))
    return outs.reshape(-1), kv_cache, _keep_last_tokens(last_tokens, dst_rows, sampled)


def _keep_last_tokens(last_tokens, dst_rows, token_ids):
    return last_tokens.at[jnp.where(dst_rows < 0, last_tokens.shape[0], dst_rows)].set(token_ids, mode="drop")


def pack_output(out: sampler.SamplerOutput) -> jax.Array:
    """One int32 array of [token_ids, logprobs, target_logprobs, top_ids, top_logprobs], float32s bitcast."""
    as_i32 = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int32)
    return jnp.concatenate([out.token_ids, as_i32(out.logprobs), as_i32(out.target_logprobs),
                            out.top_ids.reshape(-1), as_i32(out.top_logprobs).reshape(-1)])


class StepHandle(NamedTuple):
    """A dispatched step: its packed sampler output (a device array, maybe not ready yet)."""

    out: jax.Array
    num_rows: int  # padded sampling rows
    num_logprobs: int
    num_real_rows: int
    num_steps: int = 1  # a multi-step decode's steps


def unpack_output(packed: np.ndarray, num_rows: int, k: int, num_real: int) -> sampler.SamplerOutput:
    """`sample`'s packed output -> its SamplerOutput, the first `num_real` rows."""
    r = num_rows
    token_ids, logprobs, target = packed[:r], packed[r:2 * r].view(np.float32), packed[2 * r:3 * r].view(np.float32)
    top_ids = packed[3 * r:3 * r + r * k].reshape(r, k)
    top_logprobs = packed[3 * r + r * k:].view(np.float32).reshape(r, k)
    # Sampled ids and their logprobs as Python lists: the host reads them one by one.
    return sampler.SamplerOutput(token_ids[:num_real].tolist(), logprobs[:num_real].tolist(), top_ids[:num_real],
                                 top_logprobs[:num_real], target[:num_real])


def write_lora_slot(graphdef, paths, state, slot, weights):
    """The state with LoRA slot `slot` of each projection at `paths` set to `weights` ((A, B) each)."""
    model = nnx.merge(graphdef, state)
    for path, (a, b) in zip(paths, weights):
        linear = model
        for name in path:
            linear = linear[name] if isinstance(name, int) else getattr(linear, name)
        lead = linear.kernel.ndim - len(linear.in_shape) - len(linear.out_shape)
        index = (slice(None),) * lead + (slot,)
        linear.lora_a.set_value(linear.lora_a[...].at[index].set(a))
        linear.lora_b.set_value(linear.lora_b[...].at[index].set(b))
    return nnx.split(model)[1]


def layout_jits(graphdef, rep, pool, num_steps: int):
    """The runner's makers of its jitted functions by input layout (each called per executable
    key): the forward (`hidden`: False, or the hidden states a proposer reads: True, or the layers
    whose inputs EAGLE-3 reads, given at the call since a feature recorder sets them on a built
    runner), the sampler, the multi-step decode, and a draft's K/V-only forward. They close
    over these values, never over the runner: a closure over the runner is a reference cycle, and
    an engine freezes its heap out of the cyclic collector (engine/start_up.freeze_heap), so only
    reference counting frees a dropped engine's runner and its KV pool at once."""
    def forward_jit(layout, hidden, decode=False):
        return jax.jit(functools.partial(forward, graphdef, rep, layout=layout, decode=decode,
                                         return_hidden=hidden),
                       donate_argnums=(1,), out_shardings=(rep, pool, rep) if hidden else (rep, pool))

    def sample_jit(layout):
        return jax.jit(functools.partial(sample, layout=layout), out_shardings=(rep, rep, rep), donate_argnums=(2, 3))

    def multi_step_jit(layout):
        return jax.jit(functools.partial(multi_step, graphdef, rep, layout=layout, num_steps=num_steps),
                       donate_argnums=(1, 3), out_shardings=(rep, pool, rep))

    def kv_forward_jit(layout):
        return jax.jit(functools.partial(forward_kv, graphdef, layout=layout), donate_argnums=(1,), out_shardings=pool)

    return forward_jit, sample_jit, multi_step_jit, kv_forward_jit
