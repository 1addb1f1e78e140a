import random
import zlib

import pytest

from jpaged.core.block_manager import BlockManager
from jpaged.core.scheduler import Scheduler
from jpaged.core.sequence import Sequence, SequenceGroup, SequenceStatus
from jpaged.runner.sampler import SamplerOutput
from jpaged.sampling_params import SamplingParams
from jpaged.spec_decode.config import SpeculativeConfig
from jpaged.spec_decode.speculator import Speculator

RUNNING, SWAPPED, WAITING = SequenceStatus.RUNNING, SequenceStatus.SWAPPED, SequenceStatus.WAITING


def _salt(request_id: str) -> int:
    return zlib.crc32(request_id.encode())


class FakeEngine:
    """Plays the engine and the model runner around a real Scheduler and BlockManager.

    The fake KV pages hold token ids: a step writes the scheduled tokens of every sequence
    through its block table, then each sequence "attends" by reading its whole context back
    and checks it is exactly its own tokens. The sampled token is a function of that context,
    of the sequence's index in its group and of the request, so a lost or repeated token
    changes everything after it. A sequence stops at max_tokens, at max_model_len, or when it
    samples a multiple of `stop_every` (so the forks of a request finish at different times).

    Pages nobody may read are poisoned (None): free ones, and prefix-cached ones when evicted.

    Speculative decoding (`speculative_config`): drafts are written into the pages after the
    sequence's tokens and a row is sampled after each, from the context up to it; the scheduler
    accepts them. `copy_period` p makes the model mostly copy the token p back (n-gram drafts
    then hit), so outputs must not depend on whether, or how many, drafts were accepted.
    """

    def __init__(self, *, block_size=4, num_gpu_blocks=64, num_cpu_blocks=16, watermark=0.0, max_num_seqs=8,
                 max_num_batched_tokens=32, max_model_len=256, preemption_mode=None, stop_every=0,
                 enable_caching=False, speculative_config=None, copy_period=0):
        self.block_size = block_size
        self.bm = BlockManager(block_size, num_gpu_blocks, num_cpu_blocks, watermark, enable_caching=enable_caching)
        spec = SpeculativeConfig.of(speculative_config)
        self.scheduler = Scheduler(self.bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   max_model_len=max_model_len, preemption_mode=preemption_mode,
                                   speculator=Speculator(spec, max_model_len) if spec else None)
        self.copy_period = copy_period
        self.gpu = [[None] * block_size for _ in range(num_gpu_blocks)]
        self.cpu = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.max_model_len = max_model_len
        self.stop_every = stop_every
        self.groups: dict[str, SequenceGroup] = {}
        self.ignored: set[str] = set()
        self.num_steps = 0

    def add(self, request_id: str, prompt_len: int, max_tokens: int, best_of: int = 1, prefix=()) -> SequenceGroup:
        """A request whose prompt starts with `prefix` (its first tokens), the rest its own. It
        stops on a sampled multiple of `stop_every` (stop token ids, checked by the scheduler)."""
        prompt = list(prefix[:prompt_len]) + [(_salt(request_id) + i) % 1000 for i in range(len(prefix), prompt_len)]
        stop_ids = list(range(0, 1000, self.stop_every)) if self.stop_every else None
        group = SequenceGroup(request_id, [Sequence(self.scheduler.new_seq_id(), prompt)],
                              SamplingParams(n=best_of, max_tokens=max_tokens, stop_token_ids=stop_ids),
                              arrival_time=float(self.num_steps))
        self.groups[request_id] = group
        self.scheduler.add_seq_group(group)
        return group

    def step(self):
        sched = self.scheduler
        waiting_before = set(map(id, sched.waiting))
        hashes = {b.block_id: b.block_hash for b in self.bm.gpu_pool.blocks if b.block_hash is not None}
        out = sched.schedule()
        self.num_steps += 1
        self.check_step(out, waiting_before)
        self.ignored.update(g.request_id for g in out.ignored_seq_groups)
        # The runner: block copies first, in this order, then one batched forward.
        for g, c in out.blocks_to_swap_out:
            self.cpu[c] = list(self.gpu[g])
        # Swapped out, pages freed by preemption and evicted cached ones hold nothing anyone may read.
        self.poison(b for b, h in hashes.items() if self.bm.gpu_pool.blocks[b].block_hash != h)
        self.poison(self.free_blocks())
        for c, g in out.blocks_to_swap_in:
            self.gpu[g] = list(self.cpu[c])
        for src, dst in out.blocks_to_copy:
            self.gpu[dst] = list(self.gpu[src])
        for sg in out.scheduled_seq_groups:
            assert all(seq.num_computed_tokens == sg.start for seq in sg.seq_group.get_seqs(RUNNING))
            for seq in sg.seq_group.get_seqs(RUNNING):
                self.write(seq, sg.start, sg.start + sg.token_chunk_size, sg.spec_token_ids)
        contexts = {}
        for sg in out.scheduled_seq_groups:
            for seq in sg.seq_group.get_seqs(RUNNING):
                end = sg.start + sg.token_chunk_size
                contexts[seq.seq_id] = self.read(seq, end)
                assert contexts[seq.seq_id] == (seq.get_token_ids() + sg.spec_token_ids)[:end], \
                    f"KV pages corrupted for {seq}"
        # The sampler: a token per sampled row, from the context; the scheduler does the rest.
        results = []
        for sg in out.scheduled_seq_groups:
            sched.on_dispatched(sg)
            group, tokens = sg.seq_group, []
            for seq, samples in sg.sampled:  # (a fresh prompt: one row per fork, index = its place)
                context = contexts[seq.seq_id]
                if sg.spec_token_ids:  # a row after the last token and after each draft
                    first = len(context) - len(sg.spec_token_ids)
                    tokens += [self.sample(group, 0, context[:first + i]) for i in range(samples)]
                    continue
                indices = range(samples) if samples > 1 else [group.seqs.index(seq)]
                tokens += [self.sample(group, index, context) for index in indices]
            results.append((sg, [SamplerOutput.of_tokens(tokens, -1.0)], 0))
        assert not sched.update_from_output(results)
        self.poison(self.free_blocks())
        self.check_state()
        return out

    def free_blocks(self):
        """Free pages that hold no cached prefix."""
        return [b.block_id for b in self.bm.gpu_pool.blocks if b.ref_cnt == 0 and b.block_hash is None]

    def poison(self, block_ids):
        for block_id in block_ids:
            self.gpu[block_id] = [None] * self.block_size

    def sample(self, group, index, context):
        token = (sum((i + 1) * t for i, t in enumerate(context)) + 31 * index + _salt(group.request_id)) % 1000
        if self.copy_period and len(context) >= self.copy_period and token % 5:  # mostly a copy
            return context[-self.copy_period]
        return token

    def write(self, seq, start, end, drafts=()):
        table, tokens = self.bm.get_block_table(seq), seq.get_token_ids() + list(drafts)
        for pos in range(start, end):
            self.gpu[table[pos // self.block_size]][pos % self.block_size] = tokens[pos]

    def read(self, seq, end):
        table = self.bm.get_block_table(seq)
        return [self.gpu[table[pos // self.block_size]][pos % self.block_size] for pos in range(end)]

    def check_step(self, out, waiting_before):
        sched = self.scheduler
        groups = [sg.seq_group for sg in out.scheduled_seq_groups]
        assert len(set(map(id, groups))) == len(groups)
        num_tokens = 0
        for sg in out.scheduled_seq_groups:
            seqs = sg.seq_group.get_seqs(RUNNING)
            assert seqs and len(seqs) == sg.seq_group.num_unfinished_seqs()
            assert all(1 <= sg.token_chunk_size - len(sg.spec_token_ids) <= seq.get_num_uncomputed_tokens()
                       for seq in seqs)
            assert not sg.spec_token_ids or (len(seqs) == 1 and seqs[0].get_num_uncomputed_tokens() == 1)
            num_tokens += sg.token_chunk_size * len(seqs)
        assert out.num_batched_tokens == num_tokens <= sched.max_num_batched_tokens
        assert sum(g.get_max_num_running_seqs() for g in sched.running) <= sched.max_num_seqs
        # Every running sequence decodes each step unless blocks ran short.
        decoding = [g for g in sched.running if not g.is_prefill()]
        assert all(id(g) in set(map(id, groups)) for g in decoding)
        admitted = [g for g in sched.running if id(g) in waiting_before]
        if out.preempted or sched.swapped:
            assert not admitted, "admitted a waiting group while blocks were short"
        if out.preempted:
            assert not out.blocks_to_swap_in
        for g in out.ignored_seq_groups:
            assert all(seq.status is SequenceStatus.FINISHED_IGNORED for seq in g.seqs)

    def check_state(self):
        self.bm.check_invariants()
        sched = self.scheduler
        assert sum(len(g.get_seqs(RUNNING)) for g in sched.running) <= sched.max_num_seqs
        # A sequence holds blocks exactly while it runs (device) or is swapped out (host).
        seen = {RUNNING: set(), SWAPPED: set(), WAITING: set()}
        for queue, status in ((sched.running, RUNNING), (sched.swapped, SWAPPED), (sched.waiting, WAITING)):
            for group in queue:
                for seq in group.get_unfinished_seqs():
                    assert seq.status is status
                    seen[status].add(seq.seq_id)
        assert seen[RUNNING] == set(self.bm.gpu_tables) and seen[SWAPPED] == set(self.bm.cpu_tables)

    def run(self, max_steps=10_000, arrivals=None):
        """Step until everything finished; `arrivals` maps a step number to requests to add then."""
        arrivals = dict(arrivals or {})
        while self.scheduler.has_unfinished_seqs() or arrivals:
            for args in arrivals.pop(self.num_steps, []):
                self.add(*args)
            if self.num_steps >= max_steps:
                raise AssertionError("the scheduler made no progress")
            self.step()
        self.bm.check_invariants()
        assert self.bm.get_num_free_gpu_blocks() == self.bm.num_gpu_blocks
        assert self.bm.get_num_free_cpu_blocks() == self.bm.num_cpu_blocks

    def outputs(self, request_id):
        return [seq.output_token_ids for seq in self.groups[request_id].seqs]


def run_alone(request_id, prompt_len, max_tokens, best_of=1, prefix=(), **engine_kwargs):
    """The request's outputs with the whole engine to itself: a big pool, no preemption, no cache."""
    kwargs = dict(engine_kwargs, num_gpu_blocks=1024, num_cpu_blocks=0, watermark=0.0)
    engine = FakeEngine(**kwargs)
    engine.add(request_id, prompt_len, max_tokens, best_of, prefix)
    engine.run()
    assert engine.scheduler.num_preemptions == 0
    return engine.outputs(request_id)


def scheduled(out):
    return [(sg.seq_group.request_id, sg.token_chunk_size) for sg in out.scheduled_seq_groups]


def test_fcfs_admission_order():
    engine = FakeEngine(max_num_seqs=1)
    for name in "abc":
        engine.add(name, 5, 3)
    order = []
    while engine.scheduler.has_unfinished_seqs():
        out = engine.step()
        order += [rid for rid, _ in scheduled(out) if not order or order[-1] != rid]
    assert order == ["a", "b", "c"]


def test_fcfs_no_overtaking_when_blocks_are_short():
    engine = FakeEngine(num_gpu_blocks=8)
    engine.add("a", 24, 4)  # 6 blocks
    engine.step()
    engine.add("b", 12, 1)  # 3 blocks: must wait for a
    engine.add("c", 1, 1)  # 1 block would fit now, but c came after b
    while engine.scheduler.running:
        assert [rid for rid, _ in scheduled(engine.step())] == ["a"]
    assert scheduled(engine.step()) == [("b", 12), ("c", 1)]


def test_chunked_prefill_mixes_with_decodes_within_the_token_budget():
    engine = FakeEngine(max_num_batched_tokens=8, max_num_seqs=4)
    engine.add("a", 3, 10)
    engine.add("b", 20, 2)
    assert scheduled(engine.step()) == [("a", 3), ("b", 5)]  # b's prompt is split
    engine.add("c", 4, 2)
    # a decodes first; b continues before c is admitted, and takes the rest of the budget.
    assert scheduled(engine.step()) == [("a", 1), ("b", 7)]
    assert scheduled(engine.step()) == [("a", 1), ("b", 7)]
    assert scheduled(engine.step()) == [("a", 1), ("b", 1), ("c", 4)]  # b's last prompt token
    assert engine.groups["b"].seqs[0].get_output_len() == 1
    assert scheduled(engine.step()) == [("a", 1), ("b", 1), ("c", 1)]
    engine.run()
    for name in "abc":
        assert engine.outputs(name) == run_alone(name, *{"a": (3, 10), "b": (20, 2), "c": (4, 2)}[name])


def test_seq_budget_counts_best_of_before_the_fork():
    engine = FakeEngine(max_num_seqs=4)
    engine.add("a", 5, 4, best_of=3)
    engine.add("b", 5, 4, best_of=2)
    out = engine.step()
    assert scheduled(out) == [("a", 5)]  # b would make 5 sequences once a forks
    assert len(engine.groups["a"].seqs) == 3
    engine.run()
    assert engine.outputs("a") == run_alone("a", 5, 4, 3)
    assert engine.outputs("b") == run_alone("b", 5, 4, 2)


def fill_pool_engine(preemption_mode, num_cpu_blocks=16):
    """Three 4-token prompts (1 block each) in a 6-block pool: their second blocks fill it, and
    the third block each needs (at its 9th token) is not there for everyone. A fourth request,
    d, comes after the first step and waits."""
    engine = FakeEngine(num_gpu_blocks=6, num_cpu_blocks=num_cpu_blocks, preemption_mode=preemption_mode)
    for name in "abc":
        engine.add(name, 4, 8)
    assert scheduled(engine.step()) == [("a", 4), ("b", 4), ("c", 4)]
    engine.add("d", 4, 2)
    return engine


def step_until_preemption(engine):
    while True:
        before = {name: list(g.seqs[0].output_token_ids) for name, g in engine.groups.items()}
        out = engine.step()
        if out.preempted:
            return out, before


def test_preemption_by_recompute_takes_the_latest_group_back_to_the_front():
    engine = fill_pool_engine(None)
    out, before = step_until_preemption(engine)
    assert out.preempted == 1 and engine.scheduler.num_preemptions == 1
    assert scheduled(out) == [("a", 1), ("b", 1)]
    assert not out.blocks_to_swap_out
    c = engine.groups["c"]
    assert engine.scheduler.waiting[0] is c and engine.scheduler.waiting[1] is engine.groups["d"]
    assert c.seqs[0].status is WAITING and c.seqs[0].num_computed_tokens == 0
    assert c.seqs[0].output_token_ids == before["c"] and c.seqs[0].get_len() == 9
    # c comes back first (once a and b finish), prefilling its prompt and outputs in one go.
    while not any(rid in ("c", "d") for rid, _ in scheduled(out)):
        out = engine.step()
    assert scheduled(out) == [("c", 9), ("d", 4)]
    engine.run()
    for name in "abc":
        assert engine.outputs(name) == run_alone(name, 4, 8)


def test_preemption_by_swap():
    engine = fill_pool_engine("swap")
    out, _ = step_until_preemption(engine)
    c = engine.groups["c"]
    assert scheduled(out) == [("a", 1), ("b", 1)]
    assert len(out.blocks_to_swap_out) == 2 and list(engine.scheduler.swapped) == [c]
    assert c.seqs[0].status is SWAPPED and c.seqs[0].num_computed_tokens == 8
    swapped_cpu = {cpu for _, cpu in out.blocks_to_swap_out}
    # Nothing is admitted while c is out; c comes back first, then d.
    while True:
        out = engine.step()
        if not engine.scheduler.swapped:
            break
        assert not out.blocks_to_swap_in and "d" not in dict(scheduled(out))
    assert {cpu for cpu, _ in out.blocks_to_swap_in} == swapped_cpu
    assert scheduled(out) == [("c", 1), ("d", 4)]
    engine.run()
    for name in "abc":
        assert engine.outputs(name) == run_alone(name, 4, 8)


def test_several_victims_in_one_step_keep_their_arrival_order():
    # a's three forks need three blocks at their 9th token; c, then b, must go to free them.
    engine = FakeEngine(num_gpu_blocks=8, preemption_mode="swap")
    engine.add("a", 4, 8, best_of=3)
    engine.add("b", 4, 10)
    engine.add("c", 4, 10)
    out, _ = step_until_preemption(engine)
    assert out.preempted == 2 and scheduled(out) == [("a", 1)]
    assert [g.request_id for g in engine.scheduler.swapped] == ["b", "c"]
    engine.run()
    assert engine.outputs("a") == run_alone("a", 4, 8, 3)
    for name in "bc":
        assert engine.outputs(name) == run_alone(name, 4, 10)


def test_swap_falls_back_to_recompute_when_host_memory_is_full():
    engine = fill_pool_engine("swap", num_cpu_blocks=1)
    out, _ = step_until_preemption(engine)
    assert not out.blocks_to_swap_out and engine.scheduler.waiting[0] is engine.groups["c"]
    engine.run()
    for name in "abc":
        assert engine.outputs(name) == run_alone(name, 4, 8)


@pytest.mark.parametrize("num_cpu_blocks", [32, 0])  # swapped, or recomputed when host memory is missing
def test_multi_sequence_group_preemption(num_cpu_blocks):
    engine = FakeEngine(num_gpu_blocks=12, num_cpu_blocks=num_cpu_blocks, max_num_seqs=6)
    engine.add("a", 6, 12)
    engine.add("b", 6, 8, best_of=3)
    preempted = []
    while engine.scheduler.has_unfinished_seqs():
        out = engine.step()
        if out.preempted:
            preempted.append(bool(out.blocks_to_swap_out))
    assert preempted and all(preempted) == bool(num_cpu_blocks)
    assert engine.outputs("a") == run_alone("a", 6, 12)
    assert engine.outputs("b") == run_alone("b", 6, 8, 3)


def test_the_last_group_preempts_itself():
    engine = FakeEngine(num_gpu_blocks=5)
    engine.add("a", 4, 8)
    engine.add("b", 4, 8)
    out, _ = step_until_preemption(engine)  # at their 9th token a takes the last free block
    assert scheduled(out) == [("a", 1)] and engine.scheduler.waiting[0] is engine.groups["b"]
    engine.run()
    assert engine.outputs("b") == run_alone("b", 4, 8)


def test_a_sequence_growing_past_the_pool_is_ignored_with_its_outputs_so_far():
    engine = FakeEngine(num_gpu_blocks=3, num_cpu_blocks=0)
    engine.add("a", 5, 50)
    engine.run()
    seq = engine.groups["a"].seqs[0]
    assert engine.ignored == {"a"} and seq.status is SequenceStatus.FINISHED_IGNORED
    assert seq.get_len() == 13  # 12 tokens fill the pool; the 13th has no slot
    assert seq.output_token_ids == run_alone("a", 5, 50)[0][:8]
    assert seq.status.finish_reason == "length"


def test_requests_that_can_never_run_are_ignored():
    engine = FakeEngine(num_gpu_blocks=8, max_model_len=40, max_num_seqs=2)
    engine.add("too_long_for_the_model", 41, 1)
    engine.add("too_long_for_the_pool", 33, 1)  # 9 blocks of 4
    engine.add("too_many_seqs", 4, 1, best_of=3)
    engine.add("ok", 10, 3)
    out = engine.step()
    assert scheduled(out) == [("ok", 10)]
    assert [g.request_id for g in out.ignored_seq_groups] == ["too_long_for_the_model", "too_long_for_the_pool",
                                                             "too_many_seqs"]
    engine.run()
    assert engine.outputs("ok") == run_alone("ok", 10, 3)


def test_abort_frees_blocks_from_every_queue():
    engine = fill_pool_engine("swap")
    step_until_preemption(engine)
    sched = engine.scheduler
    assert [g.request_id for g in sched.running] == ["a", "b"]
    assert [g.request_id for g in sched.swapped] == ["c"] and [g.request_id for g in sched.waiting] == ["d"]
    for name in "cdb":
        sched.abort_seq_group(name)
        assert all(seq.status is SequenceStatus.FINISHED_ABORTED for seq in engine.groups[name].seqs)
        engine.check_state()
    assert sched.get_num_unfinished_seq_groups() == 1
    assert engine.bm.get_num_free_cpu_blocks() == 16
    assert engine.bm.get_num_free_gpu_blocks() == 6 - len(engine.bm.get_block_table(engine.groups["a"].seqs[0]))
    sched.abort_seq_group("a")
    sched.abort_seq_group("unknown")
    assert not sched.has_unfinished_seqs()
    assert engine.bm.get_num_free_gpu_blocks() == 6


def test_scheduler_arguments():
    bm = BlockManager(4, 8, 0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=4, max_model_len=16)
    with pytest.raises(ValueError, match="preemption_mode"):
        Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=4, max_model_len=16, preemption_mode="drop")


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("enable_caching", [False, True])
@pytest.mark.parametrize("preemption_mode", [None, "swap", "recompute"])
@pytest.mark.parametrize("seed", range(8))
def test_random_workloads(preemption_mode, seed, enable_caching, speculative):
    """Random arrivals, lengths, forks, pools and budgets; each request's outputs must equal its
    outputs alone in a big pool. With speculation the model mostly copies (n-gram drafts hit),
    and the outputs alone are computed without it: drafts change nothing but the step count."""
    rng = random.Random(f"{preemption_mode}-{seed}")
    block_size = rng.choice([1, 2, 4, 8])
    num_gpu_blocks = rng.randint(8, 24)
    max_num_seqs = rng.randint(1, 12)
    config = dict(block_size=block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=rng.choice([0, 4, 64]),
                  watermark=rng.choice([0.0, 0.1]), max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=rng.randint(max_num_seqs, 40), max_model_len=rng.randint(24, 48),
                  preemption_mode=preemption_mode, stop_every=rng.choice([0, 13]))
    if speculative:
        config["copy_period"] = rng.randint(2, 9)
        config["max_num_batched_tokens"] += rng.choice([0, 8, 40])  # room for drafts, or none
        spec = dict(method="ngram", num_speculative_tokens=rng.randint(1, 5), prompt_lookup_max=rng.randint(1, 4))
        if rng.random() < 0.3:
            spec["disable_by_batch_size"] = rng.randint(1, 4)
        print(f"seed {seed}: speculative_config {spec}, copy_period {config['copy_period']}")
    engine = FakeEngine(**config, enable_caching=enable_caching,
                        speculative_config=spec if speculative else None)
    capacity = (num_gpu_blocks - engine.bm.watermark_blocks) * block_size
    # With caching, prompts share prefixes of every length (often all of it) from two families.
    families = [[rng.randrange(1000) for _ in range(40)] for _ in range(2)] if enable_caching else [[]]
    requests, arrivals = {}, {}
    for i in range(rng.randint(10, 25)):
        best_of = rng.choice([1, 1, 1, 2, 3])
        prompt_len = rng.randint(1, min(40, capacity + 4))  # a few too long for the pool
        prefix = tuple(rng.choice(families)[:rng.choice([prompt_len, rng.randint(0, prompt_len)])])
        # Keep every request within what the pool holds at its longest, so that whether it
        # finishes depends only on its prompt (growing past the pool is tested above).
        room = (num_gpu_blocks - engine.bm.watermark_blocks - best_of) // best_of * block_size
        max_tokens = max(1, min(rng.randint(1, 30), room - prompt_len, config["max_model_len"] - prompt_len))
        requests[f"r{i}"] = (prompt_len, max_tokens, best_of, prefix)
        arrivals.setdefault(rng.choice([0, 0, rng.randint(0, 30)]), []).append((f"r{i}", *requests[f"r{i}"]))
    engine.run(arrivals=arrivals)
    expected_ignored = {name for name, (prompt_len, _, best_of, _) in requests.items()
                        if prompt_len > min(config["max_model_len"], capacity) or best_of > max_num_seqs}
    assert engine.ignored == expected_ignored
    assert (engine.bm.prefix_cache_hits > 0) == enable_caching
    alone = {key: config[key] for key in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                                          "stop_every", "copy_period") if key in config}
    for name, request in requests.items():
        if name not in expected_ignored:
            assert engine.outputs(name) == run_alone(name, *request, **alone), name
    if speculative:
        speculator = engine.scheduler.speculator
        print(speculator.stats())
        assert 0 <= speculator.num_accepted_tokens <= speculator.num_draft_tokens


def test_prefix_caching_computes_only_the_uncached_tokens():
    engine = FakeEngine(block_size=4, max_num_batched_tokens=64, enable_caching=True)
    prefix = tuple(range(500, 513))  # 3 full blocks and a token
    engine.add("a", 16, 2, prefix=prefix)
    engine.run()
    # b shares 13 tokens with a: the 3 full blocks among them are cached, the rest is computed.
    engine.add("b", 15, 2, prefix=prefix)
    assert scheduled(engine.step()) == [("b", 3)]
    assert (engine.bm.prefix_cache_queries, engine.bm.prefix_cache_hits) == (16 + 15, 12)
    engine.run()
    # Same step: d reads the blocks c fills in this very step.
    engine.add("c", 10, 2, prefix=tuple(range(600, 610)))
    engine.add("d", 12, 2, prefix=tuple(range(600, 610)))
    assert scheduled(engine.step()) == [("c", 10), ("d", 4)]
    engine.run()
    # A prompt that is entirely cached still computes its last block (the token gives the logits).
    engine.add("e", 12, 2, prefix=engine.groups["d"].prompt_token_ids)
    assert scheduled(engine.step()) == [("e", 4)]
    engine.run()
    assert engine.bm.prefix_cache_hits == 12 + 8 + 8
    for name, prompt_len, shared in (("b", 15, prefix), ("d", 12, tuple(range(600, 610)))):
        assert engine.outputs(name) == run_alone(name, prompt_len, 2, prefix=shared)


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_prefix_caching_under_preemption(preemption_mode):
    # Six requests with one 12-token prefix in a pool that holds about two of them.
    engine = FakeEngine(block_size=4, num_gpu_blocks=14, num_cpu_blocks=32, max_num_seqs=6,
                        preemption_mode=preemption_mode, enable_caching=True)
    prefix = tuple(range(700, 712))
    for i in range(6):
        engine.add(f"r{i}", 13 + i, 10, best_of=1 + i % 2, prefix=prefix)
    engine.run()
    assert engine.scheduler.num_preemptions > 0 and engine.bm.prefix_cache_hits >= 5 * 12
    for i in range(6):
        assert engine.outputs(f"r{i}") == run_alone(f"r{i}", 13 + i, 10, 1 + i % 2, prefix)


def test_pooling_requests_run_whole_fcfs_and_take_no_blocks():
    """Prefill-only pooling requests beside a decoding one: each is admitted FCFS with its whole
    input in one step, within the token budget and seats, never chunked; it takes no KV blocks
    and finishes with that step, its pooled row handed back by update_from_output. One over
    max_model_len is ignored; aborting a waiting one frees nothing."""
    seed = random.randrange(2**32)
    print("seed", seed)
    rng = random.Random(seed)
    bm = BlockManager(4, 16, 0)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32)
    gen = SequenceGroup("gen", [Sequence(sched.new_seq_id(), list(range(6)))], SamplingParams(max_tokens=8), 0.0)
    sched.add_seq_group(gen)
    lengths = [rng.randint(1, 32) for _ in range(14)]
    groups = []
    for i, n in enumerate(lengths + [33, 5]):
        g = SequenceGroup(f"p{i}", [Sequence(sched.new_seq_id(), [i] * n)], SamplingParams(max_tokens=1), 0.0)
        g.pooling = "MEAN"  # (what the pooling engine reads; the scheduler only tests it against None)
        groups.append(g)
        sched.add_seq_group(g)
    sched.abort_seq_group("p15")  # waiting: nothing to free
    admitted = []
    while sched.has_unfinished_seqs():
        waiting = [g.request_id for g in sched.waiting if g.pooling is not None]
        out = sched.schedule()
        pooled = [s for s in out.scheduled_seq_groups if s.seq_group.pooling is not None]
        assert all(s.token_chunk_size == len(s.seq_group.prompt_token_ids) and s.start == 0 for s in pooled)
        assert out.num_batched_tokens <= 32 and len(out.scheduled_seq_groups) <= 4
        ids = [s.seq_group.request_id for s in pooled]
        assert ids == waiting[:len(ids)]  # FCFS: a prefix of the queue
        if len(ids) < len(waiting) and waiting[len(ids)] != "p14":  # the next did not fit what was left
            nxt = next(g for g in groups if g.request_id == waiting[len(ids)])
            assert (len(nxt.prompt_token_ids) > 32 - out.num_batched_tokens
                    or len(out.scheduled_seq_groups) == 4)
        results = []
        for k, s in enumerate(pooled):
            sched.on_dispatched(s)
            results.append((s, [[("pooled", s.seq_group.request_id)] * len(pooled)], k))
        for s in out.scheduled_seq_groups:
            if s.seq_group is gen:
                sched.on_dispatched(s)
                results.append((s, [SamplerOutput.of_tokens([7] * sum(s.samples))], 0))
        sched.update_from_output(results)
        admitted += ids
        # Blocks belong to the decoding request alone.
        held = sum(len(t) for t in bm.gpu_tables.values())
        assert held == bm.num_gpu_blocks - bm.gpu_pool.get_num_free_blocks()
        assert set(bm.gpu_tables) <= {gen.seqs[0].seq_id}
    assert admitted == [f"p{i}" for i in range(14)]
    assert all(g.pooled == ("pooled", g.request_id) and g.is_finished() for g in groups[:14])
    assert groups[14].seqs[0].status is SequenceStatus.FINISHED_IGNORED
    assert groups[15].seqs[0].status is SequenceStatus.FINISHED_ABORTED and groups[15].pooled is None
    assert gen.is_finished() and bm.gpu_pool.get_num_free_blocks() == bm.num_gpu_blocks


def with_image(group, offset: int, length: int, mm_hash: str = "image"):
    """Give a just-added group one image, as MultimodalEngine.attach does for a model whose image
    tokens attend to each other both ways (Gemma 3): computed in one chunk, never cut."""
    from jpaged.multimodal.processing import MMItem

    group.mm_items, group.encoder_cache_rows, group.disable_chunked_mm_input = [MMItem(mm_hash, offset, length, {})], 64, True
    for seq in group.seqs:
        seq.mm_ranges = ((offset, length, mm_hash),)
    return group


def test_an_image_attended_both_ways_is_computed_in_one_chunk():
    """disable_chunked_mm_input: a chunk that would end inside the image stops before it; after a
    prefix hit that stopped inside the image (its first blocks cached), the group computes the
    image's rest in one chunk, and waits (scheduled with no tokens, not at all) while the step's
    budget is too small for it."""
    engine = FakeEngine(block_size=4, max_num_batched_tokens=8, enable_caching=True)
    prefix = tuple(range(700, 720))
    with_image(engine.add("a", 20, 2, prefix=prefix), 6, 5)  # the image at 6..10
    chunks = []
    while engine.scheduler.has_unfinished_seqs():
        chunks += [n for name, n in scheduled(engine.step()) if name == "a"]
    assert chunks[:3] == [6, 8, 6]  # [0, 6), [6, 14): the image whole, [14, 20)
    # c takes 6 of the 8 tokens; b hits a's first two blocks (8 tokens: the image's first two) and
    # its image's other three do not fit the 2 left: b waits a step, then computes them at once.
    engine.add("c", 6, 2)
    with_image(engine.add("b", 14, 2, prefix=prefix[:9]), 6, 5)
    first = engine.step()
    assert scheduled(first) == [("c", 6)] and engine.groups["b"].seqs[0].num_computed_tokens == 8
    second = engine.step()
    assert ("b", 6) in scheduled(second)  # 8..13: the image's rest (8..10) and the prompt's end
    engine.run()
    assert engine.outputs("b") == run_alone("b", 14, 2, prefix=prefix[:9])
