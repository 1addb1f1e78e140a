"""Host-side step inputs kept across steps (vLLM v1's persistent InputBatch), and the packing
that sends one step's inputs to the device in one transfer.

`InputBatch` gives every scheduled sequence a row, kept while it is scheduled step after step,
and holds per row in preallocated numpy arrays what the runner's inputs need of it:
  - its block table, updated only where the block manager's table changed (a block appended, or
    the last one replaced by copy-on-write), so a decode step touches O(1) entries per sequence;
    a table the manager replaced (swap-in, recompute, fork) is a new list object, written afresh.
    The runner keeps the same table on the device (ModelRunner.block_table) and sends it only
    the entries written since (`take_table_updates`), never the whole table;
  - its sampling knobs (temperature, top-k/p, min-p, the three penalties, seed, seq_index,
    logit_bias, min_tokens' banned ids), its LoRA slot and what it needs of the sampler, written
    once when the sequence enters the batch (`add`);
  - what the device's penalty token history row holds (`history`).
Row `neutral` (one past the last) holds the padding's knobs: greedy, every knob off; prompt-logprob
rows read it too. A step's per-row sampler arrays are gathered from these by row index
(step_inputs.py). Sequences absent from a step give their row back (`free_absent`).

`pack` / `unpack`: a pytree of int32 / uint32 / float32 / bool numpy arrays travels as one flat
int32 array (one host-to-device transfer instead of one per leaf) and is rebuilt inside jit from
its static `Layout`.
"""

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.core.request_needs import RequestNeeds
from jpaged.sampling_params import MAX_LOGIT_BIAS, SamplingParams

# Tokens a row can forbid in one step (EOS and stop_token_ids while min_tokens is not reached;
# RequestValidator keeps stop_token_ids below it).
MAX_BANNED_TOKENS = 32


