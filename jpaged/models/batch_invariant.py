"""Batch-invariant matmuls (the engine's `batch_invariant` mode; vLLM's
model_executor/layers/batch_invariant.py does the same on GPUs with its own kernels).

XLA's CPU dot picks how it sums each output element from the operand shapes: a row of x @ W
changes with the number of rows (measured with jax 0.10.2: 1 row vs 2-32 vs 64+ give three
different results, fp32 and bf16). Computed here in tiles of ROW_TILE rows, each the same
shaped dot in a loop, a row's bits no longer depend on how many rows the call has or which
tile it falls in (measured: a row's result is the same at every position of a tile).
Row reductions are not safe either: XLA's reduce of a row changes with the number of rows (a
logsumexp over 576 values: 1 row vs 8+ rows differ). Norms and the sampler's logsumexp use
`tree_sum` (a fixed pairwise order of elementwise adds) instead.
Elementwise code is not safe either: XLA's CPU emitter contracts a multiply and an add that share
a fusion into one FMA, and the engine's steps and LLM.policy()'s forward fuse differently; every
product an add consumes passes through `separate` (pallas_kernels/invariant.py), see
docs/batch_invariance.md.
"""

import math

import jax
import jax.numpy as jnp

from pallas_kernels.invariant import full_width, separate, tree_sum  # noqa: F401 (separate: for the models)

ROW_TILE = 16


def row_tiled_dot(x, w, contract: tuple[tuple[int, ...], tuple[int, ...]], precision=None):
    """dot_general(x, w, (contract, no batch)) with x's leading (non-contracted) axes as rows, in
    tiles of ROW_TILE rows; the contracted axes of x must be its last ones."""
    x_axes, _ = contract
    n_in = len(x_axes)
    lead = x.shape[:x.ndim - n_in]
    rows = math.prod(lead)
    x2 = x.reshape((rows,) + x.shape[x.ndim - n_in:])
    tiles = -(-rows // ROW_TILE)
    x2 = jnp.pad(x2, [(0, tiles * ROW_TILE - rows)] + [(0, 0)] * n_in)
    dims = ((tuple(range(1, 1 + n_in)), contract[1]), ((), ()))
    # Barriers: XLA would fold the zero padding and the final slice into the dot (a 1-trip loop is
    # inlined), which brings back a dot of `rows` rows.
    x2 = jax.lax.optimization_barrier(x2.reshape((tiles, ROW_TILE) + x2.shape[1:]))
    y = jax.lax.map(lambda t: jax.lax.dot_general(t, w, dims, precision=precision), x2)
    y = jax.lax.optimization_barrier(y).reshape((tiles * ROW_TILE,) + y.shape[2:])[:rows]
    return y.reshape(lead + y.shape[1:])



def mean_last(x):
    """jnp.mean over the last axis in a fixed order."""
    return tree_sum(x) / x.shape[-1]


def logsumexp_last(x):
    """jax.nn.logsumexp over the last axis (fp32) in a fixed order; -inf entries add nothing."""
    m = jnp.max(x, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    x = separate(x)  # logits that a product made (Gemma 2's soft cap): no FMA with the subtract
    # log over one value per row: a small array in a decode step (full_width)
    # exp ends in a multiply (its 2^n scaling): kept from the sum's adds (separate)
    return separate(full_width(jnp.log, tree_sum(separate(jnp.exp(x - m_safe[..., None])))) + m_safe)
