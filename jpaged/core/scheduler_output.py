"""What the scheduler decides for one step (vLLM v1 keeps it apart too: `sched/output.py`): each
scheduled group's share of the step, and the plan's block copies and swaps. The runner builds
its inputs from it (runner/step_inputs.py); `Scheduler.update_from_output` takes it back with the
sampled rows."""

import dataclasses

from jpaged.core.sequence import Sequence, SequenceGroup


@dataclasses.dataclass(slots=True)  # (one per group every step)
class ScheduledSequenceGroup:
    """A group's share of a step: its running sequences compute positions [start, start + chunk);
    then `prompt_rows` logits rows for prompt logprobs come first, and each sequence in `sampled`
    samples that many rows after them (a fresh prompt best_of at once: one per fork)."""

    seq_group: SequenceGroup
    token_chunk_size: int  # tokens each running sequence of the group computes this step
    start: int = 0  # the running sequences' computed tokens before the step (they are in lockstep)
    prompt_rows: int = 0
    seqs: list[Sequence] = dataclasses.field(default_factory=list)  # the running sequences
    samples: list[int] = dataclasses.field(default_factory=list)  # rows each of `seqs` samples (0: none)
    # Speculative decoding: drafts for the group's one sequence, computed after its last token
    # (token_chunk_size = 1 + drafts), each position sampling a row (samples = 1 + drafts).
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, seq_group: SequenceGroup, running: list[Sequence], chunk: int,
           drafts: list[int] | None = None) -> "ScheduledSequenceGroup":
        """The running sequences' share computing `chunk` tokens each: which rows it samples. A
        sequence whose chunk reaches its end samples what follows (beam search: one row per beam,
        its candidates from the row's top logprobs; drafts: a row after its last token and after
        each draft)."""
        first = running[0]
        start = first.num_computed_tokens
        if drafts:
            return cls(seq_group, chunk, start, 0, running, [chunk], spec_token_ids=drafts)
        end = start + chunk
        prompt_rows = seq_group.prompt_logprob_rows(start, end) if seq_group.prompt_logprobs is not None else 0
        # A prefill chunk short of the end: nothing sampled (lockstep). (first.get_len(), inlined)
        if end != len(first.prompt_token_ids) + len(first.output_token_ids) + first.num_pending_tokens:
            return cls(seq_group, chunk, start, prompt_rows, running, [0] * len(running))
        sp = seq_group.sampling_params
        fresh = len(seq_group.seqs) == 1 and not first.output_token_ids
        n = sp.best_of if fresh and not sp.use_beam_search else 1
        return cls(seq_group, chunk, start, prompt_rows, running, [n] * len(running))

    @property
    def sampled(self) -> list[tuple[Sequence, int]]:
        """(sequence, rows) of the sequences that sample."""
        return [(seq, n) for seq, n in zip(self.seqs, self.samples) if n]


@dataclasses.dataclass
class SchedulerOutputs:
    scheduled_seq_groups: list[ScheduledSequenceGroup] = dataclasses.field(default_factory=list)
    num_batched_tokens: int = 0
    # Block copies to make before the step, in this order: swap out, swap in, copy-on-write.
    blocks_to_swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (cpu, gpu)
    blocks_to_copy: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (src, dst) on the device
    ignored_seq_groups: list[SequenceGroup] = dataclasses.field(default_factory=list)  # now FINISHED_IGNORED
    preempted: int = 0  # groups preempted this step
    # More sequences run than disable_by_batch_size: no drafts, and the proposer skips its per-step
    # work (a draft model's K/V forward, an EAGLE head's fill), as vLLM's skip_proposer.
    spec_disabled: bool = False
    # The steady decode lane's part (decode_lane.LanePlan): the first groups are the lane's, sent
    # to the runner as a diff of its previous lane step; None: no lane.
    lane: object = None

    def is_empty(self) -> bool:
        return not (self.scheduled_seq_groups or self.blocks_to_swap_out or self.blocks_to_swap_in
                    or self.blocks_to_copy)
