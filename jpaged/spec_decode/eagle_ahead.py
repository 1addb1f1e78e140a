"""The EAGLE head's draft chain, run right after the target step that sampled (vLLM v1's order):
the next step's drafts are on the device when its tokens are, and come back with them.

`ahead_inputs` (host, at the step's dispatch, from the plan and the runner's `last_prepared`):
for each lone speculating sequence whose last token of the step has a sampling row, the rows
that verify its drafts (the last token's and each draft's) and those drafts. `chain_ahead`
(device, dispatched right after the step's sampler and the head's `fill`, with no host read in
between): the accepted count (rows whose sampled token equals the next draft, as
Scheduler._accept counts them), hence the row that sampled the sequence's new last token; from
that row's midlayer output and first draft, k - 1 more midlayer steps give the rest. Its output
per sequence: the k drafts and the new last token's position, by which the host knows, when it
schedules the next step, whether the drafts follow the sequence as it now stands (a sequence
that finished, was preempted or aborted meanwhile takes none).

The chain's own K/V entries (the new last token's position on) lie past the blocks the step
holds: they go to scratch blocks of the head's pool, past the target's block ids (`blocks_per_seq`
per chain row), the first a copy of the real block holding the entries before them. The real
pages stay as the fill left them; the next step's fill writes the entries at its tokens.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.models.forward_context import AttentionMetadata, ForwardContext, forward_context
from jpaged.runner import kv_transfer
from jpaged.runner.buckets import fit


def scratch_blocks_per_seq(num_steps: int, block_size: int) -> int:
    """Blocks spanned by `num_steps` positions starting anywhere in a block (0: no chain steps)."""
    return 0 if num_steps == 0 else (block_size - 1 + num_steps - 1) // block_size + 1


def chain_ahead(graphdef, state, shared, kv_cache, rows_state, block_table, table_rows, verify_rows, drafts,
                num_drafts, first_pos, *, num_steps: int, block_size: int, scratch_base: int, blocks_per_seq: int):
    """The next step's drafts of the chain rows (see the module's doc): `rows_state` the head's
    last fill (each sampling row's midlayer output, first draft and sampled token);
    `block_table` the target's device table, `table_rows` each row's row in it; `verify_rows`
    int32[seqs, k + 1] the sampling rows at its last token and its drafts, `drafts` int32[seqs, k]
    the step's drafts (the first `num_drafts` real), `first_pos` the position of its last token
    before the drafts (-1: padding). Returns int32[1 + num_steps + 1, seqs]: the drafts, then
    the new last token's position (-1: padding), and the head's pool."""
    outs, first_drafts, tokens = rows_state
    num_seqs, k = drafts.shape
    live = first_pos >= 0
    seq_index = jnp.arange(num_seqs, dtype=jnp.int32)
    ok = (tokens[verify_rows[:, :k]] == drafts) & (jnp.arange(k, dtype=jnp.int32)[None] < num_drafts[:, None])
    accepted = jnp.cumprod(ok.astype(jnp.int32), axis=1).sum(axis=1).astype(jnp.int32)
    row = verify_rows[seq_index, accepted]
    positions = jnp.where(live, first_pos + accepted + 1, -1)
    hidden, draft = outs[row], first_drafts[row]
    if num_steps == 0:  # k = 1: the first draft alone
        return jnp.stack([draft, positions]), kv_cache
    # Scratch blocks from the new last token's block on (the first a copy of the real one).
    tables = block_table[table_rows]
    width = tables.shape[1]
    start = jnp.maximum(positions, 0) // block_size
    scratch = scratch_base + seq_index[:, None] * blocks_per_seq + jnp.arange(blocks_per_seq, dtype=jnp.int32)[None]
    src = jnp.where(live & (start < width), tables[seq_index, jnp.minimum(start, width - 1)], -1)
    kv_cache = kv_transfer.copy_blocks(1, kv_cache, src, jnp.where(src >= 0, scratch[:, 0], -1))
    offset = jnp.arange(width, dtype=jnp.int32)[None] - start[:, None]
    tables = jnp.where((offset >= 0) & (offset < blocks_per_seq),
                       jnp.take_along_axis(scratch, jnp.clip(offset, 0, blocks_per_seq - 1), axis=1), tables)
    head = nnx.merge(graphdef, state, shared)
    base = jnp.maximum(positions, 0)

    def one_step(carry, j):
        kv_cache, hidden, draft = carry
        pos = base + j
        block = pos // block_size
        slots = jnp.where(live & (block < width),
                          tables[seq_index, jnp.minimum(block, width - 1)] * block_size + pos % block_size, -1)
        attn = AttentionMetadata(slots, tables, jnp.where(live, jnp.minimum(pos + 1, width * block_size), 0),
                                 jnp.arange(num_seqs + 1, dtype=jnp.int32), True, jnp.int32(0))
        with forward_context(ForwardContext(attn=attn)):
            hidden, kv_cache = head.step(draft, hidden, pos, kv_cache)
        draft = head.draft(hidden)
        return (kv_cache, hidden, draft), draft

    (kv_cache, _, _), later = jax.lax.scan(one_step, (kv_cache, hidden, draft), jnp.arange(num_steps))
    return jnp.concatenate([draft[None], later, positions[None]]), kv_cache


@dataclasses.dataclass
class AheadInputs:
    """One chunk of chain rows: whose (seq ids) and the host arrays `chain_ahead` takes."""
    seq_ids: list
    arrays: tuple  # (table_rows, verify_rows, drafts, num_drafts, first_pos), padded to a decode bucket


def ahead_inputs(dispatched, step, input_batch, k: int, buckets) -> list[AheadInputs]:
    """The chain rows of a dispatched step (one batch: `step` its runner's `last_prepared`), in
    chunks of at most the largest decode bucket, each padded to a decode bucket."""
    inputs, n = step.inputs, len(step.rows)
    seq_index = {int(r): i for i, r in enumerate(step.rows)}
    qsl, li, positions = inputs.attn.query_start_loc, inputs.logits_indices[:step.num_rows], inputs.positions
    row_at = {}  # token -> its last sampling row
    for r, token in enumerate(li.tolist()):
        row_at[token] = r
    found = []
    for scheduled, _, _ in dispatched.results:
        group = scheduled.seq_group
        if len(group.seqs) != 1 or not group.needs.speculate:
            continue
        seq = group.seqs[0]
        j = seq_index.get(input_batch.row_of.get(seq.seq_id, -1))
        if j is None or j >= n:
            continue
        drafts = list(scheduled.spec_token_ids)
        first = int(qsl[j + 1]) - 1 - len(drafts)
        rows = [row_at.get(t) for t in range(first, int(qsl[j + 1]))]
        if first < int(qsl[j]) or None in rows or len(drafts) > k:
            continue
        found.append((seq.seq_id, int(step.rows[j]), rows, drafts, int(positions[first])))
    chunk, out = buckets.decode_tokens[-1], []
    for start in range(0, len(found), chunk):
        part = found[start:start + chunk]
        seqs = fit(buckets.decode_tokens, len(part))
        table_rows = np.full(seqs, input_batch.max_rows, np.int32)  # (the padding row: zeros)
        verify = np.zeros((seqs, k + 1), np.int32)
        drafts = np.full((seqs, k), -1, np.int32)
        num_drafts = np.zeros(seqs, np.int32)
        first_pos = np.full(seqs, -1, np.int32)
        for i, (_, table_row, rows, tokens, pos) in enumerate(part):
            table_rows[i], first_pos[i], num_drafts[i] = table_row, pos, len(tokens)
            verify[i, :len(rows)] = rows
            verify[i, len(rows):] = rows[-1]
            drafts[i, :len(tokens)] = tokens
        out.append(AheadInputs([p[0] for p in part], (table_rows, verify, drafts, num_drafts, first_pos)))
    return out

