"""Host-side input preparation (numpy only, no device calls): one step's sequences -> the padded
arrays of its bucket (token ids, positions, slots, each sequence's block-table row, logits rows,
the last_tokens rows its samples go to, and a multi-step decode's lookahead slots). Block tables
themselves are not sent: the device keeps its copy (ModelRunner.block_table), updated from the
InputBatch's written entries; slots are computed here from the InputBatch's host copy."""

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from jpaged.models.forward_context import AttentionMetadata
from jpaged.runner.buckets import Buckets, fit
from jpaged.runner.input_batch import InputBatch
from jpaged.runner.step_functions import StepInputs

# A token the previous step sampled and the host has not read yet (overlapped steps).
PENDING_TOKEN = -1


@dataclasses.dataclass
class SeqInput:
    """One sequence's share of a step: compute `token_ids` at positions start_pos.. through
    `block_table`, and sample `num_samples` tokens after the last one (0: a prefill chunk). Prompt
    logprobs: the first `num_prompt_rows` tokens also get a logits row each (before the samples').
    `block_table` is the block manager's own list (read only); `seq_id` keys the sequence's row
    in the InputBatch. A token id -1 (PENDING_TOKEN) is the one the previous step sampled for this
    sequence: it is still on the device and is taken from there."""

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    num_samples: int
    num_prompt_rows: int = 0
    # Speculative decoding: the last num_spec_tokens tokens are drafts, and the num_samples
    # (= drafts + 1) rows sample after each of the last num_samples tokens, not all after the last.
    num_spec_tokens: int = 0
    lora_slot: int = -1  # the LoRA slot its tokens use (-1: the base model)


@dataclasses.dataclass
class PreparedStep:
    """One step's padded host inputs."""

    num_tokens: int  # the token bucket
    num_rows: int  # real sampling rows (prompt-logprob rows and samples)
    rows: np.ndarray  # int32[sequences]: each sequence's InputBatch row
    inputs: StepInputs  # numpy arrays
    dst_rows: np.ndarray  # int32[sampling rows]: the last_tokens row of each sample (-1: none)
    lookahead_slots: np.ndarray | None  # int32[K - 1, tokens]: a multi-step decode's later slots
    decode: bool = False  # every sequence has one token and a row of its own (the decode kernel can take it)


def prepare_inputs(seqs: list[SeqInput], input_batch: InputBatch, buckets: Buckets, block_size: int,
                   multi_step: bool = False, steps_of: list[int] | None = None, lora: bool = False) -> PreparedStep:
    """`prepare_step` over SeqInputs (a draft model's proposals): `input_batch` gives (and keeps)
    their block-table rows."""
    rows = input_batch.rows([s.seq_id for s in seqs], [s.block_table for s in seqs])
    batch = StepSeqs(rows, [s.token_ids for s in seqs], [s.start_pos for s in seqs], [s.num_samples for s in seqs],
                     [s.num_prompt_rows for s in seqs], [s.num_spec_tokens for s in seqs])
    lora_slots = [s.lora_slot for s in seqs] if lora else None
    return prepare_step(batch, input_batch, buckets, block_size, multi_step, steps_of, lora_slots)


class StepSeqs(NamedTuple):
    """A step's sequences as lists (step_inputs.StepBatch has these fields too)."""

    rows: Sequence[int]  # each one's InputBatch row, its block table up to date
    token_ids: list[list[int]]
    start_pos: list[int]
    num_samples: list[int]
    num_prompt_rows: list[int]
    num_spec_tokens: list[int]


