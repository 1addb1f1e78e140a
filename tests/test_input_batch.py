"""The runner's persistent input batch (block tables kept across steps and updated in place) and
the packing of step inputs into one int32 array, against plain references."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.runner.buckets import fit, history_widths
from jpaged.runner.input_batch import InputBatch, layout_of, pack, unpack


def test_block_tables_follow_every_kind_of_table_change(monkeypatch):
    """Random steps: sequences join, leave, grow a block, get a copy-on-write last block, or come
    back with a new table (swap-in, recompute); each step's rows must hold exactly the tables, on
    the host and in the device's copy that only the written entries reach (through the runner's
    update chunks, whose sizes are shrunk here so that steps span several chunks)."""
    from jpaged.runner import buckets
    from jpaged.runner.step_functions import write_block_table

    monkeypatch.setattr(buckets, "BLOCK_TABLE_UPDATE_SIZES", (4, 16))
    seed = int(np.random.default_rng().integers(1 << 31))
    print("seed", seed)
    rng = np.random.default_rng(seed)
    width, max_rows = 12, 6
    batch = InputBatch(max_rows, width)
    device = jnp.full((max_rows + 1, width), -7, jnp.int32).at[max_rows].set(0)  # poisoned, but the padding row
    write = jax.jit(write_block_table)
    sizes = set()
    tables: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(300):
        for seq_id in list(tables):
            change = rng.integers(6)
            table = tables[seq_id]
            if change == 0 and len(table) < width:
                table.append(int(rng.integers(1000)))  # a new block
            elif change == 1:
                table[-1] = int(rng.integers(1000))  # copy-on-write of the last block
            elif change == 2:
                tables[seq_id] = [int(b) for b in rng.integers(1000, size=rng.integers(1, width + 1))]  # new list
            elif change == 3:
                del tables[seq_id]  # finished or preempted
        while len(tables) < max_rows and rng.random() < 0.5:
            tables[next_id] = [int(b) for b in rng.integers(1000, size=rng.integers(1, width + 1))]
            next_id += 1
        scheduled = [i for i in tables if rng.random() < 0.8]  # the others miss this step
        rows = batch.rows(scheduled, [tables[i] for i in scheduled])
        assert len(set(rows.tolist())) == len(rows)
        for chunk in buckets.update_chunks(*batch.take_table_updates()):
            sizes.add(len(chunk[0]))
            device = write(device, *chunk)
        on_device = np.asarray(device)
        assert (on_device[max_rows] == 0).all()
        for seq_id, row in zip(scheduled, rows):
            table = tables[seq_id]
            assert batch.block_tables[row, :len(table)].tolist() == table
            assert on_device[row, :len(table)].tolist() == table
        for seq_id in [i for i in tables if i not in scheduled]:
            del tables[seq_id]  # a sequence that misses a step comes back with a new table
    assert sizes == {4, 16}  # both update sizes were used


def test_pack_round_trips_every_dtype_inside_jit():
    rng = np.random.default_rng()
    tree = {"ids": rng.integers(-5, 1 << 30, size=(3, 4)).astype(np.int32),
            "seeds": rng.integers(0, 1 << 32, size=5, dtype=np.uint64).astype(np.uint32),
            "temperature": rng.standard_normal(7).astype(np.float32),
            "flag": np.bool_(rng.random() < 0.5), "none": None}
    layout = layout_of(tree)
    packed = pack(tree)
    assert packed.dtype == np.int32 and packed.shape == (layout.size,)
    out = jax.jit(lambda p: unpack(p, layout))(jnp.asarray(packed))
    for key in ("ids", "seeds", "temperature", "flag"):
        assert np.asarray(out[key]).dtype == np.asarray(tree[key]).dtype
        np.testing.assert_array_equal(np.asarray(out[key]), tree[key])
    assert out["none"] is None


# ----------------------------------------------------------------------------- the step's inputs
# The runner builds each step's inputs from the scheduler's plan over its persistent InputBatch
# (step_inputs.py). The reference below builds them from scratch each step, per row, as SamplingRows
# through SamplingMetadata.from_rows (what the engine did before the InputBatch kept the knobs).

V = 300  # vocabulary: bitmask rows of 10 words
HISTORY_LEN = 1024  # the token history's width (max_model_len); uploads are 256 or 1024 wide


class FakeBlockManager:
    def __init__(self):
        self.tables = {}

    def get_block_table(self, seq):
        return self.tables[seq.seq_id]


class FakeGrammars:
    """Deterministic masks from (sequence, its length, drafts so far)."""

    @staticmethod
    def _mask(seq_id, length):
        return np.random.default_rng([seq_id, length]).integers(-(1 << 31), 1 << 31, size=-(-V // 32)).astype(np.int32)

    def __init__(self):
        self.lengths = {}

    def bitmask(self, seq_id, sp):
        return self._mask(seq_id, self.lengths[seq_id])

    def draft_bitmasks(self, seq_id, sp, drafts):
        return [self._mask(seq_id, self.lengths[seq_id] + i) for i in range(len(drafts) + 1)]


def random_params(rng):
    from jpaged.sampling_params import SamplingParams

    kind = rng.integers(6)
    kw = dict(max_tokens=1000, seed=int(rng.integers(1 << 40)) if rng.random() < 0.5 else None)
    if kind == 0:
        return SamplingParams(temperature=0.0, **kw)
    if kind == 1:  # random with truncation, maybe forks
        best_of = int(rng.integers(1, 4))
        return SamplingParams(temperature=float(rng.uniform(0.1, 2)), top_k=int(rng.integers(1, 50)),
                              top_p=float(rng.uniform(0.1, 1)), min_p=float(rng.uniform(0, 0.5)), n=best_of, **kw)
    if kind == 2:  # penalties
        return SamplingParams(temperature=float(rng.uniform(0, 1)), presence_penalty=float(rng.uniform(-1, 1)),
                              frequency_penalty=float(rng.uniform(-1, 1)),
                              repetition_penalty=float(rng.uniform(0.5, 2)), **kw)
    if kind == 3:  # bias and min_tokens' bans
        bias = {int(t): float(rng.uniform(-50, 50)) for t in rng.choice(V, size=rng.integers(1, 8), replace=False)}
        stops = [int(t) for t in rng.choice(V, size=rng.integers(0, 5), replace=False)]
        return SamplingParams(temperature=float(rng.uniform(0, 1)), logit_bias=bias, stop_token_ids=stops,
                              min_tokens=int(rng.integers(0, 12)), **kw)
    if kind == 4:  # a grammar (min_tokens then gives way), logprobs
        return SamplingParams(temperature=0.0, guided_regex="a+", min_tokens=5, stop_token_ids=[1],
                              logprobs=int(rng.integers(0, 3)), **kw)
    return SamplingParams(temperature=0.0, prompt_logprobs=int(rng.integers(0, 3)), **kw)


def reference_metadata(plan, bm, grammars, eos, seed):
    """The per-row SamplingRows of the plan, from scratch, and their from_rows metadata."""
    from jpaged.core.request_needs import RequestNeeds
    from jpaged.runner.input_batch import MAX_BANNED_TOKENS
    from jpaged.runner.sampler import SamplingRow
    from jpaged.sampling_params import SamplingParams

    def row(group, seq, index, ahead=0, allowed=None):
        sp = group.sampling_params
        banned = []
        if sp.guided:
            allowed = grammars.bitmask(seq.seq_id, sp) if allowed is None else allowed
        elif seq.get_output_len() + ahead < sp.min_tokens:
            banned = list(sp.stop_token_ids) + ([eos] if eos is not None else [])
        s = sp.seed if sp.seed is not None else hash((seed, seq.seq_id)) & 0x7FFFFFFF
        return SamplingRow(sp, s, index, seq.get_output_len() + ahead, banned_token_ids=banned,
                           logit_bias=sp.logit_bias, allowed_bitmask=allowed)

    rows, seqs = [], []
    for scheduled in plan.scheduled_seq_groups:
        group, start = scheduled.seq_group, scheduled.start
        for seq, samples in zip(scheduled.seqs, scheduled.samples):
            rows += [SamplingRow(SamplingParams(temperature=0), 0, target_token_id=seq.prompt_token_ids[p + 1])
                     for p in range(start, start + scheduled.prompt_rows)]
            drafts = scheduled.spec_token_ids
            if drafts:
                masks = grammars.draft_bitmasks(seq.seq_id, group.sampling_params, drafts) \
                    if group.sampling_params.guided else [None] * samples
                rows += [row(group, seq, group.seqs.index(seq), i, masks[i]) for i in range(samples)]
                tokens = [seq.get_last_token_id(), *drafts]
            else:
                rows += [row(group, seq, i if samples > 1 else group.seqs.index(seq)) for i in range(samples)]
                tokens = [seq.get_last_token_id()] if scheduled.token_chunk_size == 1 and samples \
                    else seq.get_token_ids()[start:start + scheduled.token_chunk_size]
            seqs.append((seq.seq_id, tokens, start, bm.get_block_table(seq), samples, scheduled.prompt_rows))
    full = any(r.target_token_id >= 0 or RequestNeeds.of(r.params).full_sampler for r in rows)
    meta = lambda num_rows: SamplingMetadata.from_rows(  # noqa: E731
        rows, num_rows, vocab_size=V, num_logprobs=MAX_LOGPROBS if full else 0, do_penalties=full, prompt_width=0,
        output_width=0, banned_width=MAX_BANNED_TOKENS, do_guided=full)
    return seqs, full, meta


from jpaged.config import MAX_LOGPROBS  # noqa: E402
from jpaged.runner.sampler import SamplingMetadata  # noqa: E402


def test_step_inputs_equal_a_from_scratch_build_over_random_steps():
    """Random steps: groups join (a prompt in chunks, maybe with prompt-logprob rows and forks at
    its end), decode, take drafts, drop a sequence (beams), miss steps, finish; knobs of every
    kind (penalties, bias, min_tokens bans, grammars, LoRA slots). Each step's gathered sampler
    metadata, full/fast choice, block tables and LoRA slots equal a from-scratch build, the
    penalties' token history holds every penalised row's tokens, and the InputBatch holds rows
    for exactly the step's sequences (freed rows are reused: no leak)."""
    from jpaged.core.scheduler_output import ScheduledSequenceGroup, SchedulerOutputs
    from jpaged.core.sequence import Sequence, SequenceGroup
    from jpaged.runner import step_inputs
    from jpaged.runner.input_batch import InputBatch
    from jpaged.runner.step_inputs import StepBuilder

    class Lora:
        def __init__(self, i):
            self.lora_int_id = i

    class Eos:
        eos_token_id = 7

    rng = np.random.default_rng()
    max_rows, width, seed = 24, 8, 1234
    bm, grammars, stops = FakeBlockManager(), FakeGrammars(), Eos()
    ib = InputBatch(max_rows, width)
    builder = StepBuilder(ib, bm, grammars, stops, seed)
    groups, next_id, checked_full = [], 0, set()
    device_history = np.full((max_rows, HISTORY_LEN), -1, np.int32)
    for step in range(250):
        stops.eos_token_id = None if step % 50 == 49 else 7  # (the tests move EOS)
        while len(groups) < 8 and rng.random() < 0.4:  # new requests
            sp = random_params(rng)
            seq = Sequence(next_id, rng.integers(0, V, size=rng.integers(2, 40)).tolist())
            next_id += 1
            groups.append(SequenceGroup(f"r{next_id}", [seq], sp, 0.0,
                                        lora_request=Lora(int(rng.integers(3))) if rng.random() < 0.3 else None))
            bm.tables[seq.seq_id] = rng.integers(1000, size=rng.integers(1, width + 1)).tolist()
        plan = SchedulerOutputs()
        lora_slots = {i: int(rng.integers(4)) for i in range(3)}
        for group in rng.permutation(len(groups)).tolist():
            group = groups[group]
            if rng.random() < 0.2:
                continue  # misses this step
            sp, seqs = group.sampling_params, group.seqs
            seq0 = seqs[0]
            if seq0.num_computed_tokens < seq0.get_prompt_len():  # a prompt chunk
                start = seq0.num_computed_tokens
                chunk = int(rng.integers(1, seq0.get_prompt_len() - start + 1))
                last = start + chunk == seq0.get_prompt_len()
                prompt_rows = min(chunk, seq0.get_prompt_len() - 1 - start) if sp.prompt_logprobs is not None else 0
                scheduled = ScheduledSequenceGroup(group, chunk, start, prompt_rows, [seq0],
                                                   [sp.best_of if last else 0])
            elif len(seqs) == 1 and sp.best_of == 1 and rng.random() < 0.3:  # drafts
                drafts = rng.integers(0, V, size=rng.integers(1, 4)).tolist()
                scheduled = ScheduledSequenceGroup(group, 1 + len(drafts), seq0.get_len() - 1, 0, [seq0],
                                                   [1 + len(drafts)], drafts)
            else:  # a decode of every sequence
                scheduled = ScheduledSequenceGroup(group, 1, seq0.get_len() - 1, 0, list(seqs), [1] * len(seqs))
            plan.scheduled_seq_groups.append(scheduled)
        for scheduled in plan.scheduled_seq_groups:
            for seq in scheduled.seqs:
                grammars.lengths[seq.seq_id] = seq.get_len()
        eos = stops.eos_token_id
        reference_seqs, full, reference = reference_metadata(plan, bm, grammars, eos, seed)
        batch, failed = builder.build(plan, lora_slots)
        assert not failed
        assert step_inputs.needs_full_sampler(ib, batch) == full
        checked_full.add(full)
        num_rows = batch.num_rows + int(rng.integers(0, 3))  # padded
        meta = step_inputs.sampling_metadata(ib, batch, num_rows, full, V, eos)
        want = reference(num_rows)
        for field in dataclasses.fields(SamplingMetadata):
            np.testing.assert_array_equal(np.asarray(getattr(meta, field.name)), np.asarray(getattr(want, field.name)),
                                          err_msg=field.name)
        # The penalties' token history: after the uploads, each penalised row's history row holds
        # its sequence's tokens (prompt, outputs, the drafts before it), as the device would.
        appends = []
        if full:
            def upload(rows, tokens):  # as the device's write_history: the first tokens.shape[1] positions
                uploads.append((tokens.shape[1], int((tokens >= 0).sum(axis=1).max())))
                device_history[rows[rows >= 0], :tokens.shape[1]] = tokens[rows >= 0]

            uploads = []
            history = step_inputs.history_inputs(ib, batch, num_rows, history_widths(HISTORY_LEN), upload)
            # each upload as narrow as its longest sequence allows
            assert all(w == fit(history_widths(HISTORY_LEN), longest) for w, longest in uploads)
            i = 0
            for scheduled in plan.scheduled_seq_groups:
                sp = scheduled.seq_group.sampling_params
                for seq, samples in zip(scheduled.seqs, scheduled.samples):
                    i += scheduled.prompt_rows
                    for j in range(samples):
                        if not sp.has_penalties:
                            assert history.rows[i] == -1 and history.dst_rows[i] == -1
                        else:
                            tokens = seq.get_token_ids() + scheduled.spec_token_ids[:j]
                            assert (history.rows[i], history.prompt_lens[i], history.lens[i]) == \
                                (ib.row_of[seq.seq_id], seq.get_prompt_len(), len(tokens))
                            assert device_history[history.rows[i], :len(tokens)].tolist() == tokens
                            lone = samples == 1 and not scheduled.spec_token_ids
                            assert history.dst_rows[i] == (history.rows[i] if lone else -1)
                            if lone:  # the sampler appends the token it samples (the one appended below)
                                appends.append((seq, history.rows[i], len(tokens)))
                        i += 1
            assert (history.rows[i:] == -1).all()
        # The sequences' inputs: rows, block tables, LoRA slots, tokens.
        assert len(batch.rows) == len(reference_seqs) and len(set(batch.rows)) == len(batch.rows)
        for k, (seq_id, tokens, start, table, samples, prompt_rows) in enumerate(reference_seqs):
            row = batch.rows[k]
            assert ib.row_of[seq_id] == row
            assert ib.block_tables[row, :len(table)].tolist() == table
            assert (batch.token_ids[k], batch.start_pos[k], batch.num_samples[k], batch.num_prompt_rows[k]) == \
                (tokens, start, samples, prompt_rows)
        groups_of = {s.seq_group.request_id: s for s in plan.scheduled_seq_groups}
        for scheduled, k, _ in batch.groups:
            group = scheduled.seq_group
            want_slot = lora_slots[group.lora_request.lora_int_id] if group.lora_request is not None else -1
            assert all(ib.lora_slot[ib.row_of[seq.seq_id]] == want_slot for seq in scheduled.seqs)
            assert groups_of[group.request_id] is scheduled
        # Rows for exactly this step's sequences: the others' were freed.
        assert sorted(ib.row_of) == sorted(s for s, *_ in reference_seqs)
        assert ib.num_rows + ib.num_free == max_rows
        # The step's effects on the sequences (what the scheduler does after it).
        for scheduled in plan.scheduled_seq_groups:
            group = scheduled.seq_group
            for seq, samples in zip(scheduled.seqs, scheduled.samples):
                seq.num_computed_tokens += scheduled.token_chunk_size - len(scheduled.spec_token_ids)
                if not samples:
                    continue
                seq.output_token_ids += rng.integers(0, V, size=rng.integers(1, 3 if scheduled.spec_token_ids else 2)).tolist()
                seq.num_computed_tokens = seq.get_len() - 1
                table = bm.tables[seq.seq_id]
                change = rng.integers(4)
                if change == 0 and len(table) < width:
                    table.append(int(rng.integers(1000)))
                elif change == 1:
                    table[-1] = int(rng.integers(1000))
                for _ in range(samples - 1):  # forks
                    child = Sequence(next_id, seq.prompt_token_ids)
                    next_id += 1
                    child.output_token_ids, child.num_computed_tokens = list(seq.output_token_ids), seq.num_computed_tokens
                    group.seqs.append(child)
                    bm.tables[child.seq_id] = list(table)
            if len(group.seqs) > 1 and rng.random() < 0.2:  # a beam dropped
                group.seqs.pop(int(rng.integers(len(group.seqs))))
        for seq, row, position in appends:
            device_history[row, position] = seq.output_token_ids[position - seq.get_prompt_len()]
        groups = [g for g in groups if rng.random() > 0.05 and all(s.get_len() < 200 for s in g.seqs)]
    assert checked_full == {False, True}


