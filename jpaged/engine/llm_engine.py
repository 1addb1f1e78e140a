"""LLMEngine: requests in, incremental outputs out, one scheduler iteration per `step()`.

One step's data flows one way: scheduler (which sequences compute which tokens, block copies
and swaps) -> runner (padded host arrays, precompiled jitted step: write KV, attend, sample)
-> sampled ids -> sequences updated, detokenized, stop checks -> RequestOutputs.
"""

import functools
import logging
import os
import threading
import time

import jax

from jpaged import devices
from jpaged.config import EngineConfig
from jpaged.core.block_manager import BlockManager
from jpaged.core.detokenizer import Detokenizer
from jpaged.core.pending_output import detokenizes_later
from jpaged.step_clock import StepClock
from jpaged.core.kv_allocation import KVUsage, kv_usage
from jpaged.core.kv_map import KVMap
from jpaged.core.output_processor import OutputProcessor
from jpaged.core.scheduler import Scheduler
from jpaged.core.scheduler_output import SchedulerOutputs
from jpaged.core.sequence import Sequence, SequenceGroup
from jpaged.core.step_needs import can_multi_step, can_overlap
from jpaged.core.stop_checker import StopChecker
from jpaged.core.structured_output import StructuredOutputManager
from jpaged.engine import start_up
from jpaged.engine.engine_stats import engine_stats
from jpaged.engine.request_validator import RequestValidator
from jpaged.kv_events.events import KVEventBatch
from jpaged.kv_events.publisher import make_publisher
from jpaged.log_notes import explain_slow_compile_alarm
from jpaged.lora.manager import LoRAManager, check_lora_request
from jpaged.lora.model import add_lora_slots
from jpaged.lora.request import LoRARequest
from jpaged.models.kv_cache import KVCacheSpec, kv_dtype
from jpaged.models.layers import common_sliding_window
from jpaged.models.loader import load_model_of
from jpaged.models.paged_attention import check_kernels
from jpaged.outputs import RequestOutput
from jpaged.parallel import distributed
from jpaged.runner.executable_cache import ExecutableCache
from jpaged.runner.model_runner import ModelRunner
from jpaged.runner.step_inputs import DispatchedStep
from jpaged.sampling_params import SamplingParams
from jpaged.spec_decode.config import EAGLE_METHODS
from jpaged.spec_decode.draft_model import DraftModelProposer, load_draft_model
from jpaged.spec_decode.eagle import EagleProposer
from jpaged.spec_decode.eagle_head import load_eagle_head
from jpaged.spec_decode.ngram import NgramProposer
from jpaged.spec_decode.speculator import Speculator

logger = logging.getLogger(__name__)

# vLLM's default step token budget with chunked prefill.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


class StepFailedError(RuntimeError):
    """Processing some requests raised: they were aborted (`request_ids`); `outputs` are the other
    requests' outputs of the step, and the engine goes on serving them."""

    def __init__(self, request_ids: list[str], cause: BaseException, outputs: list[RequestOutput]):
        super().__init__(f"processing requests {request_ids} failed: {cause!r}")
        self.request_ids, self.outputs = request_ids, outputs


