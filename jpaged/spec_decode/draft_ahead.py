"""The draft model's drafts, computed right after the target step that sampled (vLLM v1's order;
the host's side, shared with the EAGLE head, is ahead.py): the next step's drafts are on the
device when its tokens are, and come back with them.

`draft_ahead` (device, dispatched right after the target step's sampler, with no host read in
between, on ahead.py's `ahead_inputs` for the step's speculating sequences): the accepted count
(rows whose sampled token equals the next draft, as Scheduler._accept counts them), hence the
sequence's new last token (the token sampled at the row after the accepted drafts) and its
position; from there, the draft model's k decode steps, each fed the token the step before
drew. Its output per sequence: the k drafts and the new last token's position, by which the
host knows, when it schedules the next step, whether the drafts follow the sequence as it now
stands.

Each draft row samples as the synchronous path did before it (a decode step of the draft from
the sequence's last token, the draft rows keyed as the target's): with the key of the target's
row at that output position, (the request's seed, its seq_index, the output position) and the
request's temperature and top-k/p/min-p (not its penalties, bans or grammar), so where the two
models agree the draft is the very token the target draws (greedy: argmax). The output
position depends on the accepted count, known on the device only: the host sends the first
draft's position with none accepted (the sequence's output length as dispatched, plus one) and
the device adds the accepted count.

The draft's K/V entries from the new last token's position on lie past the blocks the step
holds: they go to scratch blocks of the draft's pool past the target's block ids
(ahead.scratch_tables: `blocks_per_seq` per row, the first a copy of the real block holding the
entries before them). The real pages stay as the step's K/V forward (`forward_kv`) left them;
the next step's writes the entries at its tokens, as before.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.config import MAX_LOGPROBS
from jpaged.models.forward_context import AttentionMetadata
from jpaged.runner import sampler
from jpaged.runner.input_batch import layout_of, pack, unpack
from jpaged.runner.model_runner import ModelRunner
from jpaged.runner.step_functions import StepInputs, _model_logits
from jpaged.spec_decode.ahead import accepted_count, scratch_blocks_per_seq, scratch_tables


def draft_ahead(graphdef, logits_sharding, state, kv_cache, tokens, block_table, packed, *, layout, num_layers: int,
                num_steps: int, block_size: int, scratch_base: int, blocks_per_seq: int):
    """The next step's drafts (see the module's doc). `tokens` int32[max rows]: the target
    step's sampled tokens by sampling row (`ahead_tokens`); `block_table` the target's device
    table; `packed`: ((table_rows int32[seqs]: each row's row in it, verify_rows int32[seqs,
    k + 1]: the sampling rows at its last token and its drafts, drafts int32[seqs, k]: the
    step's drafts, the first `num_drafts` real, first_pos int32[seqs]: the position of its last
    token before the drafts, -1: padding, fixed int32[seqs]: the new last token if the host
    knows it (a prompt's last token, ahead.ahead_inputs' prompt_tail), else -1), the draft rows'
    SamplingMetadata, sample_index the first draft's output position with no draft accepted).
    Returns int32[num_steps + 1, seqs]: the drafts, then the new last token's position (-1:
    padding), and the draft's pool."""
    (table_rows, verify_rows, drafts, num_drafts, first_pos, fixed), meta = unpack(packed, layout)
    num_seqs = drafts.shape[0]
    live = first_pos >= 0
    seq_index = jnp.arange(num_seqs, dtype=jnp.int32)
    accepted = accepted_count(tokens, verify_rows, drafts, num_drafts)
    token = jnp.where(fixed >= 0, fixed, tokens[verify_rows[seq_index, accepted]])
    positions = jnp.where(live, first_pos + accepted + 1, -1)
    kv_cache, tables, slots_of = scratch_tables(num_layers, kv_cache, block_table, table_rows, positions,
                                                block_size=block_size, scratch_base=scratch_base,
                                                blocks_per_seq=blocks_per_seq)
    max_len = tables.shape[1] * block_size
    base, sample_index = jnp.maximum(positions, 0), meta.sample_index + accepted
    query_start_loc = jnp.arange(num_seqs + 1, dtype=jnp.int32)

    def one_step(carry, j):
        kv_cache, token = carry
        pos = base + j
        attn = AttentionMetadata(slots_of(pos), tables, jnp.where(live, jnp.minimum(pos + 1, max_len), 0),
                                 query_start_loc, True)
        logits, kv_cache = _model_logits(graphdef, logits_sharding, state, kv_cache,
                                         StepInputs(token, pos, attn, seq_index, None))
        out = sampler.sample(logits, dataclasses.replace(meta, sample_index=sample_index + j))
        return (kv_cache, out.token_ids), out.token_ids

    (kv_cache, _), later = jax.lax.scan(one_step, (kv_cache, token), jnp.arange(num_steps))
    return jnp.concatenate([later, positions[None]]), kv_cache


def ahead_tokens(sampled, *, rows: int, max_rows: int):
    """A target step's sampled tokens (the first `rows` entries of its packed sampler output,
    step_functions.pack_output) padded to `max_rows`: one draft_ahead executable per decode
    bucket, whatever the step's rows and sampler."""
    return jnp.pad(sampled[:rows], (0, max_rows - rows))


