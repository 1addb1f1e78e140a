"""ModelRunner: owns the weights and the KV pages and runs one padded, precompiled step.

The NNX model is split once into a static graph definition and a state pytree; the step
merges them inside jit, so no Python object traversal happens per step. The KV pool is one
(k_pages, v_pages) pair for every layer, each [num_kv_heads, num_layers * num_pages, page_size,
head_dim] (layer l's page p at l * num_pages + p; see LayerStack); it is donated to the step and
comes back updated in place. Block copies and swaps move every layer's part of a page. A step is
two device calls: the model forward (its logits stay on the device) and the sampler; only sampled
ids and logprobs return to the host. Both are dispatched at once (`run_step`), or, for a grammar
step behind a step in flight, the sampler later, once the masks are known (deferred_sample.py). `execute(plan)` builds the step's inputs itself from the
scheduler's plan over the persistent InputBatch (a row per scheduled sequence: block table,
sampling knobs, LoRA slot, kept across steps; see input_batch.py, step_inputs.py); each call's
inputs travel packed in one int32 array. It returns before the device is done and `collect`
reads the result, so the engine can schedule and dispatch the next step first: each row's sampled
token also stays on the device (`last_tokens`), where the next step's forward takes it (a
PENDING_TOKEN input).

Every step is padded to a bucket (see Buckets), block copies and swaps to a fixed size, and every
executable is compiled ahead of time at warm-up (warmup.py: in the background, smallest first, the
steps meanwhile padded to the buckets compiled so far), so serving never compiles; `num_compilations`
counts them all. Compiled executables are kept on disk whole (executable_cache.py): a restart
loads them without tracing. The forward and the sampler compile apart: the sampler's shapes
depend only on its row bucket and its full/fast switch, so the warm-up compiles forwards +
samplers, not their product.

The runner orchestrates; the parts live beside it: the step shapes and executable keys in
buckets.py, the jitted device functions in step_functions.py, the plan -> InputBatch rows and
sampler metadata in step_inputs.py, the host-side padding of a step's inputs in
prepare_inputs.py, block copies and swaps in kv_transfer.py (BlockOps, which the runner inherits).
Block tables live on the device (`block_table`, a row per InputBatch row): a step sends each
sequence's row index, and before it only the entries the InputBatch wrote since the last step.

Tensor parallelism: weights and KV pages live on the loader's mesh (jpaged/parallel); the runner
only gives every jitted function its shardings. Step inputs are replicated, the KV pages split
on kv heads, and each device keeps its own heads' part of swapped-out pages in host memory.
Multi-host: the driver (process 0) sends every device operation's host inputs to the other
processes before running it; they run the same operation in `follow` (see `lead`).
"""

import dataclasses
import functools
import logging
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.models.forward_context import AttentionMetadata
from jpaged.models.paged_attention import attention_family
from jpaged.models.kv_cache import KVCache, KVCacheSpec
from jpaged.lora.model import abstract_slot
from jpaged.models.layers import Linear
from jpaged.models.loader import LoadedModel
from jpaged.multimodal import runner as multimodal
from jpaged.parallel import distributed
from jpaged.parallel.sharding import TP_AXIS, kv_cache_sharding, replicated
from jpaged.runner import kv_transfer, sampler, step_functions, step_inputs
from jpaged.runner.deferred_sample import DeferredSampling
from jpaged.runner.buckets import MIN_TOKEN_BUCKET, Buckets, update_chunks
from jpaged.runner.executable_cache import ExecutableCache
from jpaged.runner.input_batch import InputBatch, Layout, layout_of, pack
from jpaged.runner.prepare_inputs import prepare_step
from jpaged.runner.step_functions import HistoryInputs, StepHandle, StepInputs, unpack_output
from jpaged.runner.step_inputs import DispatchedStep, StepBatch, StepBuilder
from jpaged.runner.warmup import WarmUp, need_order
from jpaged.spec_decode.proposer import Proposer
from jpaged.step_clock import StepClock

