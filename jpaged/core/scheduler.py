"""The iteration-level scheduler: FCFS continuous batching with chunked prefill and preemption
(paper §4.5; vLLM v0.5/0.6 semantics).

Every step it decides which sequence groups compute which tokens:
  1. Running groups that decode get one slot per sequence, in FCFS order. When the device
     blocks run out, whole groups are preempted from the end of the running queue (the latest
     first) until the current group fits or is preempted itself. Groups still prefilling then
     take their next chunk from what is left of the token budget.
  2. If nothing was preempted, swapped-out groups come back first (FCFS).
  3. If nothing was preempted and nothing is swapped out, waiting groups are admitted (FCFS)
     while blocks (leaving the watermark free), max_num_seqs and the token budget allow; a
     prompt longer than the remaining budget is split into chunks over several steps. With
     prefix caching, an admitted group starts computing at its first uncached token. The
     benchmark baseline kv_allocation="static" admits only while no running group decodes.
While the engine still compiles (a background warm-up), `token_limit` caps both the token budget
and the sequence seats at the largest step compiled so far.

With speculative decoding (a Speculator, spec_decode/), a decoding sequence may also carry
drafts: lookahead slots for them, a chunk of 1 + drafts tokens, from the token budget the
decodes leave; update_from_output accepts them (`_accept`).

Pooling requests (embeddings, classification: `SequenceGroup.pooling` set) are prefill only:
admitted FCFS with their whole input in one step (encoders attend both ways, and the input is
pooled at once); they take no KV blocks and finish with the step that computes them.

After the step, `update_from_output` makes every change its sampled tokens bring: appends (a
fresh prompt forks into its best_of sequences), beam search, accepted drafts, stop checks
(StopChecker), and frees the blocks of what finished. `on_dispatched` records, as the step starts, that its tokens
are computed. The engine, the tests' fake engine and the model-free paper replay all go through
these two (update_from_output lives in step_update.py, which Scheduler inherits): no other code
writes a sequence's state after a step.

Preemption by recompute frees a group's blocks and puts it back at the front of the waiting
queue: its prompt and outputs so far are prefilled again. Preemption by swap moves its blocks
to host memory. With preemption_mode=None a group with one running sequence is recomputed and
a larger one swapped (vLLM's choice); when host memory is full, swapping falls back to
recompute instead of failing the step.
"""

import collections
import dataclasses
import itertools

from jpaged.core.block_manager import AllocStatus, BlockManager
from jpaged.core import decode_lane
from jpaged.core.decode_lane import DecodeLane
from jpaged.core.scheduler_output import ScheduledSequenceGroup, SchedulerOutputs
from jpaged.core.sequence import Sequence, SequenceGroup, SequenceStatus
from jpaged.core.step_update import StepUpdate
from jpaged.core.stop_checker import StopChecker
from jpaged.multimodal.encoder_budget import encoder_chunk, take_encoder_rows
from jpaged.spec_decode.speculator import Speculator


@dataclasses.dataclass
class _Budget:
    """What is left of this step's limits."""

    num_tokens: int
    num_seqs: int
    images: dict = dataclasses.field(default_factory=dict)  # {mm_hash: rows} of the encoder cache this step reads