class DraftRunner(ModelRunner):
    """The draft model's pages, weights and executables: a ModelRunner (its K/V-only forward over
    every target step, block copies and swaps as the target's) whose pool has `draft_ahead`'s
    scratch blocks past the target's block ids (`scratch_base` on, `blocks_per_seq` per row),
    and the executables of the drafts after each step: ("draft_ahead", seqs) per decode bucket,
    ("ahead_tokens", size, rows) per sampler output the target's steps make."""

    def __init__(self, loaded, kv_cache_spec, num_steps: int, executable_cache, **shape):
        blocks_per_seq = scratch_blocks_per_seq(num_steps, kv_cache_spec.block_size)
        self.blocks_per_seq, self.scratch_base = blocks_per_seq, shape["num_gpu_blocks"]
        shape = {**shape, "num_gpu_blocks": shape["num_gpu_blocks"] + shape["max_num_seqs"] * blocks_per_seq}
        super().__init__(loaded, kv_cache_spec, **shape, executable_cache=executable_cache)
        self.num_draft_steps = num_steps
        self.max_rows = self.buckets.rows[-1]  # (the target's ladder: the same shape)
        rep, pool = self._replicated, jax.tree.map(lambda x: x.sharding, self.kv_cache)
        # (closures over values, not the runner: step_functions.layout_jits says why)
        self.ahead_options = dict(num_layers=self.num_layers, num_steps=num_steps, block_size=self.block_size,
                                  scratch_base=self.scratch_base, blocks_per_seq=blocks_per_seq)
        ahead = functools.partial(draft_ahead, self.graphdef, rep, **self.ahead_options)
        self._ahead = lambda layout: jax.jit(functools.partial(ahead, layout=layout), donate_argnums=(1,),
                                             out_shardings=(rep, pool))
        max_rows = self.max_rows
        self._tokens = lambda rows: jax.jit(functools.partial(ahead_tokens, rows=rows, max_rows=max_rows),
                                            out_shardings=rep)

    def ahead_keys(self):
        for rows in self.buckets.rows:  # the target's sampler outputs: fast, full (step_functions.pack_output)
            for size in (3 * rows, rows * (3 + 2 * min(MAX_LOGPROBS, self.vocab_size))):
                yield ("ahead_tokens", size, rows)
        for seqs in self.buckets.decode_tokens:
            yield ("draft_ahead", seqs)

    def ahead_metadata(self, seqs: int) -> sampler.SamplingMetadata:
        """The draft rows' sampler arrays of a call of `seqs` rows: the padding's (greedy), to fill."""
        return self.sampling_metadata(None, seqs, False)

    def _jitted_and_args(self, key):
        i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32, sharding=self._replicated)
        if key[0] == "ahead_tokens":
            return self._tokens(key[2]), (i32((key[1],)),)
        if key[0] == "draft_ahead":
            layout = layout_of(self._ahead_host_inputs(key[1]))
            return self._ahead(layout), (self.state, self.kv_cache, i32((self.max_rows,)), self.block_table,
                                         i32((layout.size,)))
        return super()._jitted_and_args(key)

    def _ahead_host_inputs(self, seqs: int):
        k = self.num_draft_steps
        rows = tuple(np.zeros(shape, np.int32) for shape in ((seqs,), (seqs, k + 1), (seqs, k), (seqs,), (seqs,)))
        return rows + (np.zeros(seqs, np.int32),), self.ahead_metadata(seqs)  # (+ fixed: pack_ahead)

    def run_ahead(self, sampled, rows: int, seqs: int, packed: np.ndarray, block_table):
        """`draft_ahead` over the target step whose packed sampler output is `sampled` (its
        `rows` sampling rows), for `seqs` rows (a decode bucket), reading the target's
        `block_table`: its output stays on the device."""
        tokens = self._executable(("ahead_tokens", sampled.shape[0], rows))(sampled)
        out, self.kv_cache = self._executable(("draft_ahead", seqs))(self.state, self.kv_cache, tokens, block_table,
                                                                       packed)
        return out


def pack_ahead(runner: DraftRunner, part, target_batch) -> np.ndarray:
    """One chunk of ahead.AheadInputs as draft_ahead's packed input: its arrays and the draft
    rows' sampler arrays, each row's knobs (key and temperature / top-k/p / min-p) from the
    target's InputBatch row (`target_batch`, padding: its neutral row), its first sample index
    the first draft's output position with none accepted."""
    table_rows = part.arrays[0]
    meta = runner.ahead_metadata(len(table_rows))
    meta = dataclasses.replace(
        meta, temperature=target_batch.temperature[table_rows], top_k=target_batch.top_k[table_rows],
        top_p=target_batch.top_p[table_rows], min_p=target_batch.min_p[table_rows],
        seeds=target_batch.seeds[table_rows], seq_index=target_batch.seq_index[table_rows],
        sample_index=part.first_sample)
    return pack((part.arrays + (part.fixed_tokens,), meta))
