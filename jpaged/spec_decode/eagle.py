"""EAGLE speculative decoding (`{"method": "eagle3" or "eagle", "model": PATH, "num_speculative_tokens": k}`):
a one-layer draft head (eagle_head.py) that reads the target's own hidden states. The two methods
differ only in the head (its layout, the features it reads, its LM head); this file runs either.

Its KV pages: a pool of one layer with the target's number of blocks, addressed by the target's
block ids (as a draft model's, draft_model.py): block copies, swaps, prefix caching and recompute
need nothing new. Entry i of its pages holds the head's K/V of (the target's fused features at
token i, the embedding of token i + 1).

Every target step (the runner's `after_step` hook, on the device): the forward returns the
head's features at every token of the step (EAGLE-3: the hidden states entering three target
layers; EAGLE-1/2: the target's output), and its input ids;
with the step's sampled tokens, the head runs over the step's tokens, each paired with the token
after it (the next one in the step, or the token sampled at it), writing its pages. At a row that
sampled, its output is the first draft after the sampled token; each sampling row's output and
first draft stay on the device (`rows`). Where a verified draft was rejected, the entries past
the accepted ones are wrong, and the next step, which starts there, rewrites them. (A prefill
chunk that is not a prompt's last leaves its last entry paired with the next sequence's token:
fewer drafts are accepted there, the output is unchanged.) Steps above disable_by_batch_size
skip all of it (the runner's forward without hidden states, no fill): their entries stay stale,
and the first step after them drafts nothing (`last_prepared` is None), then drafting resumes.

A step's drafts come from the step before it, as vLLM v1's (eagle_ahead.py): right after a target
step's dispatch (`after_dispatch`: its sampler and the fill on their way, no host read between),
the chain: for each speculating sequence, the row that sampled its new last token (the accepted
count worked out on the device) gives the first draft and the midlayer's output; k - 1 more
midlayer steps, each fed its own last draft and output, give the rest, in one device call,
writing the head's K/V to scratch blocks past the target's (the real pages keep the fill's
entries). Its output is read with the step's tokens (`read_ahead`, into `ready`); the next
step's `propose` (after scheduling, which reserves DRAFT_PENDING) puts those drafts in with no
device call, where they follow the sequence as it now stands.
Drafts are the head's argmax: verification (the exact scheme, spec_decode/__init__.py) keeps the
target's own draws whatever the drafts are.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jpaged.config import MAX_LOGPROBS
from jpaged.models.forward_context import ForwardContext, forward_context
from jpaged.runner.buckets import BLOCK_OP_SIZES, BLOCK_OPS, Buckets
from jpaged.runner.input_batch import layout_of, unpack
from jpaged.runner.step_functions import resolve
from jpaged.runner.model_runner import ModelRunner
from jpaged.spec_decode.ahead import AheadProposer, scratch_blocks_per_seq
from jpaged.spec_decode.eagle_ahead import chain_ahead
from jpaged.spec_decode.eagle_head import EagleHead

def fill(graphdef, state, shared, kv_cache, packed, hidden, sampled, block_table, *, layout, max_rows: int):
    """The head over one target step (see the module's doc; `block_table`: the target's, which
    the step's inputs index): its pages, and each sampling row's midlayer output and first
    draft, padded to `max_rows` rows."""
    inputs = resolve(unpack(packed, layout), None, block_table)
    aux, ids = hidden
    num_tokens, num_rows = ids.shape[0], inputs.logits_indices.shape[0]
    tokens = sampled[:num_rows]
    # Each token's first sampling row. Padding rows point at token 0, as a real row 0 may: a
    # decode's (sequence 0 has one token) or one of several rows at tokens 0, 1, ...
    li, arange = inputs.logits_indices, jnp.arange(num_rows, dtype=jnp.int32)
    row0 = (inputs.attn.query_start_loc[1] == 1) | (li[min(1, num_rows - 1)] == 1)
    real = (li != 0) | ((arange == 0) & row0)
    first = jnp.full(num_tokens, num_rows, jnp.int32).at[jnp.where(real, li, num_tokens)].min(arange, mode="drop")
    next_ids = jnp.where(first < num_rows, tokens[jnp.minimum(first, num_rows - 1)], jnp.roll(ids, -1))
    head = nnx.merge(graphdef, state, shared)
    with forward_context(ForwardContext(attn=dataclasses.replace(inputs.attn, layer=jnp.int32(0)))):
        out, kv_cache = head(aux, next_ids, inputs.positions, kv_cache)
    rows_out = out[inputs.logits_indices]
    pad = max_rows - num_rows
    return kv_cache, (jnp.pad(rows_out, ((0, pad), (0, 0))), jnp.pad(head.draft(rows_out), (0, pad)),
                      jnp.pad(tokens, (0, pad)))


def _shared_state(modules: dict) -> nnx.State:
    """{the head's attribute: a module's state} as one State, of the same tree type whether the
    states come from the head's split or the target's state."""
    return nnx.State({name: nnx.State(dict(state)) for name, state in modules.items()})


class EagleRunner(ModelRunner):
    """The head's pages and executables: a ModelRunner over the head (block copies, swaps and
    the executable cache as the target's), whose steps are `fill` and eagle_ahead's `chain_ahead`;
    its pool has the chain's scratch blocks past the target's block ids."""

    def __init__(self, head: EagleHead, num_steps: int, target_lora: bool, executable_cache, **shape):
        # Past the target's block ids: the chain's scratch blocks (eagle_ahead.py), per chain row.
        self.blocks_per_seq = scratch_blocks_per_seq(num_steps, head.kv_cache_spec.block_size)
        self.scratch_base = shape["num_gpu_blocks"]
        shape = {**shape, "num_gpu_blocks": shape["num_gpu_blocks"] + shape["max_num_seqs"] * self.blocks_per_seq}
        super().__init__(head.loaded, head.kv_cache_spec, **shape, executable_cache=executable_cache)
        self.num_chain_steps, self.target_lora = num_steps, target_lora
        self.max_rows = self.buckets.sample_rows(self.buckets.tokens[-1])
        hidden = head.loaded.hf_config.hidden_size
        rep, pool = self._replicated, jax.tree.map(lambda x: x.sharding, self.kv_cache)
        self.rows = (jnp.zeros((self.max_rows, hidden), self.dtype, device=rep),
                     jnp.zeros(self.max_rows, jnp.int32, device=rep), jnp.zeros(self.max_rows, jnp.int32, device=rep))
        model = head.loaded.model
        self.aux_width = model.num_aux * hidden
        # The head's own weights apart from the target's modules it calls (`shared`): those are
        # read from the target's state at every call (`attach`); until then, the ones loaded with it.
        self.shared_names = dict(model.shared)
        self.owned = nnx.Not(nnx.Any(*(nnx.PathContains(name) for name in self.shared_names)))
        self.graphdef, self.state, loaded_shared = nnx.split(model, self.owned, ...)
        self.loaded_shared = _shared_state({name: loaded_shared[name] for name in self.shared_names})
        self.target = None
        self._fill = lambda layout: jax.jit(functools.partial(fill, self.graphdef, layout=layout, max_rows=self.max_rows),
                                            donate_argnums=(2,), out_shardings=(pool, (rep, rep, rep)))
        self._ahead = jax.jit(functools.partial(chain_ahead, self.graphdef, num_steps=num_steps,
                                                block_size=self.block_size, scratch_base=self.scratch_base,
                                                blocks_per_seq=self.blocks_per_seq),
                              donate_argnums=(2,), out_shardings=(rep, pool))

    def shared(self) -> nnx.State:
        """The target's modules the head calls, as the target's runner holds them now."""
        if self.target is None:
            return self.loaded_shared
        return _shared_state({name: self.target.state[attr] for name, attr in self.shared_names.items()})

    def output_sizes(self, num_tokens: int):
        """The sampler's packed output sizes of a step of `num_tokens` (fast, full: step_functions.pack_output)."""
        rows = self.buckets.sample_rows(num_tokens)
        return 3 * rows, rows * (3 + 2 * min(MAX_LOGPROBS, self.vocab_size))

    def keys(self):
        for tokens in self.buckets.tokens:
            for size in self.output_sizes(tokens):
                yield ("eagle_fill", tokens, size)
        for seqs in self.buckets.decode_tokens:
            yield ("eagle_ahead", seqs)
        for op in BLOCK_OPS:
            for num_blocks in BLOCK_OP_SIZES:
                yield (op, num_blocks)

    def _jitted_and_args(self, key):
        rep = self._replicated
        i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32, sharding=rep)
        if key[0] == "eagle_fill":
            _, tokens, size = key
            layout = layout_of(self._abstract_inputs(tokens, lora=self.target_lora))
            hidden = (jax.ShapeDtypeStruct((tokens, self.aux_width), self.dtype, sharding=rep), i32((tokens,)))
            return self._fill(layout), (self.state, self.loaded_shared, self.kv_cache, self._packed(layout), hidden,
                                        i32((size,)), self.block_table)
        if key[0] == "eagle_ahead":
            seqs, k = key[1], self.num_chain_steps + 1
            return self._ahead, (self.state, self.loaded_shared, self.kv_cache, self.rows, self.block_table,
                                 i32((seqs,)), i32((seqs, k + 1)), i32((seqs, k)), i32((seqs,)), i32((seqs,)))
        return super()._jitted_and_args(key)

    def run_fill(self, num_tokens: int, inputs, hidden, sampled, block_table):
        aux, ids = hidden
        self.kv_cache, self.rows = self._executable(("eagle_fill", num_tokens, sampled.shape[0]))(
            self.state, self.shared(), self.kv_cache, inputs, (aux.astype(self.dtype), ids), sampled, block_table)

    def run_ahead(self, block_table, *arrays):
        """`chain_ahead` over the last fill (eagle_ahead.py): its output stays on the device."""
        out, self.kv_cache = self._executable(("eagle_ahead", len(arrays[0])))(
            self.state, self.shared(), self.kv_cache, self.rows, block_table, *arrays)
        return out


