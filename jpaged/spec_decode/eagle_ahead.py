"""The EAGLE head's draft chain, run right after the target step that sampled (vLLM v1's order;
the host's side, shared with the draft model, is ahead.py): the next step's drafts are on the
device when its tokens are, and come back with them.

`chain_ahead` (device, dispatched right after the step's sampler and the head's `fill`, with no
host read in between, on ahead.py's `ahead_inputs`): the accepted count (rows whose sampled
token equals the next draft, as Scheduler._accept counts them), hence the row that sampled the
sequence's new last token; from that row's midlayer output and first draft, k - 1 more midlayer
steps give the rest. Its output per sequence: the k drafts and the new last token's position,
by which the host knows, when it schedules the next step, whether the drafts follow the
sequence as it now stands (a sequence that finished, was preempted or aborted meanwhile takes none).

The chain's own K/V entries (the new last token's position on) lie past the blocks the step
holds: they go to scratch blocks of the head's pool, past the target's block ids (`blocks_per_seq`
per chain row, ahead.scratch_tables), the first a copy of the real block holding the entries
before them. The real pages stay as the fill left them; the next step's fill writes the entries
at its tokens.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jpaged.models.forward_context import AttentionMetadata, ForwardContext, forward_context
from jpaged.spec_decode.ahead import accepted_count, scratch_tables


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
    num_seqs = drafts.shape[0]
    live = first_pos >= 0
    seq_index = jnp.arange(num_seqs, dtype=jnp.int32)
    accepted = accepted_count(tokens, verify_rows, drafts, num_drafts)
    row = verify_rows[seq_index, accepted]
    positions = jnp.where(live, first_pos + accepted + 1, -1)
    hidden, draft = outs[row], first_drafts[row]
    if num_steps == 0:  # k = 1: the first draft alone
        return jnp.stack([draft, positions]), kv_cache
    # Scratch blocks from the new last token's block on (the first a copy of the real one).
    kv_cache, tables, slots_of = scratch_tables(1, kv_cache, block_table, table_rows, positions, block_size=block_size,
                                                scratch_base=scratch_base, blocks_per_seq=blocks_per_seq)
    width = tables.shape[1]
    head = nnx.merge(graphdef, state, shared)
    base = jnp.maximum(positions, 0)

    def one_step(carry, j):
        kv_cache, hidden, draft = carry
        pos = base + j
        attn = AttentionMetadata(slots_of(pos), tables, jnp.where(live, jnp.minimum(pos + 1, width * block_size), 0),
                                 jnp.arange(num_seqs + 1, dtype=jnp.int32), True, jnp.int32(0))
        with forward_context(ForwardContext(attn=attn)):
            hidden, kv_cache = head.step(draft, hidden, pos, kv_cache)
        draft = head.draft(hidden)
        return (kv_cache, hidden, draft), draft

    (kv_cache, _, _), later = jax.lax.scan(one_step, (kv_cache, hidden, draft), jnp.arange(num_steps))
    return jnp.concatenate([draft[None], later, positions[None]]), kv_cache
