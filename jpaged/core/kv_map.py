"""A picture of the device KV pool: one cell per block, grouped by the request holding it.

A block is free, cached (free, but keeping a prefix for reuse: evicted when needed), reserved
(held, no token computed in it yet: a baseline's reservation, or a prompt chunk still to come),
in use (held by one sequence) or shared (held by several: forks, beams, a cached prefix). The
picture is an SVG: `llm.kv_map().save("kv.svg")`, shown inline by Jupyter, and served live by
the server at /kv.
"""

import dataclasses
import html

from jpaged.core.block_manager import FREED_BLOCK
from jpaged.core.sequence import SequenceGroup, SequenceStatus

STATES = ("in use", "shared", "reserved", "cached", "free")
COLORS = {"in use": "#16a34a", "shared": "#7c3aed", "reserved": "#facc15", "cached": "#60a5fa", "free": "#e5e7eb"}
CELL, GAP, COLUMNS, LABEL_WIDTH = 12, 2, 64, 110  # pixels; cells per row


@dataclasses.dataclass
class KVMap:
    block_size: int
    # (label, [(block id, state)]): each request's blocks in block-table order, then the pool's free ones.
    rows: list[tuple[str, list[tuple[int, str]]]]

    @classmethod
    def of(cls, block_manager, seq_groups: list[SequenceGroup]) -> "KVMap":
        """The pool now; `seq_groups`: the groups holding device blocks (the running ones)."""
        pool, size = block_manager.gpu_pool, block_manager.block_size
        computed: dict[int, bool] = {}  # block -> holds a computed token
        owners: dict[str, list[int]] = {}  # request -> its blocks, each listed once, under its first holder
        for group in seq_groups:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                for i, block_id in enumerate(block_manager.get_block_table(seq)):
                    if block_id == FREED_BLOCK:
                        continue
                    if block_id not in computed:
                        owners.setdefault(group.request_id, []).append(block_id)
                    computed[block_id] = computed.get(block_id, False) or seq.num_computed_tokens > i * size

        def state(block_id: int) -> str:
            ref_cnt = pool.ref_cnt(block_id)
            if ref_cnt == 0:
                return "cached" if pool.is_cached(block_id) else "free"
            return "shared" if ref_cnt > 1 else "in use" if computed.get(block_id) else "reserved"

        rows = [(f"request {request_id}", [(b, state(b)) for b in blocks]) for request_id, blocks in owners.items()]
        free = sorted((b for b in range(pool.num_blocks) if pool.ref_cnt(b) == 0), key=lambda b: state(b))
        rows.append(("free pool", [(b, state(b)) for b in free]))
        return cls(size, rows)

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(STATES, 0)
        for _, cells in self.rows:
            for _, state in cells:
                counts[state] += 1
        return counts

    def to_svg(self) -> str:
        step = CELL + GAP
        parts, y = [], 0
        counts = self.counts()
        legend = " · ".join(f"{state} {n}" for state, n in counts.items())
        parts.append(f'<text x="0" y="14" font-size="13">{sum(counts.values())} blocks of {self.block_size} '
                     f'tokens: {legend}</text>')
        for i, state in enumerate(STATES):
            parts.append(f'<rect x="{LABEL_WIDTH + i * 90}" y="22" width="{CELL}" height="{CELL}" '
                         f'fill="{COLORS[state]}"/><text x="{LABEL_WIDTH + i * 90 + step}" y="33" '
                         f'font-size="11">{state}</text>')
        y = 44
        for label, cells in self.rows:
            parts.append(f'<text x="0" y="{y + CELL - 2}" font-size="11">{html.escape(label[:16])}</text>')
            for i, (block_id, state) in enumerate(cells):
                x, row_y = LABEL_WIDTH + (i % COLUMNS) * step, y + (i // COLUMNS) * step
                parts.append(f'<rect class="block {state.replace(" ", "-")}" x="{x}" y="{row_y}" width="{CELL}" '
                             f'height="{CELL}" fill="{COLORS[state]}"><title>block {block_id}: {state}'
                             f'</title></rect>')
            y += max(1, -(-len(cells) // COLUMNS)) * step + GAP
        width = LABEL_WIDTH + COLUMNS * step
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y}" '
                f'font-family="sans-serif">{"".join(parts)}</svg>')

    def _repr_svg_(self) -> str:  # Jupyter
        return self.to_svg()

    def save(self, path: str):
        """Write the picture as SVG."""
        if not path.endswith(".svg"):
            raise ValueError(f"path={path!r}; the KV map is an SVG picture: name it *.svg")
        with open(path, "w") as f:
            f.write(self.to_svg())
