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

A step's drafts (`propose`, after scheduling and the block moves): for each speculating sequence,
the last step's row that sampled its last token gives the first draft and the midlayer's output;
k - 1 more midlayer steps, each fed its own last draft and output, give the rest, in one device
call (a chain), writing the head's pages at the reserved slots (rewritten by the next step).
Drafts are the head's argmax: verification (the exact scheme, spec_decode/__init__.py) keeps the
target's own draws whatever the drafts are.
"""

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.config import MAX_LOGPROBS
from jpaged.models.forward_context import AttentionMetadata, ForwardContext, forward_context
from jpaged.runner.buckets import BLOCK_OP_SIZES, BLOCK_OPS, fit
from jpaged.runner.input_batch import layout_of, unpack
from jpaged.runner.step_functions import resolve
from jpaged.runner.model_runner import ModelRunner
from jpaged.spec_decode.eagle_head import EagleHead
from jpaged.spec_decode.proposer import DRAFT_PENDING, RunnerProposer

logger = logging.getLogger(__name__)


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
    return kv_cache, (jnp.pad(rows_out, ((0, pad), (0, 0))), jnp.pad(head.draft(rows_out), (0, pad)))


def chain(graphdef, state, shared, kv_cache, rows_state, rows, positions, block_tables, slots, *, num_steps: int):
    """Drafts of `rows`' sequences (their rows in the last step's `rows_state`): the first from
    there, then `num_steps` midlayer steps at positions + j (slots[j]; -1: padding): [1 + steps, seqs]."""
    head = nnx.merge(graphdef, state, shared)
    outs, drafts = rows_state
    hidden, draft = outs[rows], drafts[rows]
    live = positions >= 0
    num_seqs = rows.shape[0]

    def one_step(carry, j):
        kv_cache, hidden, draft = carry
        attn = AttentionMetadata(slots[j], block_tables, jnp.where(live, positions + j + 1, 0),
                                 jnp.arange(num_seqs + 1, dtype=jnp.int32), True, jnp.int32(0))
        with forward_context(ForwardContext(attn=attn)):
            hidden, kv_cache = head.step(draft, hidden, jnp.maximum(positions, 0) + j, kv_cache)
        draft = head.draft(hidden)
        return (kv_cache, hidden, draft), draft

    if num_steps == 0:  # k = 1: the first draft alone
        return draft[None], kv_cache
    (kv_cache, _, _), later = jax.lax.scan(one_step, (kv_cache, hidden, draft), jnp.arange(num_steps))
    return jnp.concatenate([draft[None], later]), kv_cache


def _shared_state(modules: dict) -> nnx.State:
    """{the head's attribute: a module's state} as one State, of the same tree type whether the
    states come from the head's split or the target's state."""
    return nnx.State({name: nnx.State(dict(state)) for name, state in modules.items()})


class EagleRunner(ModelRunner):
    """The head's pages and executables: a ModelRunner over the head (block copies, swaps and
    the executable cache as the target's), whose steps are `fill` and `chain`."""

    def __init__(self, head: EagleHead, num_steps: int, target_lora: bool, executable_cache, **shape):
        super().__init__(head.loaded, head.kv_cache_spec, **shape, executable_cache=executable_cache)
        self.num_chain_steps, self.target_lora = num_steps, target_lora
        self.max_rows = self.buckets.sample_rows(self.buckets.tokens[-1])
        hidden = head.loaded.hf_config.hidden_size
        rep, pool = self._replicated, jax.tree.map(lambda x: x.sharding, self.kv_cache)
        self.rows = (jnp.zeros((self.max_rows, hidden), self.dtype, device=rep),
                     jnp.zeros(self.max_rows, jnp.int32, device=rep))
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
                                            donate_argnums=(2,), out_shardings=(pool, (rep, rep)))
        self._chain = jax.jit(functools.partial(chain, self.graphdef, num_steps=num_steps), donate_argnums=(2,),
                              out_shardings=(rep, pool))

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
            yield ("eagle_chain", seqs)
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
        if key[0] == "eagle_chain":
            seqs = key[1]
            return self._chain, (self.state, self.loaded_shared, self.kv_cache, self.rows, i32((seqs,)), i32((seqs,)),
                                 i32((seqs, self.buckets.width)), i32((self.num_chain_steps, seqs)))
        return super()._jitted_and_args(key)

    def run_fill(self, num_tokens: int, inputs, hidden, sampled, block_table):
        aux, ids = hidden
        self.kv_cache, self.rows = self._executable(("eagle_fill", num_tokens, sampled.shape[0]))(
            self.state, self.shared(), self.kv_cache, inputs, (aux.astype(self.dtype), ids), sampled, block_table)

    def run_chain(self, rows, positions, block_tables, slots):
        drafts, self.kv_cache = self._executable(("eagle_chain", len(rows)))(
            self.state, self.shared(), self.kv_cache, self.rows, rows, positions, block_tables, slots)
        return drafts


