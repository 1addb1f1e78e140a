"""Host-side step inputs kept across steps (vLLM v1's persistent InputBatch idea), and the packing
that sends one step's inputs to the device in one transfer.

`InputBatch` keeps every scheduled sequence's block table in a row of one numpy array. A sequence
keeps its row while it is scheduled step after step; its row is updated only where the block
manager's table changed (a block appended, or the last one replaced by copy-on-write), so a
decode step touches O(1) entries per sequence instead of copying whole tables. A sequence that
misses a step gives its row back; a table the manager replaced (swap-in, recompute, fork) is a
new list object and is written afresh.

`pack` / `unpack`: a pytree of int32 / uint32 / float32 / bool numpy arrays travels as one flat
int32 array (one host-to-device transfer instead of one per leaf) and is rebuilt inside jit from
its static `Layout`.
"""

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


class InputBatch:
    def __init__(self, max_rows: int, width: int):
        self.block_tables = np.zeros((max_rows, width), np.int32)
        self._rows: dict[int, tuple[int, list[int], int, int]] = {}  # seq_id -> (row, table, length, last)
        self._free = list(range(max_rows - 1, -1, -1))

    def rows(self, seq_ids: Sequence[int], tables: Sequence[list[int]]) -> np.ndarray:
        """Each sequence's row, its block table up to date; sequences not given give theirs back."""
        present = set(seq_ids)
        for seq_id in [i for i in self._rows if i not in present]:
            self._free.append(self._rows.pop(seq_id)[0])
        out = np.empty(len(seq_ids), np.int32)
        for i, (seq_id, table) in enumerate(zip(seq_ids, tables)):
            entry = self._rows.get(seq_id)
            n = len(table)
            if entry is None:
                row, start = self._free.pop(), 0
            else:
                row, known, length, last = entry
                if known is not table or n < length:
                    start = 0  # a new table
                elif n == length and table[-1] == last:
                    out[i] = row
                    continue
                else:
                    start = length - 1  # grown, or its last block replaced
            if n > start:
                self.block_tables[row, start:n] = table[start:]
            self._rows[seq_id] = (row, table, n, table[-1] if n else -1)
            out[i] = row
        return out


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
