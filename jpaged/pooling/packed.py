"""Pooling requests packed ragged: whole inputs laid end to end in rows of one length (first-fit
decreasing), no input padded to the longest, and attention masked to each input's own tokens.

A batch is [rows, row_len] tokens, flattened to the token axis the models take. The models' layer
stack and attention read the layout from the forward context: `block_tables` carries the
[rows, row_len] shape (its values are unused) and `context_lens` each token's input index in the
batch (-1: padding), the two fields the layer stack does not rewrite per layer.
"""

import bisect
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.models.forward_context import AttentionMetadata, ForwardContext, get_forward_context


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k_pages"], meta_fields=[])
@dataclasses.dataclass
class NoPages:
    """No KV pages are kept for pooling: the layer stack only reads this shape (one page a layer)."""

    k_pages: jax.Array

    @classmethod
    def of(cls, num_layers: int) -> "NoPages":
        return cls(jnp.zeros((1, num_layers, 1, 1), jnp.int8))


def packed_context(num_rows: int, row_len: int, segments) -> ForwardContext:
    """The forward context of a packed batch: `segments` int32[rows * row_len]."""
    one = jnp.zeros((1,), jnp.int32)
    meta = AttentionMetadata(slot_mapping=one, block_tables=jnp.zeros((num_rows, row_len), jnp.int32),
                             context_lens=segments, query_start_loc=one, layer=jnp.int32(0))
    return ForwardContext(attn=meta)


def packed_attention(q, k, v, scale: float, causal: bool, logits_soft_cap: float | None = None, window=None):
    """Attention inside each packed input: q [tokens, heads, head_dim], k/v [tokens, kv_heads,
    head_dim] (GQA: heads a multiple of kv_heads); bidirectional, or causal for decoders. `window`
    (an int, possibly traced): only keys at most that many positions away (ModernBERT's local
    layers); an input's tokens are contiguous in its row, so a row distance is a position one."""
    meta = get_forward_context().attn
    rows, row_len = meta.block_tables.shape
    seg = meta.context_lens.reshape(rows, row_len)
    _, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    qr = q.reshape(rows, row_len, kv_heads, heads // kv_heads, head_dim)
    kr, vr = (x.reshape(rows, row_len, kv_heads, head_dim) for x in (k, v))
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    s = jnp.einsum("rqhgd,rkhd->rhgqk", qr, kr, precision=precision, preferred_element_type=jnp.float32) * scale
    if logits_soft_cap:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    mask = seg[:, :, None] == seg[:, None, :]  # padding (-1) attends to padding: finite, never read
    if causal:
        mask &= jnp.tril(jnp.ones((row_len, row_len), bool))[None]
    if window is not None:
        at = jnp.arange(row_len)
        mask &= (jnp.abs(at[:, None] - at[None, :]) <= window)[None]
    s = jnp.where(mask[:, None, None], s, -1e30)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    out = jnp.einsum("rhgqk,rkhd->rqhgd", p, vr, precision=precision)
    return out.reshape(rows * row_len, heads, head_dim)


@dataclasses.dataclass(frozen=True)
class PackedAttentionOps:
    """The decoders' attention call site (in place of paged_attention.AttentionOps) for pooling:
    causal attention inside each packed input; nothing is written to KV pages."""

    causal: bool = True
    mesh: None = None  # Attention reads ops.mesh for tensor parallelism: one device

    def __call__(self, q, k, v, kv_cache, meta, scale, sliding_window=None, logits_soft_cap=None):
        return packed_attention(q, k, v, scale, self.causal, logits_soft_cap), kv_cache


@dataclasses.dataclass
class PackedBatch:
    """One step's inputs (host arrays) and where each input lies in them."""

    input_ids: np.ndarray  # int32[rows * row_len]
    positions: np.ndarray  # int32[rows * row_len], from 0 in each input
    token_types: np.ndarray  # int32[rows * row_len] (BERT's segment A / B)
    segments: np.ndarray  # int32[rows * row_len]: index in `items` (-1: padding)
    starts: np.ndarray  # int32[num_seqs]: each input's first token in the flat axis
    lengths: np.ndarray  # int32[num_seqs]
    items: list[int]  # the caller's index of each input, in segment order
    num_rows: int
    row_len: int


def _bucket(n: int, least: int) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def pack(lengths: list[int], max_model_len: int, max_tokens: int) -> list[tuple[int, int, list[list[int]]]]:
    """Batches of inputs, each (row_len, num_rows, rows of input indices), longest inputs first.
    Each row starts with the longest input left, and its room is filled best-fit with the longest
    inputs left that fit (so short inputs fill the long ones' rows). A batch's row length is a power
    of two (at least 16, at most max_model_len) fitting its longest input; at most
    max(max_tokens // row_len, 1) rows, padded to a power of two (few shapes to compile)."""
    left = sorted((n, i) for i, n in enumerate(lengths))  # ascending: the longest at the end
    batches = []
    while left:
        row_len = min(_bucket(left[-1][0], 16), max_model_len)
        max_rows = max(max_tokens // row_len, 1)
        rows: list[list[int]] = []
        while left and len(rows) < max_rows:
            n, i = left.pop()
            row, room = [i], row_len - n
            while left and room >= left[0][0]:
                k = bisect.bisect_right(left, (room, len(lengths))) - 1  # the longest that fits
                n, i = left.pop(k)
                row.append(i)
                room -= n
            rows.append(row)
        batches.append((row_len, _bucket(len(rows), 1), rows))
    return batches


def build_batch(token_ids: list[list[int]], token_types: list[list[int] | None], row_len: int, num_rows: int,
                rows: list[list[int]]) -> PackedBatch:
    total = num_rows * row_len
    ids, pos, types = (np.zeros(total, np.int32) for _ in range(3))
    seg = np.full(total, -1, np.int32)
    starts, lens, items = [], [], []
    for r, row in enumerate(rows):
        at = r * row_len
        for i in row:
            n = len(token_ids[i])
            ids[at:at + n] = token_ids[i]
            pos[at:at + n] = np.arange(n)
            if token_types[i] is not None:
                types[at:at + n] = token_types[i]
            seg[at:at + n] = len(items)
            starts.append(at)
            lens.append(n)
            items.append(i)
            at += n
    return PackedBatch(ids, pos, types, seg, np.asarray(starts, np.int32), np.asarray(lens, np.int32), items,
                       num_rows, row_len)