def test_rows_of_left_sequences_are_freed_and_reused():
    """Many steps of sequences coming and going never run out of rows."""
    from jpaged.core.scheduler_output import ScheduledSequenceGroup, SchedulerOutputs
    from jpaged.core.sequence import Sequence, SequenceGroup
    from jpaged.runner.input_batch import InputBatch
    from jpaged.runner.step_inputs import StepBuilder
    from jpaged.sampling_params import SamplingParams

    rng = np.random.default_rng()
    bm, ib = FakeBlockManager(), InputBatch(4, 4)
    builder = StepBuilder(ib, bm)
    for step in range(500):
        plan = SchedulerOutputs()
        for k in range(int(rng.integers(0, 5))):
            seq = Sequence(step * 10 + k, [1, 2])
            bm.tables[seq.seq_id] = [k]
            plan.scheduled_seq_groups.append(ScheduledSequenceGroup(
                SequenceGroup(str(seq.seq_id), [seq], SamplingParams(), 0.0), 2, 0, 0, [seq], [1]))
        batch, failed = builder.build(plan, {})
        assert not failed and ib.num_rows == len(plan.scheduled_seq_groups) == len(batch.rows)
        assert ib.num_rows + ib.num_free == 4


def test_a_group_whose_inputs_fail_is_left_out_alone():
    from jpaged.core.scheduler_output import ScheduledSequenceGroup, SchedulerOutputs
    from jpaged.core.sequence import Sequence, SequenceGroup
    from jpaged.runner.input_batch import InputBatch
    from jpaged.runner.step_inputs import StepBuilder
    from jpaged.sampling_params import SamplingParams

    bm, ib = FakeBlockManager(), InputBatch(4, 4)
    plan = SchedulerOutputs()
    for k in range(3):
        seq = Sequence(k, [1, 2, 3])
        if k != 1:  # the middle one has no block table
            bm.tables[k] = [k]
        plan.scheduled_seq_groups.append(ScheduledSequenceGroup(
            SequenceGroup(f"r{k}", [seq], SamplingParams(temperature=0.5, seed=k), 0.0), 3, 0, 0, [seq], [1]))
    batch, failed = StepBuilder(ib, bm).build(plan, {})
    assert list(failed) == ["r1"] and isinstance(failed["r1"][1], KeyError)
    assert [s.seq_group.request_id for s, _, _ in batch.groups] == ["r0", "r2"]
    assert batch.token_ids == [[1, 2, 3], [1, 2, 3]] and batch.src == [ib.row_of[0], ib.row_of[2]]
    assert ib.seeds[batch.src].tolist() == [0, 2]
    alone = batch.group(1)
    assert alone.rows == [ib.row_of[2]] and alone.src == [ib.row_of[2]] and alone.groups[0][0] is plan.scheduled_seq_groups[2]


