"""Drafts computed right after the target step that sampled (vLLM v1's order), shared by the
EAGLE head (eagle_ahead.py) and the draft model (draft_ahead.py): the next step's drafts are on
the device when its tokens are, and come back with them.

`ahead_inputs` (host, at the step's dispatch, from the plan and the runner's `last_prepared`):
for each lone speculating sequence whose last token of the step has a sampling row, the rows
that verify its drafts (the last token's and each draft's) and those drafts. The device call
(dispatched right after the step's sampler, with no host read in between) counts the accepted
drafts (`accepted_count`: rows whose sampled token equals the next draft, as
Scheduler._accept counts them), hence the row that sampled the sequence's new last token and
that token's position, and drafts from there. Its output per sequence: the k drafts and the new
last token's position, by which the host knows, when it schedules the next step, whether the
drafts follow the sequence as it now stands (a sequence that finished, was preempted, swapped
or aborted meanwhile takes none): `AheadProposer`'s `read_ahead` and `propose`.

The drafts' own K/V entries (the new last token's position on) lie past the blocks the step
holds: they go to scratch blocks of the proposer's pool, past the target's block ids
(`blocks_per_seq` per row, `scratch_tables`), the first a copy of the real block holding the
entries before them. The real pages stay as the step left them; the next step writes the
entries at its tokens.
"""

import dataclasses
import logging

import jax.numpy as jnp
import numpy as np

from jpaged.runner import kv_transfer
from jpaged.runner.buckets import fit
from jpaged.spec_decode.proposer import DRAFT_PENDING, RunnerProposer

logger = logging.getLogger(__name__)


def scratch_blocks_per_seq(num_steps: int, block_size: int) -> int:
    """Blocks spanned by `num_steps` positions starting anywhere in a block (0: no steps)."""
    return 0 if num_steps == 0 else (block_size - 1 + num_steps - 1) // block_size + 1


def accepted_count(tokens, verify_rows, drafts, num_drafts):
    """Each row's accepted drafts (device): while the token sampled at row verify_rows[:, j]
    equals drafts[:, j], among the first `num_drafts`."""
    k = drafts.shape[1]
    ok = (tokens[verify_rows[:, :k]] == drafts) & (jnp.arange(k, dtype=jnp.int32)[None] < num_drafts[:, None])
    return jnp.cumprod(ok.astype(jnp.int32), axis=1).sum(axis=1).astype(jnp.int32)


def scratch_tables(num_layers: int, kv_cache, block_table, table_rows, positions, *, block_size: int,
                   scratch_base: int, blocks_per_seq: int):
    """Each row's block table (from the target's device table, `table_rows` its row there) with
    the blocks from `positions`' block on replaced by the row's scratch blocks, the first a
    copy of the real one (positions -1: padding, no copy). Returns (the pool, the tables, a
    function of positions -> their slots (-1 past the table: no write))."""
    num_seqs = table_rows.shape[0]
    seq_index = jnp.arange(num_seqs, dtype=jnp.int32)
    live = positions >= 0
    tables = block_table[table_rows]
    width = tables.shape[1]
    start = jnp.maximum(positions, 0) // block_size
    scratch = scratch_base + seq_index[:, None] * blocks_per_seq + jnp.arange(blocks_per_seq, dtype=jnp.int32)[None]
    src = jnp.where(live & (start < width), tables[seq_index, jnp.minimum(start, width - 1)], -1)
    kv_cache = kv_transfer.copy_blocks(num_layers, kv_cache, src, jnp.where(src >= 0, scratch[:, 0], -1))
    offset = jnp.arange(width, dtype=jnp.int32)[None] - start[:, None]
    tables = jnp.where((offset >= 0) & (offset < blocks_per_seq),
                       jnp.take_along_axis(scratch, jnp.clip(offset, 0, blocks_per_seq - 1), axis=1), tables)

    def slots(pos):
        block = pos // block_size
        return jnp.where(live & (block < width),
                         tables[seq_index, jnp.minimum(block, width - 1)] * block_size + pos % block_size, -1)

    return kv_cache, tables, slots