class InputBatch:
    def __init__(self, max_rows: int, width: int):
        self.max_rows, self.neutral = max_rows, max_rows
        self.block_tables = np.zeros((max_rows, width), np.int32)
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self.seq_ids = [-1] * max_rows  # row -> seq_id (-1: free)
        # The block table each row holds: the manager's list (identity tells a new one), its length and last block.
        self.tables: list[list[int] | None] = [None] * max_rows
        self.lengths = [0] * max_rows
        self.lasts = [-1] * max_rows
        self._free = list(range(max_rows - 1, -1, -1))
        # Spans (row, start, end) of block_tables written since the device's copy was last updated.
        self._written: list[tuple[int, int, int]] = []
        # The step that last scheduled each row (StepBuilder.build frees the rows it did not).
        self.step, self.stamps = 0, [0] * max_rows
        n = max_rows + 1  # + the neutral row
        self.temperature = np.zeros(n, np.float32)
        self.top_k = np.full(n, -1, np.int32)
        self.top_p = np.ones(n, np.float32)
        self.min_p = np.zeros(n, np.float32)
        self.presence_penalty = np.zeros(n, np.float32)
        self.frequency_penalty = np.zeros(n, np.float32)
        self.repetition_penalty = np.ones(n, np.float32)
        self.seeds = np.zeros(n, np.uint32)
        self.seq_index = np.zeros(n, np.int32)
        self.logit_bias_ids = np.full((n, MAX_LOGIT_BIAS), -1, np.int32)
        self.logit_bias_values = np.zeros((n, MAX_LOGIT_BIAS), np.float32)
        # min_tokens (0 with a grammar: it decides when the completion may end), and the ids it bans
        # until then: stop_token_ids, then EOS (read each step: the tests move it) at `num_stop`.
        self.min_tokens = np.zeros(n, np.int32)
        self.stop_ids = np.full((n, MAX_BANNED_TOKENS), -1, np.int32)
        self.num_stop = np.zeros(n, np.int32)
        self.lora_slot = np.full(n, -1, np.int32)
        self.full_sampler = np.zeros(n, np.bool_)
        # Python lists, read per sequence each step (cheaper than numpy scalars): penalties; neither
        # penalties nor a grammar (nothing per step but the token); seq_index and LoRA slot (as above).
        self.penalised = [False] * max_rows
        self.plain = [True] * max_rows
        self.seq_index_of = [0] * max_rows
        self.lora_slot_of = [-1] * max_rows
        # What the device's token history row holds: (seq_id, number of tokens), or None.
        self.history: list[tuple[int, int] | None] = [None] * max_rows

    @property
    def num_rows(self) -> int:
        return len(self.row_of)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def add(self, seq_id: int, sp: SamplingParams | None = None, seed: int = 0, seq_index: int = 0,
            lora_slot: int = -1, key_only: bool = False) -> int:
        """A row for a sequence entering the batch, its knobs written from `sp` (None: the
        neutral knobs; a runner that only needs block tables). `key_only`: only the key and the
        temperature / top-k/p / min-p (a draft model's rows: no bias or bans)."""
        if seq_id in self.row_of:
            raise ValueError(f"seq_id {seq_id} already has a row")
        row = self._free.pop()
        self.row_of[seq_id], self.seq_ids[row] = row, seq_id
        self.tables[row], self.lengths[row], self.lasts[row] = None, 0, -1
        self.history[row] = None
        self.seq_index[row] = self.seq_index_of[row] = seq_index
        self.lora_slot[row] = self.lora_slot_of[row] = lora_slot
        self.stamps[row] = self.step
        if sp is None:
            self._copy_knobs(row, self.neutral)
            self.penalised[row], self.plain[row] = False, True
            return row
        self.temperature[row], self.top_k[row], self.top_p[row], self.min_p[row] = \
            sp.temperature, sp.top_k, sp.top_p, sp.min_p
        self.presence_penalty[row], self.frequency_penalty[row], self.repetition_penalty[row] = \
            sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty
        self.seeds[row] = seed % (1 << 32)
        self.logit_bias_ids[row], self.logit_bias_values[row] = -1, 0.0
        if sp.logit_bias and not key_only:  # SamplingParams keeps it within MAX_LOGIT_BIAS entries
            self.logit_bias_ids[row, :len(sp.logit_bias)] = list(sp.logit_bias)
            self.logit_bias_values[row, :len(sp.logit_bias)] = list(sp.logit_bias.values())
        stops = list(sp.stop_token_ids or ())
        if len(stops) >= MAX_BANNED_TOKENS:
            self.free(seq_id)
            raise ValueError(f"stop_token_ids has {len(stops)} entries; at most {MAX_BANNED_TOKENS - 1}")
        self.min_tokens[row] = 0 if sp.guided or key_only else sp.min_tokens
        self.stop_ids[row] = -1
        self.stop_ids[row, :len(stops)] = stops
        self.num_stop[row] = len(stops)
        self.full_sampler[row] = RequestNeeds.of(sp).full_sampler  # (once per row: not per step)
        self.penalised[row] = sp.has_penalties
        self.plain[row] = not (sp.has_penalties or sp.guided)
        return row

    def _copy_knobs(self, row: int, src: int):
        for a in (self.temperature, self.top_k, self.top_p, self.min_p, self.presence_penalty,
                  self.frequency_penalty, self.repetition_penalty, self.seeds, self.logit_bias_ids,
                  self.logit_bias_values, self.min_tokens, self.stop_ids, self.num_stop, self.full_sampler):
            a[row] = a[src]

    def free(self, seq_id: int):
        row = self.row_of.pop(seq_id)
        self.seq_ids[row] = -1
        self.tables[row] = self.history[row] = None
        self._free.append(row)

    def free_absent(self, present):
        """Rows of sequences not in `present` (finished, aborted, preempted, not scheduled) go back."""
        for seq_id in [i for i in self.row_of if i not in present]:
            self.free(seq_id)

    def set_table(self, row: int, table: list[int]):
        """Bring the row's block table up to the block manager's `table` (its own list)."""
        n = len(table)
        if self.tables[row] is not table or n < self.lengths[row]:
            start = 0  # a new table
        elif n == self.lengths[row] and table[-1] == self.lasts[row]:
            return
        else:
            start = self.lengths[row] - 1  # grown, or its last block replaced
        if n > start:
            self.block_tables[row, start:n] = table[start:]
            self._written.append((row, start, n))
        self.tables[row], self.lengths[row], self.lasts[row] = table, n, table[-1] if n else -1

    def take_table_updates(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The block-table entries written since the last call, as (rows, columns, values) for
        the device's copy; a span written twice is sent once, with what the table holds now."""
        spans, self._written = self._written, []
        if not spans:
            return _NO_UPDATES
        if len(spans) > 1:
            spans = list(dict.fromkeys(spans))
        lengths = np.fromiter((end - start for _, start, end in spans), np.int64, len(spans))
        rows = np.repeat(np.fromiter((row for row, _, _ in spans), np.int32, len(spans)), lengths)
        starts = np.fromiter((start for _, start, _ in spans), np.int64, len(spans))
        # Each span's columns start..end: a running index minus each span's offset in the flat list.
        offsets = np.repeat(np.cumsum(lengths) - lengths - starts, lengths)
        cols = (np.arange(len(rows), dtype=np.int64) - offsets).astype(np.int32)
        return rows, cols, self.block_tables[rows, cols]

    def rows(self, seq_ids: Sequence[int], tables: Sequence[list[int]]) -> np.ndarray:
        """Each sequence's row (neutral knobs if new), its block table up to date; sequences not
        given give theirs back (a draft model's runner: block tables only)."""
        self.free_absent(set(seq_ids))
        out = np.empty(len(seq_ids), np.int32)
        for i, (seq_id, table) in enumerate(zip(seq_ids, tables)):
            row = self.row_of.get(seq_id)
            if row is None:
                row = self.add(seq_id)
            self.set_table(row, table)
            out[i] = row
        return out


_NO_UPDATES = (np.zeros(0, np.int32),) * 3


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each leaf of a packed pytree lies in the flat int32 array (static: hashable)."""

    treedef: object
    leaves: tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype name) per leaf

    @property
    def size(self) -> int:
        return sum(int(np.prod(shape)) for shape, _ in self.leaves)


def layout_of(tree) -> Layout:
    """The layout of a pytree of arrays or ShapeDtypeStructs (None leaves are skipped)."""
    leaves, treedef = jax.tree.flatten(tree)
    return Layout(treedef, tuple((tuple(x.shape), np.dtype(x.dtype).name) for x in leaves))


def pack(tree) -> np.ndarray:
    leaves = jax.tree.leaves(tree)
    parts = [np.asarray(x).astype(np.int32) if np.asarray(x).dtype == np.bool_ else np.asarray(x).view(np.int32)
             for x in leaves]
    return np.concatenate([p.reshape(-1) for p in parts]) if parts else np.zeros(0, np.int32)


def unpack(packed: jax.Array, layout: Layout):
    """Inside jit: the pytree `pack` flattened, from its static layout."""
    leaves, offset = [], 0
    for shape, dtype in layout.leaves:
        n = int(np.prod(shape))
        part = packed[offset:offset + n].reshape(shape)
        offset += n
        if dtype == "bool":
            leaves.append(part != 0)
        elif dtype != "int32":
            leaves.append(jax.lax.bitcast_convert_type(part, jnp.dtype(dtype)))
        else:
            leaves.append(part)
    return jax.tree.unflatten(layout.treedef, leaves)
