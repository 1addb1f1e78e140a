"""KV allocation policies (the paper's baselines, for benchmarks) and the KV memory accounting.

`paged` is jpaged's own policy: a sequence gets a block only when its last one is full. The
others reproduce the systems the paper compares against (§2.3, §6.1), inside the same engine so
that a comparison isolates memory management:

  orca-max     reserve max_model_len slots per request at admission (Orca, Max)
  orca-pow2    reserve the next power of two of prompt + output length (Orca, Pow2)
  orca-oracle  reserve exactly prompt + output length (Orca, Oracle: the true length is known)
  static       reserve max_model_len like orca-max, and batch per request (FasterTransformer):
               a batch runs to completion before the next one is admitted

A reservation is taken in whole blocks, so the blocks stand in for Orca's contiguous chunks: the
baselines lose memory to reservation and internal fragmentation, never to external
fragmentation (the paper's "external fragmentation & others" is not modelled). The "output
length" is max_tokens: benchmarks set ignore_eos, so every request produces exactly that many.
The baselines run one sequence per request (n = best_of = 1): Orca does not share blocks.

The block manager takes its policy as a KVAllocation strategy (kv_allocation_policy), chosen once
when it is built: PagedAllocation or a ReservingAllocation. Only admission differs between them.

Accounting (the paper's Fig. 2) splits every device slot into: holding a computed token's K/V,
reserved (allocated, to be filled before the sequence reaches its final length), internal
fragmentation (allocated, never to be filled) and free. A block shared by several sequences
counts once.
"""

import dataclasses

from jpaged.core.sequence import Sequence, SequenceGroup, SequenceStatus

KV_ALLOCATIONS = ("paged", "orca-max", "orca-pow2", "orca-oracle", "static")


def final_len(prompt_len: int, max_tokens: int, max_model_len: int) -> int:
    """The longest a sequence of this request can get."""
    return min(prompt_len + max_tokens, max_model_len)


def reserved_len(policy: str, final: int, max_model_len: int) -> int:
    """Token slots a sequence that will reach `final` tokens holds from its admission on (paged:
    only those it has; this is what it holds at its end)."""
    if policy in ("orca-max", "static"):
        return max_model_len
    if policy == "orca-pow2":
        return min(1 << (final - 1).bit_length(), max_model_len)
    if policy in ("orca-oracle", "paged"):
        return final
    raise ValueError(f"kv_allocation={policy!r}; expected one of {KV_ALLOCATIONS}")


class KVAllocation:
    """How many token slots a sequence takes at admission. After it every policy grows the same
    way: a block when the last one is full."""

    name: str  # one of KV_ALLOCATIONS

    def admission_len(self, seq: Sequence, max_tokens: int) -> int:
        """Token slots the sequence takes at admission."""
        raise NotImplementedError

    def held_len(self, final: int) -> int:
        """Token slots a sequence that reaches `final` tokens holds at its end."""
        raise NotImplementedError


class PagedAllocation(KVAllocation):
    """jpaged's own policy: a sequence takes slots for the tokens it has and grows on demand."""

    name = "paged"

    def admission_len(self, seq: Sequence, max_tokens: int) -> int:
        return seq.get_len()

    def held_len(self, final: int) -> int:
        return final


class ReservingAllocation(KVAllocation):
    """One of the paper's baselines: admission takes the request's whole reservation at once."""

    def __init__(self, name: str, max_model_len: int):
        self.name, self.max_model_len = name, max_model_len

    def admission_len(self, seq: Sequence, max_tokens: int) -> int:
        final = final_len(seq.get_prompt_len(), max_tokens, self.max_model_len)
        return max(seq.get_len(), self.held_len(final))

    def held_len(self, final: int) -> int:
        return reserved_len(self.name, final, self.max_model_len)


def kv_allocation_policy(policy: str, max_model_len: int | None, enable_caching: bool) -> KVAllocation:
    """The strategy for `policy` (one of KV_ALLOCATIONS); a ValueError for one it can't run."""
    if policy != "paged" and (max_model_len is None or enable_caching):
        raise ValueError(f"kv_allocation={policy!r} needs max_model_len and no prefix caching")
    reserved_len(policy, 1, 1)  # a ValueError for an unknown policy
    return PagedAllocation() if policy == "paged" else ReservingAllocation(policy, max_model_len)


def step_without_model(scheduler, token_id: int):
    """One scheduler step with no model: every sampled row samples `token_id` (benchmarks set
    ignore_eos, so each request ends at max_tokens). Replays a trace's memory use (the paper's
    Fig. 2) through the scheduler's own post-step update. Returns the scheduler's output."""
    from jpaged.runner.sampler import SamplerOutput

    out = scheduler.schedule()
    results = []
    for scheduled in out.scheduled_seq_groups:
        scheduler.on_dispatched(scheduled)
        rows = scheduled.prompt_rows + sum(samples for _, samples in scheduled.sampled)
        results.append((scheduled, [SamplerOutput.of_tokens([token_id] * rows)], 0))
    for group, error in scheduler.update_from_output(results).values():
        raise RuntimeError(f"request {group.request_id}: {error!r}") from error
    return out


@dataclasses.dataclass(frozen=True)
class KVUsage:
    """Device KV slots (tokens) by what they hold; the four parts add up to `total_slots`."""

    token_slots: int  # a computed token's K/V
    reserved_slots: int  # allocated to a sequence, filled before it reaches its final length
    fragmented_slots: int  # allocated, never filled (internal fragmentation)
    free_slots: int  # in free blocks (cached prefixes included: evicted when needed)

    @property
    def total_slots(self) -> int:
        return self.token_slots + self.reserved_slots + self.fragmented_slots + self.free_slots

    @property
    def allocated_slots(self) -> int:
        return self.total_slots - self.free_slots


def kv_usage(block_manager, seq_groups: list[SequenceGroup], max_model_len: int) -> KVUsage:
    """The device pool's slots right now; `seq_groups`: the groups holding device blocks."""
    size = block_manager.block_size
    filled: dict[int, int] = {}  # block -> slots holding tokens (max over its sharers: a common prefix)
    planned: dict[int, int] = {}  # block -> slots its sharers fill by their final length
    for group in seq_groups:
        sp = group.sampling_params
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            final = final_len(seq.get_prompt_len(), sp.max_tokens, max_model_len)
            for i, block_id in enumerate(block_manager.get_block_table(seq)):
                if block_id < 0:  # block_manager.FREED_BLOCK: freed out of the sliding window
                    continue
                start = i * size
                filled[block_id] = max(filled.get(block_id, 0), min(max(seq.num_computed_tokens - start, 0), size))
                planned[block_id] = max(planned.get(block_id, 0), min(max(final - start, 0), size))
    tokens, will_fill = sum(filled.values()), sum(planned.values())
    return KVUsage(token_slots=tokens, reserved_slots=will_fill - tokens,
                   fragmented_slots=len(planned) * size - will_fill,
                   free_slots=block_manager.get_num_free_gpu_blocks() * size)