@dataclasses.dataclass
class AheadInputs:
    """One chunk of rows: whose (seq ids) and the host arrays the device call takes."""
    seq_ids: list
    arrays: tuple  # (table_rows, verify_rows, drafts, num_drafts, first_pos), padded to a decode bucket
    # int32[seqs]: the first draft's output position with no draft accepted (the sequence's
    # output length as dispatched, + 1 after a sampled token)
    first_sample: np.ndarray
    # int32[seqs]: the new last token when the host knows it (a prompt's last token, left alone
    # for the next step by a prefill chunk: `prompt_tail`), else -1 (the token sampled)
    fixed_tokens: np.ndarray


def ahead_inputs(dispatched, step, input_batch, k: int, buckets, prompt_tail: bool = False) -> list[AheadInputs]:
    """The rows of a dispatched step (one batch: `step` its runner's `last_prepared`), in
    chunks of at most the largest decode bucket, each padded to a decode bucket. `prompt_tail`:
    also a sequence whose prefill chunk leaves one prompt token for the next step (which drafts
    from it, Speculator.propose), its drafts from that token."""
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
        end = int(qsl[j + 1]) - 1  # the sequence's last token in the step
        first = end - len(drafts)
        rows, fixed = [row_at.get(t) for t in range(first, end + 1)], -1
        if first < int(qsl[j]) or len(drafts) > k:
            continue
        if None in rows:
            if not prompt_tail or drafts or seq.num_pending_tokens or int(positions[end]) + 2 != seq.get_len():
                continue
            rows, fixed = [0], seq.get_last_token_id()
        found.append((seq.seq_id, int(step.rows[j]), rows, drafts, int(positions[first]),
                      seq.get_output_len() + (fixed < 0), fixed))
    chunk, out = buckets.decode_tokens[-1], []
    for start in range(0, len(found), chunk):
        part = found[start:start + chunk]
        seqs = fit(buckets.decode_tokens, len(part))
        table_rows = np.full(seqs, input_batch.max_rows, np.int32)  # (the padding row: zeros)
        verify = np.zeros((seqs, k + 1), np.int32)
        drafts = np.full((seqs, k), -1, np.int32)
        num_drafts = np.zeros(seqs, np.int32)
        first_pos = np.full(seqs, -1, np.int32)
        first_sample = np.zeros(seqs, np.int32)
        fixed_tokens = np.full(seqs, -1, np.int32)
        for i, (_, table_row, rows, tokens, pos, sample, fixed) in enumerate(part):
            table_rows[i], first_pos[i], num_drafts[i] = table_row, pos, len(tokens)
            first_sample[i], fixed_tokens[i] = sample, fixed
            verify[i, :len(rows)] = rows
            verify[i, len(rows):] = rows[-1]
            drafts[i, :len(tokens)] = tokens
        out.append(AheadInputs([p[0] for p in part], (table_rows, verify, drafts, num_drafts, first_pos),
                               first_sample, fixed_tokens))
    return out