def test_a_draft_models_rows_take_the_key_and_knobs_alone():
    """A draft model's rows (key_only): the target row's key and temperature / top-k/p / min-p,
    no bias or bans, as a from-scratch SamplingRow with only those."""
    from jpaged.runner import step_inputs
    from jpaged.runner.input_batch import MAX_BANNED_TOKENS
    from jpaged.runner.sampler import SamplingRow
    from jpaged.runner.step_inputs import StepBatch

    rng = np.random.default_rng()
    ib = InputBatch(8, 4)
    rows, src = [], []
    from jpaged.sampling_params import SamplingParams

    for k in range(6):  # (the first: a bias and min_tokens' bans the target's rows have, a draft's not)
        sp = SamplingParams(temperature=0.5, logit_bias={3: 9.0}, min_tokens=30, max_tokens=40, stop_token_ids=[2]) if k == 0 \
            else random_params(rng)
        seed, index, position = int(rng.integers(1 << 31)), int(rng.integers(3)), int(rng.integers(20))
        src.append(ib.add(100 + k, sp, seed, index, key_only=True))
        rows.append(SamplingRow(sp, seed, index, position))
    batch = StepBatch(src=src, sample_index=[r.sample_index for r in rows])
    meta = step_inputs.sampling_metadata(ib, batch, 8, False, V, eos_token_id=7)
    want = SamplingMetadata.from_rows(rows, 8, vocab_size=V, num_logprobs=0, do_penalties=False, prompt_width=0,
                                      output_width=0, banned_width=MAX_BANNED_TOKENS, do_guided=False)
    for field in dataclasses.fields(SamplingMetadata):
        np.testing.assert_array_equal(np.asarray(getattr(meta, field.name)), np.asarray(getattr(want, field.name)),
                                      err_msg=field.name)
