"""The encoder cache's host side (multimodal/encoder_cache.py, encoder_budget.py and
MultimodalEngine.prepare's row assignment), without a model: which image holds which rows, LRU
eviction that spares the step's images, the scheduler's cut before an image that would overflow,
and the start-over when free rows are too scattered for an image."""

import types

import pytest

from jpaged.multimodal.encoder_budget import encoder_chunk, take_encoder_rows
from jpaged.multimodal.encoder_cache import EncoderCacheFull, EncoderCacheManager
from jpaged.multimodal.processing import MMItem, placeholder_runs
from jpaged.multimodal.runner import MultimodalEngine

VOCAB = 100


def item(h: str, offset: int, length: int, rows: int = 0) -> MMItem:
    return MMItem(h, offset, length, {}, rows)


def test_lru_eviction_spares_pinned_images():
    cache = EncoderCacheManager(10)
    assert cache.allocate("a", 4, set()) == 0
    assert cache.allocate("b", 4, set()) == 4
    assert cache.lookup("a") == 0  # a is now the most recent: b goes first
    assert cache.allocate("c", 4, set()) == 4
    assert cache.lookup("b") is None
    with pytest.raises(EncoderCacheFull):
        cache.allocate("d", 4, {"a", "c"})  # both needed by the step: nothing may go
    with pytest.raises(EncoderCacheFull, match="larger than the encoder cache"):
        cache.allocate("e", 11, set())


def test_budget_cuts_a_chunk_before_an_image_that_does_not_fit():
    group = types.SimpleNamespace(mm_items=[item("a", 2, 4), item("b", 8, 4), item("c", 14, 4)],
                                  encoder_cache_rows=8)
    step = {}
    assert encoder_chunk(group, 0, 20, step) == 14  # a and b fit (8 rows), c does not
    take_encoder_rows(group, 0, 14, step)
    assert step == {"a": 4, "b": 4}
    other = types.SimpleNamespace(mm_items=[item("b", 0, 4), item("d", 5, 4)], encoder_cache_rows=8)
    assert encoder_chunk(other, 0, 10, step) == 5  # b is already counted this step; d is not room
    assert encoder_chunk(group, 15, 3, {}) == 3  # inside c, alone in its step
    assert encoder_chunk(group, 15, 3, {"x": 6}) == 0  # inside c, no room: wait for the next step


def test_whole_images_never_end_a_chunk_inside_one():
    """disable_chunked_mm_input (Gemma 3: an image's tokens attend to each other both ways): a
    chunk stops before an image it would end inside; one that starts inside an image (a prefix
    hit that stopped there) reaches its end or waits; chunks that end at or before an image's
    end pass, and without the flag a chunk may end anywhere."""
    items = [item("a", 2, 4), item("b", 8, 4)]
    whole = types.SimpleNamespace(mm_items=items, encoder_cache_rows=100, disable_chunked_mm_input=True)
    chunked = types.SimpleNamespace(mm_items=items, encoder_cache_rows=100)
    assert [encoder_chunk(whole, 0, n, {}) for n in (2, 4, 5, 6, 7, 9, 12, 20)] == [2, 2, 2, 6, 7, 8, 12, 20]
    assert [encoder_chunk(chunked, 0, n, {}) for n in (4, 9)] == [4, 9]
    assert encoder_chunk(whole, 4, 1, {}) == 0  # inside a, its end (6) out of reach: wait
    assert encoder_chunk(whole, 4, 2, {}) == 2  # inside a, up to its end
    assert encoder_chunk(whole, 4, 6, {}) == 4  # a's rest, then stop before b


def fake_engine(rows: int):
    mm = MultimodalEngine.__new__(MultimodalEngine)
    mm.cache, mm.vocab_size, mm.encoded = EncoderCacheManager(rows), VOCAB, []
    mm._encode = lambda missing: mm.encoded.append([(i.mm_hash, row) for i, row in missing])
    return mm


def step_of(groups):
    """A StepBatch-like step: (items, start, token count) per single-sequence group."""
    batch = types.SimpleNamespace(groups=[], start_pos=[], token_ids=[])
    for k, (items, start, n) in enumerate(groups):
        scheduled = types.SimpleNamespace(seq_group=types.SimpleNamespace(mm_items=items), seqs=[object()])
        batch.groups.append((scheduled, k, 0))
        batch.start_pos.append(start)
        batch.token_ids.append([7] * n)
    return batch


def test_prepare_points_placeholders_at_cache_rows():
    mm = fake_engine(16)
    a, b = item("a", 1, 3), item("b", 5, 3)
    batch = step_of([([a, b], 0, 6), ([b], 4, 2), ([], 0, 3)])
    mm.prepare(batch)
    assert mm.encoded == [[("a", 0), ("b", 3)]]  # b once, though two sequences need it
    assert batch.token_ids[0] == [7, VOCAB + 0, VOCAB + 1, VOCAB + 2, 7, VOCAB + 3]
    assert batch.token_ids[1] == [7, VOCAB + 3]
    assert batch.token_ids[2] == [7, 7, 7]
    mm.prepare(step_of([([b], 6, 3)]))  # cached: nothing encoded
    assert len(mm.encoded) == 1


def test_scattered_rows_start_over_with_the_step_images():
    mm = fake_engine(10)
    for h, n in (("x", 3), ("y", 3), ("z", 3)):
        mm.cache.allocate(h, n, set())
    mm.cache.entries.pop("y")  # free: rows 3-5 and 9 (4 in all, none 4 long)
    c = item("c", 0, 4)
    batch = step_of([([c, item("x", 4, 3), item("z", 7, 3)], 0, 10)])
    mm.prepare(batch)  # x and z are cached but this step needs them: no 4-row gap for c
    assert mm.encoded == [[("c", 0), ("x", 4), ("z", 7)]]  # all three encoded again, from row 0 up
    assert batch.token_ids[0] == [VOCAB + r for r in range(10)]


def test_placeholder_runs():
    ids = [1, 9, 9, 2, 9, 9, 9, 9, 3]
    assert placeholder_runs(ids, 9, [2, 2, 2]) == [1, 4, 6]
    with pytest.raises(ValueError, match="multi_modal_data"):
        placeholder_runs(ids, 9, [2, 2])
    with pytest.raises(ValueError, match="not consecutive"):
        placeholder_runs(ids, 9, [3, 3])


def test_an_encode_that_loses_the_weights_kills_the_runner():
    """An encode failing after its donated state is gone leaves no half-alive runner: the KV pages
    are dropped too, so ModelRunner.is_alive says so and the engine stops instead of failing every
    later step; a failure that keeps the weights keeps the pages."""
    import jax.numpy as jnp

    mm = MultimodalEngine.__new__(MultimodalEngine)
    for weights_lost in (False, True):
        state, pages = {"w": jnp.ones(3)}, jnp.zeros(4)
        mm.runner = types.SimpleNamespace(state=state, kv_cache=(pages,))

        def failing(state, inputs, rows):
            if weights_lost:
                state["w"].delete()
            raise RuntimeError("device out of memory")

        with pytest.raises(RuntimeError, match="out of memory"):
            mm._run(failing, {}, 0)
        assert pages.is_deleted() == weights_lost