class LLMEngine:
    """The engine: requests in, RequestOutputs out, one `step` at a time.

    A step is schedule (Scheduler) -> execute (ModelRunner) -> update (Scheduler.update_from_output)
    -> outputs (OutputProcessor). A request whose processing raises is aborted (its blocks freed)
    and the step raises StepFailedError naming it, with the other requests' outputs; the engine
    goes on with the next step. If the device state was lost, the error itself is raised: the
    engine cannot continue.

    With async_scheduling (the default unless num_scheduler_steps > 1), a step whose sampled ids
    the next step does not need on the host (every group decoding, no seat free for a waiting
    request, blocks to spare: step_needs.can_overlap) stays in flight: the next call schedules and
    dispatches the next step, whose inputs take those ids on the device, and only then reads and
    processes the previous one, so the host works while the device runs. A grammar row's mask
    needs its matcher advanced by the previous step's token: that step's forward is dispatched
    before the read and its sampler after it (runner/deferred_sample.py). Outputs then come one
    call later; once every request has ended, the call that reads the last of them also reads the
    step still in flight, so none is left behind.

    With num_scheduler_steps = K > 1, a step where every running sequence decodes with the fast
    sampler (step_needs.can_multi_step) runs K decode steps in one device call: K tokens per
    sequence come back at once, and those after a sequence's stop are dropped.
    """

    def __init__(self, config: EngineConfig, stop_start_up: threading.Event | None = None):
        self.config = config
        if config.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size={config.data_parallel_size}: an LLMEngine is one replica; "
                             "jpaged.LLM and `jpaged serve` run several (jpaged/data_parallel)")
        devices.select(config.device)
        distributed.initialize(config.coordinator_address, config.num_processes, config.process_id)
        devices.check(config.device)
        loaded = load_model_of(config)
        self.devices = start_up.engine_devices(loaded)  # config.devices resolved, in mesh order
        self.model_memory_bytes = loaded.model_memory_bytes
        self.tokenizer, self.hf_config = loaded.tokenizer, loaded.hf_config
        if config.tokenizer is not None:  # vLLM's --tokenizer: another directory or hub id
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
        self.detokenizer = Detokenizer(self.tokenizer) if self.tokenizer is not None else None
        # Requests added from now on whose text decides nothing here get it made by the caller's
        # other thread: step() gives PendingOutputs for them (core/pending_output.py; the server's).
        self.detokenize_later = False
        self.structured_output = StructuredOutputManager(self.tokenizer, self.hf_config.vocab_size,
                                                         config.grammar_compile_timeout, config.grammar_compile_memory)
        self.max_model_len = start_up.derive_max_model_len(loaded.hf_config, config.max_model_len)
        max_num_batched_tokens = config.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, config.max_num_seqs)
        kv_cache_spec = KVCacheSpec.of_model(loaded.model, config.block_size,
                                             kv_dtype(config.kv_cache_dtype, loaded.dtype), config.tensor_parallel_size,
                                             config.kv_cache_v_transposed)
        check_kernels(loaded.model, kv_cache_spec, loaded.dtype, config.attention_backend)
        spec_config = config.speculative_config
        lora_targets = add_lora_slots(loaded.model, loaded.mesh, config.max_loras, config.max_lora_rank) \
            if config.enable_lora else None
        if lora_targets == {}:
            raise ValueError(f"enable_lora: {config.model} has no projection LoRA can adapt (q/k/v/o, gate/up/down)")
        draft = load_draft_model(config, loaded, self.max_model_len) \
            if spec_config and spec_config.method == "draft_model" else None
        eagle = load_eagle_head(config, loaded) if spec_config and spec_config.method in EAGLE_METHODS else None
        # Per device: its kv heads' part of every block (a draft's pages have the same blocks).
        bytes_per_block = kv_cache_spec.bytes_per_block + sum(d.kv_cache_spec.bytes_per_block for d in (draft, eagle) if d)
        cache_dir = start_up.executable_cache_dir() if config.executable_cache else None
        options = {} if config.optimization_level is None else {"xla_backend_optimization_level": config.optimization_level}
        executable_cache = functools.partial(ExecutableCache, cache_dir, compiler_options=options)
        fingerprint = start_up.model_fingerprint(config, loaded, self.max_model_len)
        shape = dict(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     max_model_len=self.max_model_len,
                     num_speculative_tokens=spec_config.num_speculative_tokens if spec_config else 0)
        # On a GPU the pool is what the memory plan leaves after the largest executables' needs,
        # measured from their compiled memory analysis (kv_pool_size.py, runner/step_memory.py).
        measure = lambda: start_up.measure_step_memory(  # noqa: E731
            loaded, kv_cache_spec, shape, config.num_scheduler_steps,
            executable_cache(fingerprint, self.devices))
        # Every process must allocate the same pool: the smallest one that fits everywhere.
        proposer_state = DraftModelProposer.device_state_bytes(draft, **shape) if draft else \
            EagleProposer.device_state_bytes(eagle, **shape) if eagle else 0
        pool = start_up.kv_pool_size(config, self.max_model_len, bytes_per_block, self.devices, measure, proposer_state)
        num_gpu_blocks, num_cpu_blocks = distributed.min_across_processes(pool.num_gpu_blocks), pool.num_cpu_blocks
        self.memory_plan = pool.plan  # a GPU's (kv_pool_size.GpuMemoryPlan), None when not planned from its memory
        start_up.reserve_device_memory(self.devices, num_gpu_blocks * bytes_per_block)
        kv_scales, scales = start_up.kv_scales(config, loaded, kv_cache_spec)
        start_up.log_start_up(config, loaded, self.devices, pool, num_gpu_blocks, bytes_per_block,
                              kv_cache_spec.dtype.name, scales)
        explain_slow_compile_alarm()
        self.kv_cache_dtype = kv_cache_spec.dtype.name
        self.block_manager = BlockManager(config.block_size, num_gpu_blocks, num_cpu_blocks,
                                          enable_caching=config.enable_prefix_caching,
                                          kv_allocation=config.kv_allocation, max_model_len=self.max_model_len,
                                          sliding_window=common_sliding_window(loaded.model))
        # KV events (vLLM's wire format, jpaged/kv_events): the prefix cache's changes, published
        # after every step for KV-aware routers. Opened now: a busy address fails the start-up.
        self.kv_event_publisher = make_publisher(config.kv_events_config, config.data_parallel_rank)
        if config.kv_events_config is not None and config.kv_events_config.enabled:
            self.block_manager.enable_kv_events()
        # Debug mode (the tests turn it on): check the block pool's invariants after every step.
        self.check_invariants = os.environ.get("JPAGED_CHECK_INVARIANTS", "0") not in ("", "0")
        shape = dict(num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks, **shape)
        # Speculative decoding's proposer (spec_decode/proposer.py); a draft model's owns its runner.
        self.proposer = DraftModelProposer(
            draft, executable_cache(f"{fingerprint}\ndraft\n" + start_up.model_fingerprint(
                config, draft.loaded, self.max_model_len), self.devices),
            target_lora=lora_targets is not None, **shape) if draft else \
            EagleProposer(eagle, executable_cache(f"{fingerprint}\n{spec_config.method}\n{spec_config.model}",
                                                  self.devices),
                          target_lora=lora_targets is not None, **shape) if eagle else \
            NgramProposer(spec_config) if spec_config else None
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=self.max_model_len,
                                   preemption_mode=config.preemption_mode,
                                   stop_checker=StopChecker(self.max_model_len, getattr(self.tokenizer, "eos_token_id", None),
                                                            self.detokenizer, self.structured_output),
                                   speculator=Speculator(spec_config, self.max_model_len, self.structured_output,
                                                         self.proposer) if spec_config else None,
                                   max_loras=config.max_loras if config.enable_lora else None)
        self.request_validator = RequestValidator(self.hf_config.vocab_size, self.max_model_len, config,
                                                  self.block_manager)
        self.output_processor = OutputProcessor(self.scheduler.stop_checker)
        # Where each step's time goes (step_clock.py): the runner and the detokenizer report to it.
        self.clock = StepClock()
        self.runner = ModelRunner(loaded, kv_cache_spec, **shape, num_scheduler_steps=config.num_scheduler_steps,
                                  clock=self.clock,
                                  executable_cache=executable_cache(fingerprint, self.devices),
                                  kv_scales=kv_scales,
                                  calculate_kv_scales=kv_cache_spec.quantized and config.calculate_kv_scales,
                                  proposer=self.proposer, block_manager=self.block_manager,
                                  structured_output=self.structured_output, stop_checker=self.scheduler.stop_checker,
                                  seed=config.seed,
                                  disable_by_batch_size=spec_config.disable_by_batch_size if spec_config else None)
        start_up.check_allocated([p.kv_cache for p in self.runner.pools], num_gpu_blocks * bytes_per_block,
                                 self.devices)
        self.lora_manager = LoRAManager(lora_targets, self.runner, max_loras=config.max_loras,
                                        max_lora_rank=config.max_lora_rank, max_cpu_loras=config.max_cpu_loras,
                                        dtype=loaded.dtype) if lora_targets else None
        if config.enforce_eager:
            pass
        elif config.background_warmup and jax.process_count() == 1 and draft is None:
            self.runner.start_warm_up(stop_start_up)  # serving starts on the first executables (runner/warmup.py)
        else:  # a draft model's runner and multi-host followers compile everything first
            self._warm_up(stop_start_up)
        # The heap built so far (jax, the model, the tokenizer) lives as long as the engine: keep
        # it out of the cyclic collector's full passes, which otherwise cost milliseconds in the
        # middle of steps (measured: 5 ms per step at 256 sequences with async scheduling; vLLM
        # freezes its start-up heap too). Dropping the engine unfreezes it.
        start_up.freeze_heap(self)
        self._groups: dict[str, SequenceGroup] = {}
        self._in_flight: DispatchedStep | None = None  # async_scheduling: a step not read yet
        # Overlap unless turned off; by default not with multi-step decode, whose K-step calls
        # each start from tokens on the host (an overlapped engine always has a step in flight).
        self.async_scheduling = config.async_scheduling if config.async_scheduling is not None \
            else config.num_scheduler_steps == 1

    @property
    def eos_token_id(self) -> int | None:
        """The stop checks' EOS (owned by the scheduler's StopChecker; tests point it at a frequent token)."""
        return self.scheduler.stop_checker.eos_token_id

    @eos_token_id.setter
    def eos_token_id(self, token_id: int | None):
        self.scheduler.stop_checker.eos_token_id = token_id

    def _warm_up(self, stop: threading.Event | None):
        """Compile (or load) every step; a warm-up that fails after loading cached executables is
        retried once with the cache bypassed (it verifies every file, but XLA is the last judge)."""
        try:
            self.runner.warm_up(stop)
        except Exception as e:
            hits = self.runner.executable_cache.hits + self.runner.proposer.executable_cache_hits
            if hits == 0:
                raise
            logger.warning("start-up failed after loading %d cached executables (%r); retrying once with the "
                           "executable cache bypassed", hits, e)
            self.runner.bypass_executable_cache()
            self.runner.warm_up(stop)

    def wait_for_warmup(self, timeout: float | None = None) -> bool:
        """Until every executable is compiled (or failed) in the background warm-up (True), or
        `timeout` seconds. At once without a background warm-up."""
        return self.runner.warmup is None or self.runner.warmup.wait(timeout)

    def warmup_progress(self) -> dict:
        """The warm-up's progress for /health: executables compiled of all, and "ready" once all are in."""
        warmup = self.runner.warmup
        if warmup is None:
            return {"ready": True}
        return {"ready": warmup.ready, "compiled": warmup.compiled, "total": warmup.total,
                **({"failed": len(warmup.failed)} if warmup.failed else {})}

    def stats_while_warming(self) -> dict:
        """The stats a background warm-up changes while no step runs."""
        warmup = self.runner.warmup
        return {} if warmup is None else {"warmup_executables_remaining": warmup.remaining,
                                          "warmup_executables_total": warmup.total,
                                          "num_compilations": self.runner.num_compilations}

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None):
        if not isinstance(prompt, (str, list, tuple)):  # vLLM's dict prompts, with images: multimodal/runner.py
            return self.runner.add_multimodal_request(self, request_id, prompt, sampling_params, arrival_time, lora_request)
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if self.runner.slept is not None:
            raise ValueError(f"the engine is asleep (sleep level {self.runner.slept.level}): call wake_up() first")
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, ids = None, list(prompt)
        else:
            raise ValueError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        self.check_request(ids, sampling_params)
        if lora_request is not None:
            check_lora_request(lora_request, self.lora_manager).add(lora_request)
        if sampling_params.guided:  # compiled now unless the server already did (off its event loop)
            self.structured_output.prepare(sampling_params)
        seq = Sequence(self.scheduler.new_seq_id(), ids)
        seq.detokenize_later = self.detokenize_later and detokenizes_later(sampling_params)
        if lora_request is not None:
            seq.cache_salt = f"lora:{lora_request.lora_int_id}".encode()
        group = SequenceGroup(request_id, [seq], sampling_params,
                              arrival_time if arrival_time is not None else time.monotonic(), prompt=text,
                              lora_request=lora_request)
        self._groups[request_id] = group
        self.scheduler.add_seq_group(group)

    def check_request(self, prompt_token_ids: list[int], sp: SamplingParams):
        """ValueError naming the field and the limit unless the request can run to completion here
        (request_validator.py). Cheap: the server calls it before it builds anything."""
        self.request_validator.check(prompt_token_ids, sp)

    def abort_request(self, request_id: str):
        if request_id in self._groups:
            self.scheduler.abort_seq_group(request_id)
            self._forget(self._groups.pop(request_id))

    def _forget(self, group: SequenceGroup):
        """The group left the engine (finished or aborted): drop what it kept outside the scheduler."""
        if group.sampling_params.guided:
            for seq in group.seqs:
                self.structured_output.free(seq.seq_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> execute -> update the sequences -> outputs. With async
        scheduling a step's update and outputs may come one call later; a request whose
        processing raised is aborted and the step raises StepFailedError (class docstring)."""
        previous, self._in_flight = self._in_flight, None
        if previous is not None and not self._can_overlap(previous):
            return self._complete(previous)
        num_steps = self.config.num_scheduler_steps
        multi_step = previous is None and can_multi_step(self.scheduler, num_steps, self.max_model_len)
        self.scheduler.token_limit = self.runner.token_limit
        with self.clock.phase("schedule"):
            plan = self.scheduler.schedule(num_steps - 1 if multi_step else 0)
        if not plan.scheduled_seq_groups and self.scheduler.token_limit is not None:
            self._wait_for_executables()
        current = self._dispatch(plan, multi_step, previous)
        if previous is None and (multi_step or not self._can_overlap(current)):
            return self._complete(current)
        self._in_flight = current
        try:
            outputs = self._complete(previous) if previous is not None else []
        finally:  # grammar rows' masks from the matchers that just took `previous`'s tokens (runner/deferred_sample.py)
            self.runner.sample_deferred(current)
        if self._in_flight is not None and not self.scheduler.has_unfinished_seqs():
            # Every request ended with the step just read: the one in flight only holds their
            # extra tokens (dropped). Read it now, so that no step is left in flight when the
            # caller stops stepping (and the next request starts from a clean engine).
            in_flight, self._in_flight = self._in_flight, None
            outputs += self._complete(in_flight)
        return outputs

    def _wait_for_executables(self):
        """Nothing could be scheduled: no step is compiled yet. Wait for the background warm-up's
        next executable (not spinning: it needs the cores); once it has ended with none, the
        waiting requests fail with its error."""
        warmup = self.runner.warmup
        if not warmup.done.is_set():
            warmup.wait_for_progress(0.1)
            return
        if self.scheduler.token_limit:
            return
        cause = RuntimeError("no step shape could be compiled at warm-up: " + "; ".join(
            f"{key}: {error!r}" for key, error in list(warmup.failed.items())[:3]))
        groups = list(self.scheduler.waiting)
        self._fail(groups, cause)
        raise StepFailedError([g.request_id for g in groups], cause, [])

    def _can_overlap(self, dispatched: DispatchedStep) -> bool:
        """Whether the next step may be scheduled before `dispatched` is read (step_needs.py)."""
        return (self.async_scheduling and not dispatched.failed  # (verified drafts: accepted count unknown)
                and (self.proposer is None or not any(s.spec_token_ids for s in dispatched.plan.scheduled_seq_groups))
                and can_overlap(self.scheduler, dispatched.results, self.max_model_len, dispatched.plan.lane))

    def _dispatch(self, plan: SchedulerOutputs, multi_step: bool, previous: DispatchedStep | None) -> DispatchedStep:
        """Make the plan's block copies and start its step on the device (the runner builds its
        inputs). Its tokens count as computed from now on; each sequence's sampled token is
        pending until it is read. If the block copies or a lone request's device step fail, the
        plan's requests are aborted."""
        try:
            with self.clock.phase("block_ops"):
                self.runner.swap_out(plan.blocks_to_swap_out)
                self.runner.swap_in(plan.blocks_to_swap_in)
                self.runner.copy_blocks(plan.blocks_to_copy)
            if self.proposer is not None:  # after the block moves: a victim's pages leave before drafts take its blocks
                with self.clock.phase("propose"):
                    self.proposer.propose(plan, self.scheduler, self.runner, self.runner.step_builder.seed_of)
            lora_slots = self.lora_manager.slots_of(plan.scheduled_seq_groups) if self.lora_manager else {}
            dispatched = self.runner.execute(plan, lora_slots, multi_step)
            self.runner.proposer.after_dispatch(dispatched, self.runner)  # (EAGLE: the next step's drafts)
        except Exception as e:
            outputs = self._complete(previous) if previous is not None else []
            groups = [s.seq_group for s in plan.scheduled_seq_groups]
            self._fail(groups, e)
            if not self.runner.is_alive():
                raise
            raise StepFailedError([g.request_id for g in groups], e, outputs) from e
        self.scheduler.on_dispatched_step(dispatched.results, dispatched.plan.lane)
        return dispatched

    def _complete(self, dispatched: DispatchedStep) -> list[RequestOutput]:
        """Read a dispatched step's sampled ids, have the scheduler update the sequences from them,
        and build the outputs. Groups that finished or were aborted meanwhile drop their tokens."""
        self.runner.sample_deferred(dispatched)  # (done already when it was in flight)
        failed = dispatched.failed
        read = [None] * len(dispatched.handles)  # each handle's outputs, read once
        clock = self.clock
        with clock.phase("read"):
            results = dispatched.read_whole(self.runner.collect)  # (a decode lane's step, all still running)
            for scheduled, h, row in () if results else dispatched.results:
                group = scheduled.seq_group
                if group.request_id in failed or group.is_finished() or self._groups.get(group.request_id) is not group:
                    continue  # ended while this step ran: its tokens of this step are dropped
                try:
                    if read[h] is None:
                        read[h] = self.runner.collect(dispatched.handles[h])
                except Exception as e:
                    if not self.runner.is_alive():
                        raise
                    failed[group.request_id] = (group, e)
                    continue
                results.append((scheduled, read[h], row))
            self.runner.proposer.read_ahead(dispatched, self.runner)
        detokenized = self.detokenizer.seconds if self.detokenizer is not None else 0.0
        with clock.phase("update"):
            failed.update(self.scheduler.update_from_output(results, dispatched.plan.lane))
        if self.detokenizer is not None:  # (detokenizing runs inside the stop checks)
            clock.move("update", "detokenize", self.detokenizer.seconds - detokenized)
        clock.step_done()
        with clock.phase("outputs"):
            outputs = self._outputs(dispatched, results, failed)
        if failed:
            cause = next(iter(failed.values()))[1]
            raise StepFailedError([group.request_id for group, _ in failed.values()], cause, outputs) from cause
        return outputs

    def _outputs(self, dispatched: DispatchedStep, results: list, failed: dict) -> list[RequestOutput]:
        """The step's RequestOutputs; failed groups aborted, finished ones forgotten, KV events published."""
        outputs = [o for scheduled, _, _ in results if scheduled.seq_group.request_id not in failed
                   for o in [self.output_processor.request_output(scheduled.seq_group)] if o is not None]
        for group in dispatched.plan.ignored_seq_groups:  # check_request keeps these out; a warning if one slips by
            logger.warning("request %s can never be scheduled: it ends with what it has", group.request_id)
            outputs.append(self.output_processor.request_output(group))
        if failed:
            self._fail([group for group, _ in failed.values()], next(iter(failed.values()))[1])
        for o in outputs:
            if o.finished and o.request_id in self._groups:
                self._forget(self._groups.pop(o.request_id))
        self.publish_kv_events()
        if self.check_invariants:
            self.block_manager.check_invariants()
        return outputs

    def publish_kv_events(self):
        """Send the prefix cache's stores, evictions and clears since the last call (KV events on)."""
        events = self.block_manager.take_events()
        if events:
            self.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))

    def shutdown(self):
        """Stop the background warm-up (after the compile under way: its cache file is written
        whole), flush and close what the engine opened outside the process (the KV events' sockets)."""
        if self.runner.warmup is not None:
            self.runner.warmup.shutdown()
        self.kv_event_publisher.shutdown()

    def _fail(self, groups: list[SequenceGroup], cause: Exception):
        logger.error("processing requests %s failed: %r; they are aborted", [g.request_id for g in groups], cause,
                     exc_info=cause)
        for group in groups:
            self.abort_request(group.request_id)

    # ------------------------------------------------------------------ stats
    def kv_usage(self) -> KVUsage:
        """The device KV slots now: holding tokens, reserved, internally fragmented, free. It
        visits every block table entry: read it when asked (per scrape, per benchmark step), not
        in stats(), which the server reads after every step."""
        return kv_usage(self.block_manager, self.scheduler.running, self.max_model_len)

    def kv_map(self) -> KVMap:
        return KVMap.of(self.block_manager, self.scheduler.running)

    def stats(self) -> dict:
        return engine_stats(self)
