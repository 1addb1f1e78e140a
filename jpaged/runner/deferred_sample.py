"""A step's two device calls, the forward and the sampler, dispatched together or apart: apart for
a grammar step behind a step in flight, so that structured output does not stop async
scheduling's overlap (vLLM v1 runs structured output under async scheduling the same way).

A step's device work is two executables: the forward (new K/V, the logits of the rows to sample,
which stay on the device) and the sampler. `run_step` dispatches both at once. A grammar row
whose sequence has a token pending (a step in flight: StepBatch.deferred) needs a mask from its
matcher advanced by that token, which only the read of the step in flight gives. The runner then
dispatches the forward alone (`run_forward`: its logits kept on the device under an id, by every
process's runner) and hands back a DeferredSample in the step's handles; the engine reads the step
in flight and updates the sequences (the matchers take their tokens), then `sample_deferred`
makes the rows' masks and dispatches the sampler (`run_sample`) on the kept logits. The device
runs the forward while the host reads, updates and makes the masks. The executables are the same
keys as a fused step's: nothing more to compile, and steps without such rows are unchanged.

A row whose sequence finished or was aborted meanwhile (its grammar complete with the token just
read, a stop, an error, an abort) samples unmasked: its token is dropped when read, as any token
computed past a sequence's end. A mask that raises fails its request alone (DispatchedStep.failed),
as a mask at build time does; a sampler dispatch that fails fails the requests of that dispatch.
"""

import dataclasses
import itertools

import jax
import numpy as np

from jpaged.runner.input_batch import pack
from jpaged.runner.step_functions import StepHandle

_ids = itertools.count()


@dataclasses.dataclass
class DeferredSample:
    """A step whose forward is dispatched and whose sampling waits for its grammar rows' masks; it
    stands in DispatchedStep.handles until `sample_deferred` puts the StepHandle there."""

    ident: int  # the forward's logits, kept on the device under this id
    smeta: object  # the step's SamplingMetadata (numpy); the deferred rows' masks still all ones
    dst_rows: np.ndarray
    history: object  # HistoryInputs or None
    rows: dict  # sampling row -> (its SequenceGroup, its Sequence): the masks to make
    num_real_rows: int


class DeferredSampling:
    """The ModelRunner's forward and sampler calls (a mixin, as kv_transfer.BlockOps): fused in
    `run_step`, or the forward now and the sampler later (`defer_sample`, `sample_deferred`)."""

    def _forward_part(self, key, inputs):
        """The step's forward (and the proposer's K/V forward); its logits, whether it kept hidden states."""
        num_tokens, full, hooks, decode, greedy = key
        logits, self.kv_cache, *hidden = self._executable(self.forward_key(num_tokens, hooks, decode))(
            self.state, self.kv_cache, inputs, self.last_tokens, self.block_table)
        if hidden:
            self.hidden_states = hidden[0]
        if hooks:  # (before last_tokens is donated)
            self.proposer.forward_kv(num_tokens, inputs, self.last_tokens, self.block_table)
        if self.kv_cache.scales_pending is not None and not self._kv_scales_computed:
            self._kv_scales_computed = True  # this step computed them: later steps keep them
            self.kv_cache = self.kv_cache.replace(
                scales_pending=jax.device_put(np.bool_(False), self.kv_cache.scales_pending.sharding))
        return logits, bool(hidden)

    def _sample_part(self, key, inputs, logits, hidden: bool, smeta):
        num_tokens, full, hooks, decode, greedy = key
        out, self.last_tokens, self.token_history = self._executable(
            ("sample", self.buckets.sample_rows(num_tokens), full) + (("greedy",) if greedy else ()))(
            logits, smeta, self.last_tokens, self.token_history)
        if hidden:
            self.proposer.after_step(num_tokens, inputs, self.hidden_states, out, self.block_table)  # (EAGLE: its K/V)
        if hooks:
            self.proposer.after_sample(out, self.block_table)  # (a draft model drafts the next step from it)
        return out

    def _run_step(self, key, inputs: np.ndarray, smeta: np.ndarray):
        logits, hidden = self._forward_part(key, inputs)
        return self._sample_part(key, inputs, logits, hidden, smeta)

    def _run_forward(self, key, ident: int, inputs: np.ndarray):
        self._kept_logits[ident] = (key, inputs) + self._forward_part(key, inputs)

    def _run_sample(self, ident: int, smeta: np.ndarray):
        key, inputs, logits, hidden = self._kept_logits.pop(ident)
        return self._sample_part(key, inputs, logits, hidden, smeta)

    def defer_sample(self, key, inputs: np.ndarray, smeta, dst_rows, history, batch, num_real_rows: int):
        """Dispatch the step's forward alone; its sampling waits for `sample_deferred`."""
        ident = next(_ids)
        with self.clock.phase("launch"):
            self.dispatch_op("run_forward", key, ident, inputs)
        return DeferredSample(ident, smeta, dst_rows, history, dict(batch.deferred), num_real_rows)

    def sample_deferred(self, step) -> None:
        """Make the masks of `step`'s deferred grammar rows (the step before it read: the matchers
        have taken their tokens) and dispatch its sampling. Nothing to do for a step without."""
        handles = step.handles
        for i, handle in enumerate(handles):
            if type(handle) is DeferredSample:
                handles[i] = self._launch_sample(step, i, handle)

    def _launch_sample(self, step, i: int, deferred: DeferredSample):
        failed, structured_output = step.failed, self.step_builder.structured_output
        with self.clock.phase("prepare"):
            allowed = deferred.smeta.allowed_bitmask  # (the step's own array: a lane step never defers)
            for row, (group, seq) in deferred.rows.items():
                if seq.is_finished() or group.request_id in failed:
                    continue  # its token is dropped: any mask will do (and a finished matcher is gone)
                try:
                    allowed[row] = structured_output.bitmask(seq.seq_id, group.sampling_params)
                except Exception as e:
                    failed[group.request_id] = (group, e)
            packed = pack((deferred.smeta, deferred.dst_rows, deferred.history))
        try:
            with self.clock.phase("launch"):
                out = self.dispatch_op("run_sample", deferred.ident, packed)
        except Exception as e:
            self._kept_logits.pop(deferred.ident, None)
            if not self.is_alive():
                raise
            for scheduled, h, _ in step.results:
                if h == i:
                    failed.setdefault(scheduled.seq_group.request_id, (scheduled.seq_group, e))
            return None
        return StepHandle(out, len(allowed), deferred.smeta.num_logprobs, deferred.num_real_rows)