logger = logging.getLogger(__name__)


class ModelRunner(distributed.DriverOps, kv_transfer.BlockOps, DeferredSampling):
    def __init__(self, loaded: LoadedModel, kv_cache_spec: KVCacheSpec, *, num_gpu_blocks: int, num_cpu_blocks: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, num_scheduler_steps: int = 1,
                 executable_cache: ExecutableCache | None = None, kv_scales=None, calculate_kv_scales: bool = False,
                 num_speculative_tokens: int = 0, proposer: Proposer | None = None, block_manager=None,
                 structured_output=None, stop_checker=None, seed: int = 0, disable_by_batch_size: int | None = None,
                 abstract: bool = False, clock: StepClock | None = None):
        """`kv_scales`: fp8 pages' per-layer (k, v) scales from the checkpoint; else 1.0, or
        computed by the first step with `calculate_kv_scales`. `proposer`: speculative decoding's
        (spec_decode/proposer.py): the runner calls its hooks (each step's K/V forward, warm-up,
        device operations), and block copies and swaps iterate over `pools`, these pages and
        the proposer's pools that share their block ids. What `execute` reads of the engine,
        read only (step_inputs.StepBuilder): `block_manager` (block tables), `structured_output`
        (grammar masks), `stop_checker` (EOS for min_tokens) and the engine `seed`. `abstract`: the
        KV pool and the device-side step state are shapes only, nothing is allocated: a runner that
        only compiles, to measure its executables' memory (`step_memory`) before the pool is sized.
        `clock`: the engine's step clock (step_clock.py), which times the inputs' preparation
        ("prepare") and the device calls' dispatch ("launch") here."""
        self.clock = clock if clock is not None else StepClock()
        self.kv_cache_spec, self.num_gpu_blocks = kv_cache_spec, num_gpu_blocks
        self.block_size = block_size = kv_cache_spec.block_size
        self.vocab_size = loaded.hf_config.vocab_size
        self.max_model_len = max_model_len
        self.mesh, self.dtype = loaded.mesh, loaded.dtype
        self.slept = None  # while asleep: what wake_up restores from (jpaged/runner/weights.py)
        self.is_driver = distributed.is_driver()
        self._multihost = jax.process_count() > 1
        # LoRA (jpaged/lora): the projections given adapter slots, by their path in the model.
        self.lora_linears = {path: node for path, node in nnx.iter_graph(loaded.model)
                             if isinstance(node, Linear) and node.lora_a is not None}
        self.graphdef, self.state = nnx.split(loaded.model)
        self.mrope = bool(getattr(loaded.model, "uses_mrope", False))  # positions [3, tokens] (mrope_step.py)
        self.mm_prefix = bool(getattr(loaded.model, "is_mm_prefix_lm", False))  # key limits per token (mm_prefix.py)
        # The engine's batch_invariant mode (the loader marks the model's layers; the sampler follows).
        self.batch_invariant = any(getattr(node, "batch_invariant", False) for _, node in nnx.iter_graph(loaded.model))
        self.num_layers = num_layers = kv_cache_spec.num_layers
        kv, rep = kv_cache_sharding(self.mesh), replicated(self.mesh)
        self._replicated = rep
        self.proposer = proposer if proposer is not None else Proposer()
        self.proposer.attach(self)
        self.kv_cache: KVCache = (kv_cache_spec.abstract if abstract else kv_cache_spec.allocate)(
            num_gpu_blocks, kv, kv_scales, calculate_kv_scales)
        pool = jax.tree.map(lambda x: x.sharding, self.kv_cache)  # pages split on kv heads, scales replicated
        # Host pool for swapped-out pages, one per local shard, keyed by the shard's first kv head:
        # [layer, k/v, kv_heads / tp, cpu_blocks, block_size, head_dim].
        self.host_kv = {} if abstract else {
            index[0].start or 0: np.zeros(kv_cache_spec.host_shape(num_cpu_blocks), self.kv_cache.k_pages.dtype)
            for index in kv.addressable_devices_indices_map(kv_cache_spec.pool_shape(num_gpu_blocks)).values()}
        # Swapped pages in flight: [layer, k/v, kv_heads, blocks, block_size, head_dim], split on kv heads.
        self._pages_sharding = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(None, None, TP_AXIS))
        self.buckets = Buckets.create(max_num_seqs, max_num_batched_tokens, math.ceil(max_model_len / block_size),
                                      num_scheduler_steps, num_speculative_tokens, self.batch_invariant, max_model_len,
                                      MIN_TOKEN_BUCKET.get(self.mesh.devices.flat[0].platform, 1))
        self.input_batch = InputBatch(max_num_seqs, self.buckets.width)
        self.step_builder = StepBuilder(self.input_batch, block_manager, structured_output, stop_checker, seed)
        # The token each InputBatch row sampled last, kept on the device: the next step can read it
        # before the host has (overlap). Filled on the host and copied: jnp.full would compile (0.1-0.4 s of a start).
        state_array = functools.partial(jax.ShapeDtypeStruct, sharding=rep) if abstract else \
            (lambda shape, dtype, fill=0: jax.device_put(np.full(shape, fill, dtype), rep))
        self.last_tokens = state_array((max_num_seqs,), jnp.int32)
        # Penalties' tokens, kept on the device per InputBatch row (prompt, then outputs; the
        # full sampler appends each sampled token): sent once per sequence, not every step.
        # `InputBatch.history` says what each row holds: (seq_id, tokens).
        self.token_history = state_array((max_num_seqs, max_model_len), jnp.int32, *(() if abstract else (-1,)))
        # The InputBatch's block tables, kept on the device (its last row, the padding's, stays
        # zeros): a step sends each sequence's row index, and `flush_block_table` only the
        # entries written since the last step (InputBatch.take_table_updates).
        self.block_table = state_array((max_num_seqs + 1, self.buckets.width), jnp.int32)
        # Each takes its inputs packed in one int32 array (one transfer), unpacked by `layout`.
        # `return_hidden`: the forward also returns the sampled rows' hidden states, kept in
        # `hidden_states` (on the device) for a proposer that drafts from them (EAGLE-style).
        # Off unless the proposer asks: other engines' executables are unchanged (on: keys ("forward", n, "hidden")).
        # EAGLE-3 (`proposer.aux_hidden_layers`): instead the hidden states entering those layers at
        # every token, and the step's input ids; the proposer reads them in `after_step`.
        self.return_hidden = self.proposer.needs_hidden_states
        self.hidden_layers = tuple(getattr(self.proposer, "aux_hidden_layers", ()) or ())
        self.hidden_states = None
        # Steps of a plan with spec_disabled (disable_by_batch_size) skip the proposer's hooks from
        # this many tokens on: an EAGLE head's from the smallest bucket above the limit (a step of
        # more sequences has more tokens), whose forwards also compile without hidden states.
        self.hookless_from = math.inf if disable_by_batch_size is None else 0 if not self.return_hidden else \
            min((t for t in self.buckets.tokens if t > disable_by_batch_size), default=math.inf)
        self.last_prepared = None  # hidden states or drafts_ahead: the last step's host inputs (which row is whose)
        self._kept_logits = {}  # forwards whose sampling waits for grammar masks, by id (deferred_sample.py)
        # Decode steps (a token per sequence, known to the host) get executables of their own that
        # run the decode kernel alone (keys ("forward", n, "decode")), where the kernels differ:
        # the XLA family (a CPU) has one path for both, and batch-invariant mode one kernel.
        self.decode_keys = not self.batch_invariant and attention_family(loaded.model) != "xla"
        # The makers of the jitted functions by layout (one per executable key), closing over no runner.
        self._forward, self._sample, self._multi_step, self._kv_forward = step_functions.layout_jits(
            self.graphdef, rep, pool, num_scheduler_steps)
        self._table_writer = jax.jit(step_functions.write_block_table, out_shardings=rep, donate_argnums=(0,))
        self._history_writer = jax.jit(step_functions.write_history, out_shardings=rep, donate_argnums=(0,))
        self._lora_writer = jax.jit(functools.partial(step_functions.write_lora_slot, self.graphdef,
                                                      list(self.lora_linears)),
                                    out_shardings=jax.tree.map(lambda x: x.sharding, self.state), donate_argnums=(0,))
        self.executable_cache = executable_cache or ExecutableCache(None, "")
        self._executables = {}
        if self._multihost and not abstract:  # the driver's broadcasts: one executable, compiled now
            self._executables[("broadcast", distributed.BROADCAST_CHUNK)] = distributed.broadcast_executable()[0]
        self._warm = False
        self.warmup: WarmUp | None = None  # a background warm-up (start_warm_up)
        self._kv_scales_computed = False
        self._copy = jax.jit(functools.partial(kv_transfer.copy_blocks, num_layers), in_shardings=(pool, rep, rep),
                             out_shardings=pool, donate_argnums=(0,))
        self._gather = jax.jit(functools.partial(kv_transfer.gather_blocks, num_layers), in_shardings=(pool, rep),
                               out_shardings=self._pages_sharding)
        self._scatter = jax.jit(functools.partial(kv_transfer.scatter_blocks, num_layers),
                                in_shardings=(pool, self._pages_sharding, rep), out_shardings=pool, donate_argnums=(0,))
        # Images (jpaged/multimodal/runner.py): the encoder's executables compile now; `execute` has
        # it encode the images a step's prefill chunks cover and point their tokens at the embeddings.
        self.mm = multimodal.MultimodalEngine(loaded, self) if multimodal.is_multimodal(loaded.model) and not abstract \
            else None
        self.step_builder.use_lane = self.mm is None  # (mm.prepare reads each sequence's tokens)

    @property
    def pools(self) -> list:
        """The KV pools addressed by the same block ids: these pages and the proposer's (a property,
        not a list kept on the runner: that would be a reference cycle, see step_functions.layout_jits)."""
        return [self] + self.proposer.shared_pools()

    @property
    def num_compilations(self) -> int:
        return len(self._executables) + self.proposer.num_compilations + (self.mm.num_compilations if self.mm else 0)

    def add_multimodal_request(self, engine, *args):
        """LLMEngine.add_request's prompts with images (multimodal/runner.py; ValueError for a text-only model)."""
        return multimodal.add_request(self.mm, engine, *args)

    def is_alive(self) -> bool:
        """False once the KV pages are gone: a step that failed after donating them."""
        return not any(pages.is_deleted() for pages in jax.tree.leaves(self.kv_cache)) and self.proposer.is_alive()

    def forward_key(self, num_tokens: int, hooks: bool = True, decode: bool = False) -> tuple:
        return ("forward", num_tokens) + (("decode",) if decode and self.decode_keys else ()) \
            + (("hidden",) if self.return_hidden and hooks else ())

    def forward_keys(self, num_tokens: int) -> list[tuple]:
        """The forwards a step of `num_tokens` may run (without the proposer's hooks too:
        hookless_from; a decode's own where decode_keys and the bucket has a row per token)."""
        hooks = [True, False] if self.return_hidden and num_tokens >= self.hookless_from else [True]
        decode = [False, True] if self.decode_keys and self.buckets.seqs(num_tokens) == num_tokens else [False]
        return [self.forward_key(num_tokens, h, d) for d in decode for h in hooks]

    def _warm_up_plan(self, stop, keys) -> WarmUp:
        """Every executable in order of need (warmup.py); `keys`: these instead."""
        if keys is not None:
            return WarmUp(self, list(keys), [], stop)
        base = [k for k in self.buckets.keys() if k[0] not in ("forward", "multi_step", "sample")] \
            + ([("write_lora",)] if self.lora_linears else [])
        return WarmUp(self, need_order(self.buckets, self.forward_keys, base), base, stop)

    def warm_up(self, stop: threading.Event | None = None, keys=None):
        """Compile (or load) every executable now, so serving never compiles (warmup.py: loads,
        then compiles pipelined with the next lowerings). `stop` (set by the server's SIGTERM
        handler) is checked between shapes and raises SystemExit(0): the handler's own SystemExit
        is lost when the signal lands in a garbage-collector callback. `keys`: the executables to
        compile (default: every step of this runner's buckets)."""
        self._warm_up_plan(stop, keys).run()
        self.proposer.warm_up(stop)
        self._warm = True

    def start_warm_up(self, stop: threading.Event | None = None) -> WarmUp:
        """Compile every executable in a background thread, smallest steps first, while the engine
        serves on those compiled so far (`serving_buckets`, `token_limit`)."""
        self.warmup = self._warm_up_plan(stop, None).start()
        self._warm = True
        return self.warmup

    @property
    def token_limit(self) -> int | None:
        """The largest step (tokens) there are executables for while a background warm-up runs or
        after it failed for some shapes (0: none yet); None: every bucket."""
        if self.warmup is None or self.warmup.ready:
            return None
        ready = self.warmup.ready_tokens()
        return ready[-1] if ready else 0

    @property
    def serving_buckets(self) -> Buckets:
        """The buckets steps are padded to: the compiled ones (`token_limit`)."""
        if self.warmup is None or self.warmup.ready:
            return self.buckets
        return dataclasses.replace(self.buckets, tokens=self.warmup.ready_tokens())

    def bypass_executable_cache(self):
        """Forget what warm_up loaded and load nothing more from disk (compiles still write)."""
        self._executables.clear()
        self.executable_cache.skip_loads = True
        self.proposer.bypass_executable_cache()

    def _compile(self, key):
        return self.executable_cache.compile(repr(key), *self._jitted_and_args(key))

    def _lower(self, key):
        jitted, args = self._jitted_and_args(key)
        return jitted.lower(*args)

    def _jitted_and_args(self, key):
        """The jitted function executable `key` compiles, and its (abstract) arguments."""
        if key[0] == "forward":
            layout = layout_of(self._abstract_inputs(key[1]))
            return self._forward(layout, "hidden" in key and (self.hidden_layers or True), "decode" in key), (
                self.state, self.kv_cache, self._packed(layout), self.last_tokens, self.block_table)
        if key[0] == "kv_forward":  # over another runner's step: its inputs carry LoRA slots if its do
            layout = layout_of(self._abstract_inputs(key[1], lora="lora" in key))
            return self._kv_forward(layout), (self.state, self.kv_cache, self._packed(layout), self.last_tokens,
                                              self.block_table)
        if key[0] == "multi_step":
            layout = layout_of(self._abstract_multi_step_inputs(key[1]))
            return self._multi_step(layout), (self.state, self.kv_cache, self._packed(layout), self.last_tokens,
                                              self.block_table)
        if key[0] == "sample":
            _, num_rows, full, *greedy = key
            logits = jax.ShapeDtypeStruct((num_rows, self.vocab_size), jnp.float32, sharding=self._replicated)
            i32 = jax.ShapeDtypeStruct((num_rows,), jnp.int32)
            history = HistoryInputs(i32, i32, i32, i32) if full else None
            layout = layout_of((self.sampling_metadata(None, num_rows, full, bool(greedy)), i32, history))
            return self._sample(layout), (logits, self._packed(layout), self.last_tokens, self.token_history)
        if key[0] == "write_lora":
            slot = jax.ShapeDtypeStruct((), jnp.int32, sharding=self._replicated)
            return self._lora_writer, (self.state, slot, abstract_slot(self.lora_linears.values(), self._replicated))
        if key[0] == "write_block_table":
            entries = jax.ShapeDtypeStruct((key[1],), jnp.int32, sharding=self._replicated)
            return self._table_writer, (self.block_table, entries, entries, entries)
        if key[0] == "write_history":
            rows = jax.ShapeDtypeStruct((key[1],), jnp.int32, sharding=self._replicated)
            tokens = jax.ShapeDtypeStruct((key[1], key[2]), jnp.int32, sharding=self._replicated)
            return self._history_writer, (self.token_history, rows, tokens)
        op, num_blocks = key
        blocks = jax.ShapeDtypeStruct((num_blocks,), jnp.int32, sharding=self._replicated)
        if op == "copy_blocks":
            return self._copy, (self.kv_cache, blocks, blocks)
        if op == "swap_out":
            return self._gather, (self.kv_cache, blocks)
        return self._scatter, (self.kv_cache, self._swapped_pages_shape(num_blocks), blocks)

    def write_lora_slot(self, slot: int, weights: list):
        """Fill LoRA slot `slot` (jpaged/lora/manager.py): `weights` holds (A, B) per adaptable
        projection, in `lora_linears` order, zeros where the adapter leaves it alone. One
        executable, compiled at warm-up, whatever the adapter."""
        self.dispatch_op("write_lora", np.int32(slot), weights)

    def _write_lora(self, slot, weights):
        self.state = self._executable(("write_lora",))(self.state, slot, weights)

    def _swapped_pages_shape(self, num_blocks: int) -> jax.ShapeDtypeStruct:
        """Pages in flight between the pool and the host: [layers, k/v, kv_heads, blocks, page_size, head_dim]."""
        return jax.ShapeDtypeStruct(self.kv_cache_spec.swapped_pages_shape(num_blocks), self.kv_cache.k_pages.dtype,
                                    sharding=self._pages_sharding)

    def _executable(self, key):
        executable = self._executables.get(key)
        if executable is None and self.warmup is not None and key in self.warmup.keys:
            self.warmup.wait_for(key)  # (the scheduler's limit keeps steps off shapes not in yet)
            executable = self._executables.get(key)
        if executable is None:
            if self.warmup is not None and key in self.warmup.failed:
                raise RuntimeError(f"the step shape {key} failed to compile at warm-up "
                                   f"({self.warmup.failed[key]!r}): requests that need it cannot run")
            if self._warm:
                logger.warning("compiling an unexpected step shape %s while serving", key)
            executable = self._executables[key] = self._compile(key)
        return executable

    def _abstract_inputs(self, num_tokens: int, lora: bool | None = None) -> StepInputs:
        num_seqs = self.buckets.seqs(num_tokens)
        i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
        attn = AttentionMetadata(i32((num_tokens,)), None, i32((num_seqs,)), i32((num_seqs + 1,)),
                                 key_limits=i32((num_tokens,)) if self.mm_prefix else None)
        lora = lora if lora is not None else self.lora_linears
        return StepInputs(i32((num_tokens,)), i32((3, num_tokens) if self.mrope else (num_tokens,)), attn,
                          i32((self.buckets.sample_rows(num_tokens),)), i32((num_tokens,)),
                          i32((num_tokens,)) if lora else None, i32((num_seqs,)))

    def _abstract_multi_step_inputs(self, num_tokens: int):
        """A K-step decode's inputs: the first step's, its sampler metadata (fast variant) and
        sampled rows' last_tokens entries, and the slots of the K - 1 later steps' tokens."""
        inputs = self._abstract_inputs(num_tokens)
        num_rows = inputs.logits_indices.shape[0]
        smeta = self.sampling_metadata(None, num_rows, False)
        i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
        return inputs, smeta, i32((num_rows,)), i32((self.buckets.num_scheduler_steps - 1, num_tokens))

    def _packed(self, layout: Layout) -> jax.ShapeDtypeStruct:
        """The abstract packed inputs of `layout`, replicated on every device."""
        return jax.ShapeDtypeStruct((layout.size,), jnp.int32, sharding=self._replicated)

    def sampling_metadata(self, batch: StepBatch | None, num_rows: int, full: bool,
                          all_greedy: bool = False) -> sampler.SamplingMetadata:
        """The step's sampler arrays, gathered from the InputBatch (step_inputs.py); `batch` None:
        the padding alone (a warm-up's shapes)."""
        return step_inputs.sampling_metadata(self.input_batch, batch, num_rows, full, self.vocab_size,
                                             self.step_builder.eos_token_id, self.batch_invariant, all_greedy)

    def execute(self, plan, lora_slots: dict[int, int], multi_step: bool = False) -> DispatchedStep:
        """Build the plan's inputs (step_inputs.py) and start its step on the device. Groups
        whose inputs cannot be built are left out; if the batch fails to dispatch, each group
        runs alone to find the one(s) at fault (computing a group's tokens twice rewrites the
        same K/V into the same slots). `lora_slots`: the step's adapters' device slots."""
        with self.clock.phase("prepare"):
            batch, failed = self.step_builder.build(plan, lora_slots)
            if self.mm is not None:
                self.mm.prepare(batch)
        step = DispatchedStep(plan, [], [], failed)
        if not batch.groups:
            return step
        groups = batch.groups
        try:
            step.handles.append(self.dispatch(batch, multi_step, plan.spec_disabled))
            step.results = [(scheduled, 0, row) for scheduled, _, row in groups]
        except Exception:
            if len(batch.groups) == 1 or not self.is_alive():
                raise
            for k, (scheduled, _, _) in enumerate(groups):
                try:
                    step.handles.append(self.dispatch(batch.group(k), multi_step, plan.spec_disabled))
                except Exception as e:
                    if not self.is_alive():
                        raise
                    failed[scheduled.seq_group.request_id] = (scheduled.seq_group, e)
                    continue
                step.results.append((scheduled, len(step.handles) - 1, 0))
        return step

    def dispatch(self, batch: StepBatch, multi_step: bool = False, spec_disabled: bool = False) -> "StepHandle":
        """Start one step on the device and return at once. `multi_step`: a decode step (one
        token and one sample per sequence, fast sampler) run num_scheduler_steps times in one
        device call, each step's sampled tokens the next one's inputs; the block tables must hold
        the later tokens' slots (the scheduler's lookahead slots). `spec_disabled`: skip the
        proposer's hooks (from hookless_from tokens)."""
        with self.clock.phase("prepare"):
            return self._dispatch(batch, multi_step, spec_disabled)

    def _dispatch(self, batch: StepBatch, multi_step: bool, spec_disabled: bool) -> "StepHandle":
        ib = self.input_batch
        step = prepare_step(batch, ib, self.serving_buckets, self.block_size, multi_step,
                            lora_slots=ib.lora_slot[batch.rows] if self.lora_linears else None)
        if self.mrope or self.mm_prefix:  # M-RoPE positions, images' key limits (MultimodalEngine.step_inputs)
            step.inputs = self.mm.step_inputs(batch, step.inputs)
        self.flush_block_table(self.dispatch_op)
        inputs, num_sample_rows = step.inputs, len(step.inputs.logits_indices)
        hooks = not (spec_disabled and step.num_tokens >= self.hookless_from)
        if self.return_hidden or self.proposer.drafts_ahead:  # (None: this step skipped the hooks)
            self.last_prepared = step if hooks else None
        full = not multi_step and step_inputs.needs_full_sampler(ib, batch)
        greedy = not multi_step and not full and step_inputs.is_all_greedy(ib, batch)
        smeta = self.sampling_metadata(batch, num_sample_rows, full, greedy)
        if not multi_step:
            history = step_inputs.history_inputs(
                ib, batch, num_sample_rows, self.buckets.history,
                lambda rows, tokens: self.dispatch_op("write_history", rows, tokens)) if full else None
            key = (step.num_tokens, full, hooks, step.decode, greedy)
            if batch.deferred:  # grammar rows behind a step in flight: sampled once it is read (deferred_sample.py)
                return self.defer_sample(key, pack(inputs), smeta, step.dst_rows, history, batch, step.num_rows)
            packed = pack(inputs), pack((smeta, step.dst_rows, history))
            with self.clock.phase("launch"):
                out = self.dispatch_op("run_step", key, *packed)
            return StepHandle(out, num_sample_rows, smeta.num_logprobs, step.num_rows)
        packed = pack((inputs, smeta, step.dst_rows, step.lookahead_slots))
        with self.clock.phase("launch"):
            out = self.dispatch_op("run_multi_step", step.num_tokens, packed)
        return StepHandle(out, num_sample_rows, 0, step.num_rows, self.buckets.num_scheduler_steps)

    @staticmethod
    def collect(handle: "StepHandle") -> list[sampler.SamplerOutput]:
        """Wait for a dispatched step: its sampler output as numpy arrays (its real rows), one per
        step it ran (several: a multi-step decode)."""
        # Outputs are replicated: any local copy is the whole.
        packed = np.asarray(handle.out.addressable_data(0)).reshape(handle.num_steps, -1)
        return [unpack_output(part, handle.num_rows, handle.num_logprobs, handle.num_real_rows) for part in packed]

    def flush_block_table(self, dispatch_op, op: str = "write_block_table"):
        """Send the device's block table the entries the InputBatch wrote since the last flush
        (each chunk a device operation `op` through `dispatch_op`: multi-host sends it too)."""
        rows, cols, values = self.input_batch.take_table_updates()
        for chunk in update_chunks(rows, cols, values):
            dispatch_op(op, *chunk)

    def _write_block_table(self, rows: np.ndarray, cols: np.ndarray, values: np.ndarray):
        self.block_table = self._executable(("write_block_table", len(rows)))(self.block_table, rows, cols, values)

    def _write_history(self, rows: np.ndarray, tokens: np.ndarray):
        self.token_history = self._executable(("write_history",) + tokens.shape)(self.token_history, rows, tokens)

    def run_kv_forward(self, num_tokens: int, inputs: np.ndarray, last_tokens, block_table, lora: bool = False):
        """Another runner's step's K/V-only forward over these pages (a draft's), read through
        that runner's `block_table`; `lora`: its inputs carry LoRA slots."""
        key = ("kv_forward", num_tokens) + (("lora",) if lora else ())
        self.kv_cache = self._executable(key)(self.state, self.kv_cache, inputs, last_tokens, block_table)

    def run_multi_step(self, num_tokens: int, inputs: np.ndarray):  # (a draft model's proposals)
        return self._run_multi_step(num_tokens, inputs)

    def _run_multi_step(self, num_tokens: int, inputs: np.ndarray):
        out, self.kv_cache, self.last_tokens = self._executable(("multi_step", num_tokens))(
            self.state, self.kv_cache, inputs, self.last_tokens, self.block_table)
        return out

    # ------------------------------------------------------------------ multi-host (distributed.DriverOps)
    def _run_op(self, op: str, args: tuple):
        """Device operation `op` (a name: a multi-host driver sends it) on host inputs `args`. The
        table is built per call, so methods replaced on the instance count (scripts/bench_host.py
        stubs the steps)."""
        ops = {"run_step": self._run_step, "run_forward": self._run_forward, "run_sample": self._run_sample,
               "run_multi_step": self._run_multi_step, "write_history": self._write_history,
               "write_block_table": self._write_block_table,
               "copy_blocks": self._copy_blocks, "swap_out": self._swap_out, "swap_in": self._swap_in,
               "write_lora": self._write_lora, **self.proposer.device_ops()}
        return ops[op](*args)
