"""Paged attention kernels and KV cache ops for jpaged (imports jax only).

Layouts (one pair of arrays per layer):
  k_pages, v_pages  [num_kv_heads, num_pages, page_size, head_dim]
  slot              page * page_size + offset
  block_tables      int32[num_seqs, max_blocks]; logical block b of sequence s
                    lives in page block_tables[s, b]. Entries past a
                    sequence's length may hold anything (-1, huge): they are
                    clamped and never read out of bounds.
  context_lens      int32[num_seqs]: tokens in the sequence's pages
                    (0 = padding row -> zeros out).
GQA/MQA: num_heads % num_kv_heads == 0; query head h uses kv head
h // (num_heads // num_kv_heads).

Ops:
  paged_attention           decode, one query token per sequence
  ragged_paged_attention    prefill / chunked prefill / prefix hits: the new
                            tokens of many sequences packed along q's axis 0,
                            sequence i owning q[query_start_loc[i]:
                            query_start_loc[i+1]]. Their K/V are already in
                            the pages (write_kv first), so they are the last
                            q_len_i of context_lens[i] tokens and new token j
                            sits at position context_lens[i] - q_len_i + j,
                            attending causally to positions <= its own.
                            Rows past query_start_loc[-1] are padding (zeros).
  write_kv, copy_blocks     cache updates (XLA scatter on all backends).

Both attention ops take sliding_window (None, an int or a traced int32
scalar: a query at position p sees keys in (p - w, p]) and logits_soft_cap
(None or a float c: scores -> c * tanh(score / c), Gemma 2).

Backend dispatch (`interpret` kwarg): None -> compiled Pallas (Triton) on GPU,
XLA twin elsewhere; True -> Pallas in interpret mode; False -> compiled Pallas.
The XLA twins are exported as paged_attention_xla / ragged_paged_attention_xla.
"""

import functools

import jax

from pallas_kernels.cache_ops import copy_blocks, write_kv
from pallas_kernels.decode import paged_attention_pallas
from pallas_kernels.prefill import ragged_paged_attention_pallas
from pallas_kernels.xla import paged_attention_xla, ragged_paged_attention_xla

__all__ = [
    "paged_attention",
    "ragged_paged_attention",
    "write_kv",
    "copy_blocks",
    "paged_attention_xla",
    "ragged_paged_attention_xla",
]


def _xla_fallback(interpret) -> bool:
    return interpret is None and jax.default_backend() != "gpu"


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "num_splits", "logits_soft_cap"))
def paged_attention(q, k_pages, v_pages, block_tables, context_lens, *, scale=None, interpret=None, num_splits=None,
                    sliding_window=None, logits_soft_cap=None):
    """Decode attention over paged K/V.

    q [num_seqs, num_heads, head_dim] -> [num_seqs, num_heads, head_dim]
    (q's dtype). Sequence s attends to tokens [0, context_lens[s]) of its
    pages. scale defaults to 1/sqrt(head_dim). num_splits (Pallas only) forces
    the number of split-K partitions; None picks it from the shapes.
    """
    masking = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    if _xla_fallback(interpret):
        return paged_attention_xla(q, k_pages, v_pages, block_tables, context_lens, scale=scale, **masking)
    return paged_attention_pallas(
        q, k_pages, v_pages, block_tables, context_lens, scale=scale, num_splits=num_splits, interpret=bool(interpret),
        **masking
    )


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "logits_soft_cap"))
def ragged_paged_attention(
    q, k_pages, v_pages, block_tables, context_lens, query_start_loc, *, scale=None, interpret=None,
    sliding_window=None, logits_soft_cap=None
):
    """Causal attention of packed new tokens over paged K/V.

    q [num_tokens, num_heads, head_dim] -> same shape (q's dtype);
    query_start_loc int32[num_seqs + 1], nondecreasing. See module docstring.
    """
    masking = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    if _xla_fallback(interpret):
        return ragged_paged_attention_xla(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, scale=scale,
                                          **masking)
    return ragged_paged_attention_pallas(
        q, k_pages, v_pages, block_tables, context_lens, query_start_loc, scale=scale, interpret=bool(interpret),
        **masking
    )
