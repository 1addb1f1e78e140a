"""The runner's persistent input batch (block tables kept across steps and updated in place) and
the packing of step inputs into one int32 array, against plain references."""

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.runner.input_batch import InputBatch, layout_of, pack, unpack


def test_block_tables_follow_every_kind_of_table_change():
    """Random steps: sequences join, leave, grow a block, get a copy-on-write last block, or come
    back with a new table (swap-in, recompute); each step's rows must hold exactly the tables."""
    rng = np.random.default_rng()
    width, max_rows = 12, 6
    batch = InputBatch(max_rows, width)
    tables: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(300):
        for seq_id in list(tables):
            change = rng.integers(6)
            table = tables[seq_id]
            if change == 0 and len(table) < width:
                table.append(int(rng.integers(1000)))  # a new block
            elif change == 1:
                table[-1] = int(rng.integers(1000))  # copy-on-write of the last block
            elif change == 2:
                tables[seq_id] = [int(b) for b in rng.integers(1000, size=rng.integers(1, width + 1))]  # new list
            elif change == 3:
                del tables[seq_id]  # finished or preempted
        while len(tables) < max_rows and rng.random() < 0.5:
            tables[next_id] = [int(b) for b in rng.integers(1000, size=rng.integers(1, width + 1))]
            next_id += 1
        scheduled = [i for i in tables if rng.random() < 0.8]  # the others miss this step
        rows = batch.rows(scheduled, [tables[i] for i in scheduled])
        assert len(set(rows.tolist())) == len(rows)
        for seq_id, row in zip(scheduled, rows):
            table = tables[seq_id]
            assert batch.block_tables[row, :len(table)].tolist() == table
        for seq_id in [i for i in tables if i not in scheduled]:
            del tables[seq_id]  # a sequence that misses a step comes back with a new table


def test_pack_round_trips_every_dtype_inside_jit():
    rng = np.random.default_rng()
    tree = {"ids": rng.integers(-5, 1 << 30, size=(3, 4)).astype(np.int32),
            "seeds": rng.integers(0, 1 << 32, size=5, dtype=np.uint64).astype(np.uint32),
            "temperature": rng.standard_normal(7).astype(np.float32),
            "flag": np.bool_(rng.random() < 0.5), "none": None}
    layout = layout_of(tree)
    packed = pack(tree)
    assert packed.dtype == np.int32 and packed.shape == (layout.size,)
    out = jax.jit(lambda p: unpack(p, layout))(jnp.asarray(packed))
    for key in ("ids", "seeds", "temperature", "flag"):
        assert np.asarray(out[key]).dtype == np.asarray(tree[key]).dtype
        np.testing.assert_array_equal(np.asarray(out[key]), tree[key])
    assert out["none"] is None