class Scheduler(StepUpdate):
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, preemption_mode: str | None = None, stop_checker: StopChecker | None = None,
                 seq_ids: itertools.count | None = None, speculator: Speculator | None = None,
                 max_loras: int | None = None):
        # Every running sequence decodes one token per step: they must all fit in one step.
        if not 1 <= max_num_seqs <= max_num_batched_tokens:
            raise ValueError(f"need 1 <= max_num_seqs ({max_num_seqs}) <= max_num_batched_tokens "
                             f"({max_num_batched_tokens})")
        if preemption_mode not in (None, "swap", "recompute"):
            raise ValueError(f"preemption_mode={preemption_mode!r}; expected None, 'swap' or 'recompute'")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.preemption_mode = preemption_mode
        self.waiting: collections.deque[SequenceGroup] = collections.deque()
        self.running: collections.deque[SequenceGroup] = collections.deque()
        self.swapped: collections.deque[SequenceGroup] = collections.deque()
        self.num_preemptions = 0
        self.stop_checker = stop_checker or StopChecker(max_model_len)
        self.seq_ids = seq_ids or itertools.count()  # new sequences' ids: requests' and forks'
        self.speculator = speculator  # speculative decoding (spec_decode/): drafts for decoding sequences
        self.max_loras = max_loras  # LoRA: adapters one step may run (device slots)
        # While the engine compiles in the background: the largest step (tokens, hence sequence
        # seats too) it has executables for (0: none yet); None: max_num_batched_tokens. It only grows.
        self.token_limit: int | None = None
        # The steady decode lane (decode_lane.py): the running groups when they all decode plainly.
        self.lane: DecodeLane | None = None
        self.use_lane = True  # (False: every step the general way; the tests compare the two)
        self._num_decode_one = 0  # running groups the last general pass scheduled by _decode_one

    def new_seq_id(self) -> int:
        return next(self.seq_ids)

    def add_seq_group(self, seq_group: SequenceGroup):
        self.waiting.append(seq_group)

    def abort_seq_group(self, request_id: str):
        """Finish the request as aborted and free its blocks now, whichever queue holds it."""
        for queue in (self.waiting, self.running, self.swapped):
            for seq_group in queue:
                if seq_group.request_id == request_id:
                    queue.remove(seq_group)
                    self.lane = None
                    self._finish(seq_group, SequenceStatus.FINISHED_ABORTED)
                    return

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get_num_unfinished_seq_groups(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def fork_seq(self, parent: Sequence, child: Sequence):
        """After the engine forked `child` from `parent` and added it to the group: share the blocks."""
        self.block_manager.fork(parent, child)

    def free_seq(self, seq: Sequence):
        """Right after the engine finished `seq`: its blocks go back at once."""
        self.block_manager.free(seq)

    def free_finished_seq_groups(self):
        """Drop finished groups from the running queue (update_from_output does, after a step),
        and from the decode lane when the queue is the lane."""
        lane = self.lane
        if lane is not None and lane.matches(self.running):
            keep = [not g.is_finished() for g in lane.rows.groups]
            if not all(keep):
                self.running = collections.deque(itertools.compress(lane.rows.groups, keep))
                if self.running:
                    lane.drop(keep)
                else:
                    self.lane = None
            return
        self.lane = None
        self.running = collections.deque(g for g in self.running if not g.is_finished())

    # ------------------------------------------------------------------ after the step
    def on_dispatched_step(self, results, lane=None):
        """on_dispatched for each group of a dispatched step (`results`: (ScheduledSequenceGroup,
        handle, row) each); a decode lane's step whole (`lane`, its LanePlan) row by row at once."""
        if not decode_lane.dispatched(lane, results):
            for scheduled, _, _ in results:
                self.on_dispatched(scheduled)

    def on_dispatched(self, scheduled: ScheduledSequenceGroup):
        """The group's step is on the device: its tokens count as computed from now on, and each
        sequence's sampled token is pending until it is read (a beam or a fork: read at once)."""
        # Drafts count as computed only once accepted (update_from_output); a sequence with drafts
        # samples several rows, so nothing of it is pending.
        chunk = scheduled.token_chunk_size - len(scheduled.spec_token_ids)
        pending = not scheduled.seq_group.sampling_params.use_beam_search
        for seq, samples in zip(scheduled.seqs, scheduled.samples):
            seq.num_computed_tokens += chunk
            if seq.num_computed_tokens > len(seq.prompt_token_ids) + len(seq.output_token_ids) + seq.num_pending_tokens:
                raise ValueError(f"{seq} computed more tokens than it has")
            if samples == 1 and pending:
                seq.num_pending_tokens += 1

    # ------------------------------------------------------------------ the plan

    def schedule(self, num_lookahead_slots: int = 0) -> SchedulerOutputs:
        """The next step's plan. `num_lookahead_slots`: each decoding sequence also gets slots for
        that many more tokens (multi-step decode samples them on the device)."""
        out = SchedulerOutputs()
        limit = self.token_limit
        num_tokens = self.max_num_batched_tokens if limit is None else min(limit, self.max_num_batched_tokens)
        num_seqs = self.max_num_seqs if limit is None else min(limit, self.max_num_seqs)
        lane, self.lane = self.lane, None
        if (lane is not None and self.use_lane and not num_lookahead_slots and len(lane) <= min(num_tokens, num_seqs)
                and lane.matches(self.running) and lane.schedule(out, self.block_manager)):
            # The steady decode lane (decode_lane.py): the running groups, one token each.
            self.lane = lane
            budget = _Budget(num_tokens - len(lane), num_seqs - len(lane))
        else:
            budget = _Budget(num_tokens, num_seqs - sum(g.get_max_num_running_seqs() for g in self.running))
            prefilling = self._schedule_running(out, budget, num_lookahead_slots)
            # Decodes came first; prompts already being prefilled take their next chunk.
            for seq_group in prefilling:
                chunk = self._chunk_size(seq_group, budget)
                if chunk:
                    self._add(out, budget, seq_group, chunk)
        # A preemption means blocks are short: don't bring anyone in this step.
        if not out.preempted:
            self._schedule_swapped(out, budget)
            if not self.swapped and not self._batch_closed():
                self._schedule_waiting(out, budget)
        if self.speculator is not None:  # disable_by_batch_size: the proposer skips its per-step work too
            out.spec_disabled = not self.speculator.enabled_for(self.running)
        elif (self.lane is None and self.use_lane and not out.preempted
              and 0 < self._num_decode_one == len(self.running) == len(out.scheduled_seq_groups)):
            # Every running group decoded plainly (_decode_one) and nothing else ran: a lane.
            self.lane = DecodeLane(list(self.running), list(out.scheduled_seq_groups), self.block_manager,
                                   self.stop_checker)
            out.lane = self.lane.first_plan()
        return out

    def _batch_closed(self) -> bool:
        """Request-level batching (kv_allocation="static", FasterTransformer-like): once a batch
        decodes, nobody joins it until all of it has finished."""
        return self.block_manager.kv_allocation == "static" and any(not g.is_prefill() for g in self.running)

    def _schedule_running(self, out: SchedulerOutputs, budget: _Budget,
                          num_lookahead_slots: int) -> list[SequenceGroup]:
        """Give each decoding group its slots, preempting the latest groups when blocks run out.
        Returns the groups still prefilling (they need no new blocks), in order."""
        queue, self.running = self.running, collections.deque()
        prefilling, swapped_out = [], []
        spare = 0 if self.speculator is None else \
            self.speculator.spare_tokens(queue, budget.num_tokens, self.max_num_batched_tokens, self.max_num_seqs)
        bm, pool = self.block_manager, self.block_manager.gpu_pool
        # The common decode, inlined (every running group, every step): _decode_one, else below.
        one = not num_lookahead_slots and not spare and bm.sliding_window is None
        self._num_decode_one = 0
        while queue:
            seq_group = queue.popleft()
            if one and len(seq_group.seqs) == 1 and self._decode_one(out, budget, seq_group):
                self._num_decode_one += 1
                continue
            if seq_group.is_prefill():
                prefilling.append(seq_group)
                self.running.append(seq_group)
                continue
            drafts = self.speculator.propose(seq_group, spare) if spare else []
            # (can_append_slots / _append_slots with the running sequences listed once: every
            # decoding group, every step)
            running = seq_group.get_seqs(SequenceStatus.RUNNING)
            while (needed := bm.num_blocks_to_append(running, num_lookahead_slots + len(drafts))) \
                    > pool.get_num_free_blocks():
                if drafts:  # blocks are short: decode without drafts before preempting anyone
                    drafts = []
                    continue
                victim = queue.pop() if queue else seq_group
                self._preempt(victim, out, swapped_out)
                if victim is seq_group:
                    break
            else:
                if needed:  # (none: no new block and no copy-on-write, append_slots would do nothing)
                    for seq in running:
                        out.blocks_to_copy.extend(bm.append_slots(seq, num_lookahead_slots + len(drafts)))
                self.running.append(seq_group)
                self._add(out, budget, seq_group, 1 + len(drafts), drafts, running)
                spare -= len(drafts)
        # Victims were taken latest first; keep the swapped queue in arrival order.
        self.swapped.extend(reversed(swapped_out))
        return prefilling

    def _decode_one(self, out: SchedulerOutputs, budget: _Budget, seq_group: SequenceGroup) -> bool:
        """The loop's body above for a lone running sequence decoding one token (no drafts,
        lookahead slots, window, prompt logprobs, images or forks), when its next slot needs no
        copy-on-write and at most a free block; False (nothing done): the general path decides."""
        seq = seq_group.seqs[0]
        if seq.status is not SequenceStatus.RUNNING or seq_group.prompt_logprobs is not None \
                or seq_group.pooling is not None or getattr(seq_group, "mm_items", None):
            return False
        seq_len = len(seq.prompt_token_ids) + len(seq.output_token_ids) + seq.num_pending_tokens
        start = seq.num_computed_tokens
        sp = seq_group.sampling_params
        if seq_len - start != 1 or sp.use_beam_search or (sp.best_of > 1 and not seq.output_token_ids):
            return False
        bm = self.block_manager
        table, index = bm.gpu_tables[seq.seq_id], (seq_len - 1) // bm.block_size
        if index < len(table):  # (bm.num_blocks_to_append and append_slots for this case)
            if bm.gpu_pool.blocks[table[index]].ref_cnt > 1:
                return False  # copy-on-write
        elif index == len(table) and bm.gpu_pool.get_num_free_blocks():
            table.append(bm.gpu_pool.allocate())
        else:
            return False  # blocks are short: preemption
        self.running.append(seq_group)
        if bm.enable_caching:  # (_add's)
            bm.cache_full_blocks(seq, min(start + 1, len(seq.prompt_token_ids) + len(seq.output_token_ids)),
                                 seq_group.lora_request)
        out.scheduled_seq_groups.append(ScheduledSequenceGroup(seq_group, 1, start, 0, [seq], [1]))
        out.num_batched_tokens += 1
        budget.num_tokens -= 1
        return True

    def _schedule_swapped(self, out: SchedulerOutputs, budget: _Budget):
        while self.swapped:
            seq_group = self.swapped[0]
            status = self.block_manager.can_swap_in(seq_group)
            if status is AllocStatus.NEVER:
                self.swapped.popleft()
                self._ignore(seq_group, out)
                continue
            num_seqs = seq_group.get_max_num_running_seqs()
            chunk = self._chunk_size(seq_group, budget)
            if status is AllocStatus.LATER or num_seqs > budget.num_seqs or not chunk or not self._lora_fits(seq_group):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(self.block_manager.swap_in(seq_group))
            for seq in seq_group.get_seqs(SequenceStatus.SWAPPED):
                seq.status = SequenceStatus.RUNNING
            self._append_slots(seq_group, out)  # can_swap_in counted the blocks this takes
            self.running.append(seq_group)
            budget.num_seqs -= num_seqs
            self._add(out, budget, seq_group, chunk)

    def _schedule_waiting(self, out: SchedulerOutputs, budget: _Budget):
        while self.waiting:
            seq_group = self.waiting[0]
            if (seq_group.get_unfinished_seqs()[0].get_len() > self.max_model_len
                    or seq_group.get_max_num_running_seqs() > self.max_num_seqs):
                status = AllocStatus.NEVER
            elif seq_group.pooling is not None:  # no KV pages: its whole input now, or it waits
                if not self._admit_pooling(seq_group, out, budget):
                    break
                continue
            else:
                status = self.block_manager.can_allocate(seq_group)
            if status is AllocStatus.NEVER:
                self.waiting.popleft()
                self._ignore(seq_group, out)
                continue
            num_seqs = seq_group.get_max_num_running_seqs()
            if (status is AllocStatus.LATER or num_seqs > budget.num_seqs or not self._lora_fits(seq_group)
                    or not self._chunk_size(seq_group, budget, seats_to_take=num_seqs)):
                break
            self.waiting.popleft()
            num_cached_tokens = self.block_manager.allocate(seq_group)
            if seq_group.num_cached_tokens is None:  # a recompute after preemption is not the request's
                seq_group.num_cached_tokens = num_cached_tokens
            for seq in seq_group.get_seqs(SequenceStatus.WAITING):
                seq.status = SequenceStatus.RUNNING
                seq.num_computed_tokens = num_cached_tokens
            self.running.append(seq_group)
            budget.num_seqs -= num_seqs
            chunk = self._chunk_size(seq_group, budget)  # (from its first uncached token: may be 0, an image's rest)
            if chunk:
                self._add(out, budget, seq_group, chunk)

    def _admit_pooling(self, seq_group: SequenceGroup, out: SchedulerOutputs, budget: _Budget) -> bool:
        """A pooling request joins the step with its whole input, or waits (FCFS). (Its engine
        keeps max_num_batched_tokens >= max_model_len, as vLLM does without chunked prefill, so
        every input fits an empty step.)"""
        num_tokens = seq_group.get_num_uncomputed_tokens()
        if budget.num_seqs < 1 or num_tokens > budget.num_tokens:
            return False
        self.waiting.popleft()
        for seq in seq_group.seqs:
            seq.status = SequenceStatus.RUNNING
        if seq_group.num_cached_tokens is None:
            seq_group.num_cached_tokens = 0
        self.running.append(seq_group)
        budget.num_seqs -= 1
        self._add(out, budget, seq_group, num_tokens)
        return True

    def _lora_fits(self, seq_group: SequenceGroup) -> bool:
        """Whether the group's adapter can join the running ones: at most max_loras distinct
        adapters run (each needs a device slot). A group that must wait for a slot stops the
        queue behind it (first come, first served: nobody overtakes it forever)."""
        lora = seq_group.lora_request
        if lora is None or self.max_loras is None:
            return True
        running = {g.lora_request.lora_int_id for g in self.running if g.lora_request is not None}
        return lora.lora_int_id in running or len(running) < self.max_loras

    def _chunk_size(self, seq_group: SequenceGroup, budget: _Budget, seats_to_take: int = 0) -> int:
        """Tokens per sequence the group can compute now: all it has left, up to its share of the
        token budget. With prompt logprobs, every prompt token computed (but the last) needs a
        logits row of its own, taken from the step's free sequence seats (after `seats_to_take`)."""
        chunk = min(seq_group.get_num_uncomputed_tokens(), budget.num_tokens // seq_group.num_unfinished_seqs())
        free = budget.num_seqs - seats_to_take
        if self._prompt_rows(seq_group, chunk) > free:
            chunk = max(free, 0)
        if getattr(seq_group, "mm_items", None):  # its images must fit the encoder cache with the step's others
            chunk = encoder_chunk(seq_group, seq_group.get_unfinished_seqs()[0].num_computed_tokens, chunk, budget.images)
        return chunk

    @staticmethod
    def _prompt_rows(seq_group: SequenceGroup, chunk: int) -> int:
        start = seq_group.get_unfinished_seqs()[0].num_computed_tokens
        return seq_group.prompt_logprob_rows(start, start + chunk)

    def _add(self, out: SchedulerOutputs, budget: _Budget, seq_group: SequenceGroup, chunk: int,
             drafts: list[int] | None = None, running: list[Sequence] | None = None):
        """`running`: the group's running sequences, when the caller has listed them."""
        if running is None:
            running = seq_group.get_seqs(SequenceStatus.RUNNING)
        bm = self.block_manager
        if (bm.enable_caching or bm.sliding_window is not None) and seq_group.pooling is None:  # (no-ops otherwise)
            for seq in running:
                # The blocks this step fills are cached from now on. A group admitted later in this
                # step may read them at once: every layer writes the step's new K/V before attending.
                # (Drafts are not the sequence's tokens: no hash covers them; nor does a pending
                # token: the block it fills is hashed once it is read, in _process.)
                end = seq.num_computed_tokens + chunk - len(drafts or ())
                if seq.num_pending_tokens:
                    end = min(end, len(seq.prompt_token_ids) + len(seq.output_token_ids))
                bm.cache_full_blocks(seq, end, seq_group.lora_request)
                bm.free_out_of_window(seq)
        num_tokens = chunk * len(running)
        if getattr(seq_group, "mm_items", None):
            take_encoder_rows(seq_group, running[0].num_computed_tokens, chunk, budget.images)
        scheduled = ScheduledSequenceGroup.of(seq_group, running, chunk, drafts)
        out.scheduled_seq_groups.append(scheduled)
        out.num_batched_tokens += num_tokens
        budget.num_tokens -= num_tokens
        budget.num_seqs -= scheduled.prompt_rows

    def _append_slots(self, seq_group: SequenceGroup, out: SchedulerOutputs, num_lookahead_slots: int = 0):
        for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
            out.blocks_to_copy.extend(self.block_manager.append_slots(seq, num_lookahead_slots))

    def _preempt(self, seq_group: SequenceGroup, out: SchedulerOutputs, swapped_out: list):
        running = seq_group.get_seqs(SequenceStatus.RUNNING)
        mode = self.preemption_mode or ("recompute" if len(running) == 1 else "swap")
        if mode == "swap" and self.block_manager.can_swap_out(seq_group):
            out.blocks_to_swap_out.extend(self.block_manager.swap_out(seq_group))
            for seq in running:
                seq.status = SequenceStatus.SWAPPED
            swapped_out.append(seq_group)
        else:  # recompute; also when host memory is full, so preemption never fails
            for seq in running:
                self.block_manager.free(seq)
                seq.status = SequenceStatus.WAITING
                seq.reset_for_recompute()
            seq_group.reset_prompt_logprobs_if_partial()
            # Victims come latest first, so the earliest ends up at the very front.
            self.waiting.appendleft(seq_group)
        out.preempted += 1
        self.num_preemptions += 1

    def _ignore(self, seq_group: SequenceGroup, out: SchedulerOutputs):
        self._finish(seq_group, SequenceStatus.FINISHED_IGNORED)
        out.ignored_seq_groups.append(seq_group)

    def _finish(self, seq_group: SequenceGroup, status: SequenceStatus):
        for seq in seq_group.get_unfinished_seqs():
            if seq.status in (SequenceStatus.RUNNING, SequenceStatus.SWAPPED) and seq_group.pooling is None:
                self.block_manager.free(seq)
            seq.status = status