class EagleProposer(RunnerProposer):
    """Drafts after scheduling (the plan reserves k slots per speculating sequence), from the
    target's hidden states through the head's EagleRunner (`runner`)."""

    needs_hidden_states = True

    def __init__(self, head: EagleHead, executable_cache, target_lora: bool = False, **shape):
        self.method = head.method
        self.aux_hidden_layers = head.aux_layers
        self.k = shape["num_speculative_tokens"]
        self.runner = EagleRunner(head, self.k - 1, target_lora, executable_cache, **shape)

    # ------------------------------------------------------------------ the runner's hooks
    def attach(self, runner):
        self.runner.target = runner

    def after_step(self, num_tokens: int, inputs, hidden, sampled, block_table):
        self.runner.run_fill(num_tokens, inputs, hidden, sampled, block_table)

    def device_ops(self) -> dict:
        return {"eagle_chain": self.runner.run_chain}

    def warm_up(self, stop=None):
        self.runner.warm_up(stop, list(self.runner.keys()))

    # ------------------------------------------------------------------ drafts
    def propose(self, plan, scheduler, runner, seed_of):
        """The drafts of the groups `plan` reserved them for (DRAFT_PENDING), into the plan. A
        sequence the last target step did not sample its last token in (just swapped in) takes
        none this step; if the chain fails, none does."""
        pending = [s for s in plan.scheduled_seq_groups if s.spec_token_ids[:1] == [DRAFT_PENDING]]
        if not pending:
            return
        drafts = [[] for _ in pending]
        try:
            found = self._rows_in_last_step(pending, scheduler, runner)
            if found:
                chained = self._chain(runner, [pending[i] for i, _ in found], [r for _, r in found], scheduler)
                for (i, _), tokens in zip(found, chained):
                    drafts[i] = tokens
        except Exception as e:
            if not runner.is_alive():
                raise
            logger.warning("the EAGLE head's proposals failed (%r): this step verifies no drafts", e)
            drafts = [[] for _ in pending]
        for scheduled, tokens in zip(pending, drafts):
            scheduler.set_drafts(plan, scheduled, tokens)

    @staticmethod
    def _rows_in_last_step(pending, scheduler, runner) -> list[tuple[int, int]]:
        """(index in `pending`, sampling row of the last target step that sampled its last token)."""
        step = runner.last_prepared
        if step is None:
            return []
        inputs, n = step.inputs, len(step.rows)
        seq_index = {int(r): i for i, r in enumerate(step.rows)}
        qsl, li = inputs.attn.query_start_loc, inputs.logits_indices[:step.num_rows]
        found = []
        for i, scheduled in enumerate(pending):
            seq = scheduled.seqs[0]
            j = seq_index.get(runner.input_batch.row_of.get(seq.seq_id, -1))
            if j is None or j >= n:
                continue
            token = qsl[j] + (seq.get_len() - 2 - inputs.positions[qsl[j]])
            if not qsl[j] <= token < qsl[j + 1]:
                continue
            hits = np.flatnonzero(li == token)
            if len(hits):
                found.append((i, int(hits[-1])))
        return found

    def _chain(self, runner, scheduled, rows, scheduler) -> list[list[int]]:
        eagle = self.runner
        chunk = eagle.buckets.decode_tokens[-1]
        out = []
        for start in range(0, len(scheduled), chunk):
            part, part_rows = scheduled[start:start + chunk], rows[start:start + chunk]
            seqs = fit(eagle.buckets.decode_tokens, len(part))
            row_arr = np.zeros(seqs, np.int32)
            row_arr[:len(part)] = part_rows
            positions = np.full(seqs, -1, np.int32)
            tables = np.zeros((seqs, eagle.buckets.width), np.int32)
            slots = np.full((eagle.num_chain_steps, seqs), -1, np.int32)
            steps = []
            for i, s in enumerate(part):
                seq = s.seqs[0]
                table = scheduler.block_manager.get_block_table(seq)
                tables[i, :len(table)] = table
                positions[i] = seq.get_len() - 1  # the last token's: the chain's first step
                steps.append(len(s.spec_token_ids))
                for j in range(min(eagle.num_chain_steps, steps[-1] - 1)):
                    pos = positions[i] + j
                    slots[j, i] = table[pos // eagle.block_size] * eagle.block_size + pos % eagle.block_size
            drafts = np.asarray(runner.dispatch_op("eagle_chain", row_arr, positions, tables, slots))
            out += [drafts[:k, i].tolist() for i, k in enumerate(steps)]
        return out