class EagleProposer(AheadProposer):
    """Drafts after each target step for the next (eagle_ahead.py, ahead.py; the plan reserves k
    slots per speculating sequence), from the target's hidden states through the head's
    EagleRunner (`runner`)."""

    needs_hidden_states = True
    drafts_ahead = True
    label = "the EAGLE head's"

    def __init__(self, head: EagleHead, executable_cache, target_lora: bool = False, **shape):
        super().__init__()
        self.method = head.method
        self.aux_hidden_layers = head.aux_layers
        self.k = shape["num_speculative_tokens"]
        self.runner = EagleRunner(head, self.chain_steps(self.k), target_lora, executable_cache, **shape)

    @staticmethod
    def chain_steps(k: int) -> int:
        return k - 1  # (the first draft comes with the fill)

    @classmethod
    def device_state_bytes(cls, head: EagleHead, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                           num_speculative_tokens: int, **shape) -> int:
        """Besides the runner's step state and the chain's scratch blocks: the fill's rows (each
        sampling row's hidden state, draft, token)."""
        spec = head.kv_cache_spec
        buckets = Buckets.create(max_num_seqs, max_num_batched_tokens, -(-max_model_len // spec.block_size), 1,
                                 num_speculative_tokens, max_model_len=max_model_len)
        rows = buckets.sample_rows(buckets.tokens[-1])
        hidden = head.loaded.hf_config.hidden_size * jnp.dtype(head.loaded.dtype).itemsize
        return super().device_state_bytes(head, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                          num_speculative_tokens=num_speculative_tokens) + rows * (hidden + 8)

    # ------------------------------------------------------------------ the runner's hooks
    def attach(self, runner):
        self.runner.target = runner

    def after_step(self, num_tokens: int, inputs, hidden, sampled, block_table):
        self.runner.run_fill(num_tokens, inputs, hidden, sampled, block_table)

    def device_ops(self) -> dict:
        return {"eagle_ahead": self._run_ahead}

    def _run_ahead(self, *arrays):
        return self.runner.run_ahead(self.runner.target.block_table, *arrays)

    def warm_up(self, stop=None):
        self.runner.warm_up(stop, list(self.runner.keys()))

    # ------------------------------------------------------------------ drafts
    def dispatch_ahead(self, part, dispatched, runner):
        """The chain (eagle_ahead.py) from the tokens the step samples, after the head's fill."""
        return runner.dispatch_op("eagle_ahead", *part.arrays)