def prepare_step(seqs, input_batch: InputBatch, buckets: Buckets, block_size: int, multi_step: bool = False,
                 steps_of: list[int] | None = None, lora_slots: Sequence[int] | np.ndarray | None = None
                 ) -> PreparedStep:
    """Pad `seqs` (a StepSeqs or a StepBatch: rows whose block tables `input_batch` holds) to
    their token bucket. `multi_step`: one token and one sample per sequence (else ValueError),
    and the slots of the later steps' tokens, positions pos + 1 .. pos + K - 1 (K:
    buckets.num_scheduler_steps); `steps_of`: each sequence's steps that count (a draft model's
    proposals), its later slots -1 (nothing written: they may lie past its blocks).
    `lora_slots`: each sequence's LoRA slot (None: LoRA off, no slots sent)."""
    if getattr(seqs, "lane", None) is not None and not multi_step:
        return prepare_lane(seqs, input_batch, buckets, block_size, lora_slots)
    n = len(seqs.rows)
    token_ids = seqs.token_ids
    lens = np.fromiter(map(len, token_ids), np.int32, n)
    start_pos = np.array(seqs.start_pos, np.int32)
    num_samples = np.array(seqs.num_samples, np.int32)
    num_prompt_rows = np.array(seqs.num_prompt_rows, np.int32)
    num_rows = int(num_samples.sum() + num_prompt_rows.sum())
    num_tokens_real = int(lens.sum())
    # Enough token rows for the sequence rows and the sampling rows (both at most max_num_seqs).
    num_tokens = fit(buckets.tokens, max(num_tokens_real, n, num_rows))
    num_seqs = buckets.seqs(num_tokens)

    rows = np.asarray(seqs.rows, np.int32)
    table_rows = np.full(num_seqs, input_batch.neutral, np.int32)  # padding: the device table's row of zeros
    table_rows[:n] = rows
    tables = input_batch.block_tables  # (the host's copy: read where slots are needed, never copied whole)
    query_start_loc = np.full(num_seqs + 1, num_tokens_real, np.int32)
    query_start_loc[0] = 0
    np.cumsum(lens, out=query_start_loc[1:n + 1])
    context_lens = np.zeros(num_seqs, np.int32)
    context_lens[:n] = start_pos + lens
    input_ids = np.zeros(num_tokens, np.int32)
    input_ids[:num_tokens_real] = [t for ids in token_ids for t in ids] if num_tokens_real > n \
        else [ids[0] for ids in token_ids]
    # Pending tokens come from the device: a decode token's sequence row in last_tokens.
    src_rows = np.full(num_tokens, -1, np.int32)
    pending = np.flatnonzero(input_ids[:num_tokens_real] == PENDING_TOKEN)
    src_rows[pending] = rows[np.repeat(np.arange(n, dtype=np.int32), lens)[pending]] if len(pending) else 0
    # Each token's sequence and position; padding tokens write nowhere (slot -1).
    seq_of = np.repeat(np.arange(n, dtype=np.int32), lens)
    pos = start_pos[seq_of] + np.arange(num_tokens_real, dtype=np.int32) - query_start_loc[seq_of]
    positions = np.zeros(num_tokens, np.int32)
    positions[:num_tokens_real] = pos
    slot_mapping = np.full(num_tokens, -1, np.int32)
    slot_mapping[:num_tokens_real] = tables[rows[seq_of], pos // block_size] * block_size + pos % block_size
    # Logits rows: each sequence's prompt-logprob rows (its first tokens), then its samples (its last).
    logits_indices = np.zeros(buckets.sample_rows(num_tokens), np.int32)
    last = query_start_loc[1:n + 1] - 1
    # A sequence's single sample goes to its row of last_tokens (several: a fork, read by the host).
    dst_rows = np.full(len(logits_indices), -1, np.int32)
    spec = np.array(seqs.num_spec_tokens, np.int32)
    if num_prompt_rows.any() or spec.any():
        row = 0
        for i in range(n):
            k = num_prompt_rows[i]
            logits_indices[row:row + k] = query_start_loc[i] + np.arange(k)
            # Drafts: a row at each of the last num_samples tokens (none stays on the device).
            logits_indices[row + k:row + k + num_samples[i]] = last[i] - spec[i] + np.arange(num_samples[i]) \
                if spec[i] else last[i]
            if num_samples[i] == 1:
                dst_rows[row + k] = rows[i]
            row += k + num_samples[i]
    else:
        logits_indices[:num_rows] = np.repeat(last, num_samples)
        dst_rows[:num_rows] = np.repeat(np.where(num_samples == 1, rows, -1), num_samples)

    attn = AttentionMetadata(slot_mapping, None, context_lens, query_start_loc)
    token_lora = None
    if lora_slots is not None:  # each token's adapter slot (LoRA enabled: every step carries them)
        token_lora = np.full(num_tokens, -1, np.int32)
        token_lora[:num_tokens_real] = np.repeat(np.asarray(lora_slots, np.int32), lens)
    inputs = StepInputs(input_ids, positions, attn, logits_indices, src_rows, token_lora, table_rows)
    lookahead_slots = None
    if multi_step:
        if num_tokens_real != n or num_rows != n or num_seqs != num_tokens:
            raise ValueError("a multi-step decode takes one token and one sample per sequence")
        num_steps = buckets.num_scheduler_steps
        steps = np.arange(1, num_steps, dtype=np.int32)[:, None]
        later = pos[None, :] + steps
        lookahead_slots = np.full((num_steps - 1, num_tokens), -1, np.int32)
        used = np.ones_like(later, bool) if steps_of is None else steps < np.asarray(steps_of, np.int32)[None, :]
        blocks = tables[rows[seq_of][None, :], np.where(used, later // block_size, 0)]
        lookahead_slots[:, :n] = np.where(used, blocks * block_size + later % block_size, -1)
    return PreparedStep(num_tokens, num_rows, rows, inputs, dst_rows, lookahead_slots,
                        num_seqs == num_tokens and num_tokens_real == n)


def prepare_lane(seqs, input_batch: InputBatch, buckets: Buckets, block_size: int,
                 lora_slots: Sequence[int] | np.ndarray | None = None) -> PreparedStep:
    """`prepare_step` for a decode lane step (step_inputs.StepBuilder._build_lane): one token per
    sequence, taken on the device (the one its row sampled last), one sample each into its row;
    the same arrays as prepare_step's for those, without walking the sequences. The arrays that
    depend only on the rows are made once while the lane's rows stay (`seqs.lane`)."""
    rows, pos = seqs.rows, seqs.start_pos
    n = len(rows)
    num_tokens = fit(buckets.tokens, n)
    num_seqs = buckets.seqs(num_tokens)
    fixed = seqs.lane.get(("inputs", num_tokens))
    if fixed is None:
        table_rows = np.full(num_seqs, input_batch.neutral, np.int32)
        table_rows[:n] = rows
        input_ids = np.zeros(num_tokens, np.int32)
        input_ids[:n] = PENDING_TOKEN
        src_rows = np.full(num_tokens, -1, np.int32)
        src_rows[:n] = rows
        logits_indices = np.zeros(buckets.sample_rows(num_tokens), np.int32)
        logits_indices[:n] = np.arange(n, dtype=np.int32)
        dst_rows = np.full(len(logits_indices), -1, np.int32)
        dst_rows[:n] = rows
        token_lora = None
        if lora_slots is not None:
            token_lora = np.full(num_tokens, -1, np.int32)
            token_lora[:n] = lora_slots
        fixed = seqs.lane[("inputs", num_tokens)] = (
            table_rows, np.minimum(np.arange(num_seqs + 1, dtype=np.int32), n), input_ids, src_rows, logits_indices,
            dst_rows, token_lora, np.asarray(rows, np.int32))
    table_rows, query_start_loc, input_ids, src_rows, logits_indices, dst_rows, token_lora, rows32 = fixed
    context_lens = np.zeros(num_seqs, np.int32)
    context_lens[:n] = pos + 1
    positions = np.zeros(num_tokens, np.int32)
    positions[:n] = pos
    slot_mapping = np.full(num_tokens, -1, np.int32)
    slot_mapping[:n] = input_batch.block_tables[rows, pos // block_size] * block_size + pos % block_size
    attn = AttentionMetadata(slot_mapping, None, context_lens, query_start_loc)
    inputs = StepInputs(input_ids, positions, attn, logits_indices, src_rows, token_lora, table_rows)
    return PreparedStep(num_tokens, n, rows32, inputs, dst_rows, None, num_seqs == num_tokens)
