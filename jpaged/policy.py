"""`LLM.policy()`: the engine's own model as a pure JAX function for a trainer (issue 41).

The forward is the engine's: the same module graph, layers and kernels, run as one prefill of
each sequence over a scratch KV pool made inside the call. With `batch_invariant=True` every row
has the engine's bits whatever the batch, so `token_logprobs` equals the logprobs the engine
returned while sampling, bit for bit, however the trainer batches its calls, also inside its
own jax.jit(jax.value_and_grad(...)) (what is guaranteed and when: docs/batch_invariance.md).
The logprobs are vLLM's default `logprobs_mode` ("raw_logprobs"): log_softmax of the model's
logits, before temperature, top-k/p and penalties (the engine's sampler reports the same for
requests without penalties, bans or logit_bias).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.models.batch_invariant import logsumexp_last
from jpaged.models.forward_context import AttentionMetadata, ForwardContext, forward_context
from jpaged.models.kv_cache import KVCache
from jpaged.models.layers import Attention
from pallas_kernels.invariant import CHUNK_KEYS


class Policy:
    def __init__(self, runner):
        self._runner = runner

    @property
    def params(self) -> nnx.State:
        """The engine's live weights (an nnx.State pytree; load_weights replaces them)."""
        return self._runner.state

    def apply(self, params, tokens):
        """Logits (fp32 [B, T, vocab]) of `tokens` (int32 [B, T]): row t predicts token t + 1.
        Pure, jittable and differentiable in `params`; padding after a sequence's end does not
        change its rows (causal attention)."""
        runner = self._runner
        tokens = jnp.asarray(tokens, jnp.int32)
        page = runner.block_size
        b, t = tokens.shape
        width = -(-t // page)
        model = nnx.merge(runner.graphdef, params)
        # No shape workarounds (a batch of one, partial pages, a one-chunk loop are fine): the bits
        # that used to move with them were FMAs contracted in one program and not another, which
        # batch-invariant mode no longer leaves to XLA's fusion (issue 62, docs/batch_invariance.md).
        chunks = -(-t // CHUNK_KEYS)
        for _, node in nnx.iter_graph(model):  # a static number of key chunks: jax.grad can reverse it
            if isinstance(node, Attention):
                node.ops = dataclasses.replace(node.ops, static_chunks=chunks)
        spec, pool = runner.kv_cache_spec, runner.kv_cache
        kv_cache = KVCache(jnp.zeros(spec.pool_shape(b * width), pool.k_pages.dtype),
                           jnp.zeros(spec.v_pool_shape(b * width), pool.v_pages.dtype), raw_of=pool.raw_of,
                           v_transposed=pool.v_transposed)
        pos = jnp.arange(t, dtype=jnp.int32)
        tables = jnp.arange(b * width, dtype=jnp.int32).reshape(b, width)
        slots = (tables[:, :, None] * page + jnp.arange(page, dtype=jnp.int32)).reshape(b, -1)[:, :t]
        attn = AttentionMetadata(slot_mapping=slots.reshape(-1), block_tables=tables,
                                 context_lens=jnp.full((b,), t, jnp.int32),
                                 query_start_loc=jnp.arange(b + 1, dtype=jnp.int32) * t)
        # Barriers: constant positions would be folded by XLA's evaluator (its cos and sin are not
        # the compiled ones); the engine's step gets them at run time.
        ids, positions, attn = jax.lax.optimization_barrier((tokens.reshape(-1), jnp.tile(pos, b), attn))
        with forward_context(ForwardContext(attn=attn)):
            hidden, _ = model(ids, positions, kv_cache)
        return model.compute_logits(hidden).reshape(b, t, -1)

    def token_logprobs(self, params, sequences) -> list[jax.Array]:
        """For each token-id list, log p(token | the tokens before it) of every token after the
        first (fp32 [len - 1]), as the engine's sampler computes it: logit - logsumexp(logits)."""
        lengths = [len(s) for s in sequences]
        if not sequences or min(lengths) < 1:
            raise ValueError("sequences: a non-empty list of non-empty token-id lists")
        tokens = np.zeros((len(sequences), max(lengths)), np.int32)
        for i, s in enumerate(sequences):
            tokens[i, :len(s)] = s
        logits = self.apply(params, tokens)[:, :-1]
        lse = logsumexp_last(logits)
        taken = jnp.take_along_axis(logits, jnp.asarray(tokens[:, 1:, None]), axis=-1)[..., 0] - lse
        return [taken[i, :n - 1] for i, n in enumerate(lengths)]