class AheadProposer(RunnerProposer):
    """A proposer whose drafts for a step are computed on the device right after the step before
    (`after_dispatch`, from `ahead_inputs`), read with that step's tokens (`read_ahead`, into
    `ready`) and put in the next plan by `propose` with no device call. A subclass dispatches
    its device call (`dispatch_ahead`, through the target runner's dispatch_op, which returns
    int32[k + 1, seqs]: k drafts, then the new last token's position) and sets `k`."""

    k = 0
    label = "the proposer's"  # for the warnings
    prompt_tail = False  # ahead_inputs' prompt_tail: drafts from a prompt's last token left for the next step

    @staticmethod
    def chain_steps(k: int) -> int:
        """Positions the device call writes past the new last token's, in scratch (a draft model's
        k decode steps; an EAGLE head's first draft comes with the fill: k - 1)."""
        return k

    @classmethod
    def device_state_bytes(cls, model, *, max_num_seqs: int, max_model_len: int, num_speculative_tokens: int,
                           **shape) -> int:
        """Besides the runner's step state: the scratch blocks (max_num_seqs rows of
        `scratch_blocks_per_seq`), known before the pool is sized."""
        spec = model.kv_cache_spec
        scratch = max_num_seqs * scratch_blocks_per_seq(cls.chain_steps(num_speculative_tokens), spec.block_size)
        return (super().device_state_bytes(model, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
                + scratch * spec.bytes_per_block)

    def __init__(self):
        self.ahead = []  # (plan, [(seq ids, the call's output on the device)]) of dispatched steps not read yet
        self.ready = {}  # the last read step's drafts: seq_id -> (position of the token they follow, drafts)

    @property
    def scratch_blocks(self) -> int:
        """Blocks of the proposer's pool past the target's block ids (`scratch_base`): the
        drafts' scratch, max_num_seqs * blocks_per_seq."""
        return self.runner.num_gpu_blocks - self.runner.scratch_base

    def scratch_bytes_per_device(self) -> int:
        """The scratch blocks' bytes on each device, besides the blocks the pool's plan counts
        (the proposer's bytes per block times the target's num_gpu_blocks)."""
        return self.scratch_blocks * self.runner.kv_cache_spec.bytes_per_block

    def dispatch_ahead(self, part: AheadInputs, dispatched, runner):
        """One chunk's device call (no host read): its output on the device."""
        raise NotImplementedError

    def can_ahead(self, dispatched, runner) -> bool:
        """Whether `dispatched` (its one handle) can be drafted from."""
        return True

    def after_dispatch(self, dispatched, runner):
        """Right after a target step's dispatch: the next step's drafts from the tokens it
        samples, dispatched with no host read. Not after a step that skipped the hooks or
        speculation, nor one re-run group by group (a failed batch); if dispatching fails, the
        next step drafts nothing for those sequences."""
        self.ahead = [(plan, chunks) for plan, chunks in self.ahead if plan is not dispatched.plan][-1:]
        step = runner.last_prepared
        if step is None or dispatched.plan.spec_disabled or len(dispatched.handles) != 1 or not dispatched.results \
                or not self.can_ahead(dispatched, runner):
            return
        try:
            chunks = [(part.seq_ids, self.dispatch_ahead(part, dispatched, runner))
                      for part in ahead_inputs(dispatched, step, runner.input_batch, self.k, self.runner.buckets,
                                                 self.prompt_tail)]
        except Exception as e:
            if not runner.is_alive():
                raise
            logger.warning("%s proposals failed (%r): the next step verifies no drafts", self.label, e)
            return
        if chunks:
            self.ahead.append((dispatched.plan, chunks))

    def read_ahead(self, dispatched, runner):
        """With the step's sampled tokens: the drafts computed after it, kept for the next
        schedule (`ready`: seq_id -> (the position of the last token they follow, drafts))."""
        mine = [chunks for plan, chunks in self.ahead if plan is dispatched.plan]
        self.ahead = [(plan, chunks) for plan, chunks in self.ahead if plan is not dispatched.plan]
        self.ready = {}
        if not mine:
            return
        try:
            for seq_ids, out in mine[0]:
                out = np.asarray(out)
                for i, seq_id in enumerate(seq_ids):
                    self.ready[seq_id] = (int(out[-1, i]), out[:-1, i].tolist())
        except Exception as e:
            if not runner.is_alive():
                raise
            logger.warning("%s proposals failed (%r): the next step verifies no drafts", self.label, e)
            self.ready = {}

    def propose(self, plan, scheduler, runner, seed_of):
        """The drafts of the groups `plan` reserved them for (DRAFT_PENDING), into the plan: those
        computed after the last step (`ready`, no device call), where they follow the sequence's
        last token (none for a sequence that step did not sample, e.g. just swapped in)."""
        for scheduled in plan.scheduled_seq_groups:
            if scheduled.spec_token_ids[:1] == [DRAFT_PENDING]:
                seq = scheduled.seqs[0]
                position, drafts = self.ready.get(seq.seq_id, (-1, []))
                valid = position == seq.get_len() - 1 and not seq.num_pending_tokens
                scheduler.set_drafts(plan, scheduled, drafts[:len(scheduled.spec_token_ids)] if valid else [])
