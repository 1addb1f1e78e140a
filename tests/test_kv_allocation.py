"""KV allocation policies (the paper's baselines), their memory accounting and the KV map.

One request of a 5-token prompt and max_tokens=6 (final length 11) in a pool of 20 blocks of
4 tokens, max_model_len 32. Each policy's slots are computed by hand in the comments.
"""

import itertools
import re
import xml.etree.ElementTree as ET

import pytest

from jpaged.core.block_manager import BlockManager
from jpaged.core.kv_allocation import KVUsage, kv_usage, reserved_len, step_without_model
from jpaged.core.kv_map import KVMap
from jpaged.core.scheduler import Scheduler
from jpaged.core.sequence import Sequence, SequenceGroup, SequenceStatus
from jpaged.sampling_params import SamplingParams

BLOCK, BLOCKS, MAX_LEN = 4, 20, 32
_ids = itertools.count()


class Driver:
    """The engine around a real Scheduler and BlockManager: each step computes the scheduled
    tokens, samples one per sequence that reached its end and finishes it at max_tokens."""

    def __init__(self, policy: str, num_blocks: int = BLOCKS, enable_caching: bool = False):
        self.bm = BlockManager(BLOCK, num_blocks, 0, watermark=0, enable_caching=enable_caching, kv_allocation=policy,
                               max_model_len=MAX_LEN)
        self.scheduler = Scheduler(self.bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=MAX_LEN)

    def add(self, prompt_len: int, max_tokens: int, prompt=None) -> SequenceGroup:
        seq = Sequence(next(_ids), prompt or [7] * prompt_len)
        group = SequenceGroup(f"r{seq.seq_id}", [seq], SamplingParams(max_tokens=max_tokens), arrival_time=0.0)
        self.scheduler.add_seq_group(group)
        return group

    def step(self):
        out = step_without_model(self.scheduler, token_id=1)
        self.bm.check_invariants()
        return out

    def usage(self) -> KVUsage:
        return kv_usage(self.bm, self.scheduler.running, MAX_LEN)


def test_reserved_lengths():
    assert [reserved_len(p, 11, 32) for p in ("paged", "orca-oracle", "orca-pow2", "orca-max", "static")] == \
        [11, 11, 16, 32, 32]
    assert reserved_len("orca-pow2", 16, 32) == 16 and reserved_len("orca-pow2", 17, 20) == 20
    with pytest.raises(ValueError, match="kv_allocation"):
        reserved_len("orca", 11, 32)
    with pytest.raises(ValueError, match="kv_allocation"):
        BlockManager(4, 8, 0, kv_allocation="orca-max")  # no max_model_len to reserve


def test_paged_grows_on_demand():
    d = Driver("paged")
    d.add(5, 6)
    # Step 1 prefills 5 tokens and samples the 6th: 2 blocks, 5 slots computed, 3 more to fill in block 1.
    expected = [(5, 3, 0), (6, 2, 0), (7, 1, 0), (8, 0, 0),
                # Step 5 takes block 2 for token 9; the sequence ends at 11 tokens: its slot 4 is never filled.
                (9, 2, 1)]
    for tokens, reserved, fragmented in expected:
        d.step()
        blocks = BLOCKS - d.bm.get_num_free_gpu_blocks()
        assert d.usage() == KVUsage(tokens, reserved, fragmented, (BLOCKS - blocks) * BLOCK)
    d.step()  # the 6th output token: done, every block back
    assert d.usage() == KVUsage(0, 0, 0, BLOCKS * BLOCK) and not d.scheduler.has_unfinished_seqs()


@pytest.mark.parametrize("policy, blocks, fragmented", [
    ("orca-oracle", 3, 1),  # 11 slots reserved in 3 blocks: 12 - 11 never filled
    ("orca-pow2", 4, 5),  # 16 slots: 16 - 11
    ("orca-max", 8, 21),  # 32 slots: 32 - 11
    ("static", 8, 21),
])
def test_reservation_policies_take_everything_at_admission(policy, blocks, fragmented):
    d = Driver(policy)
    d.add(5, 6)
    for computed in range(5, 10):
        d.step()
        # Blocks never change while the request runs: no growth, so never a preemption.
        assert d.bm.get_num_free_gpu_blocks() == BLOCKS - blocks
        assert d.usage() == KVUsage(computed, 11 - computed, fragmented, (BLOCKS - blocks) * BLOCK)
    d.step()
    assert d.bm.get_num_free_gpu_blocks() == BLOCKS and not d.scheduler.has_unfinished_seqs()


def test_reservation_admits_fewer_requests():
    """Three such requests: paged admits all three (2 blocks each), orca-max two (8 each of 20)."""
    for policy, admitted in (("paged", 3), ("orca-pow2", 3), ("orca-max", 2)):
        d = Driver(policy)
        for _ in range(3):
            d.add(5, 6)
        d.step()
        assert len(d.scheduler.running) == admitted, policy


@pytest.mark.parametrize("policy", ["orca-max", "static"])
def test_static_batching_admits_only_between_batches(policy):
    """Three requests fit together (8 blocks each of 24). Under static batching the one arriving
    after the batch started decoding waits for the whole batch to finish, however much is free."""
    d = Driver(policy, num_blocks=24)
    first, second = d.add(5, 6), d.add(5, 6)  # the first batch: both, admitted together
    d.step()
    assert list(d.scheduler.running) == [first, second]
    d.step()  # decoding
    late = d.add(2, 1)
    started = lambda: late.seqs[0].num_computed_tokens > 0  # noqa: E731
    d.step()
    assert started() == (policy == "orca-max")
    while first.get_seqs(SequenceStatus.RUNNING):
        assert policy == "orca-max" or not started()
        d.step()
    d.step()  # the batch is over: the late request starts (and ends: max_tokens=1)
    assert late.is_finished() and not d.scheduler.has_unfinished_seqs()


def test_shared_blocks_count_once_and_the_map_shows_each_block_once():
    """Prefix caching: a second request with the same 9-token prompt shares its 2 full blocks."""
    d = Driver("paged", enable_caching=True)
    prompt = list(range(9))
    a = d.add(9, 4, prompt)
    d.step()  # a: 3 blocks, 9 computed, 1 sampled
    b = d.add(9, 4, prompt)
    d.step()  # b takes blocks 0-1 from the cache and computes its 9th token; a decodes its 10th
    # a: 10 computed of 13 (3 blocks: slots 10-11 reserved, 12 planned in a 4th block not held yet);
    # b: its own 3rd block holds 1 token, 3 reserved; shared blocks 0-1: 8 tokens, counted once.
    assert d.usage() == KVUsage(8 + 2 + 1, 2 + 3, 0, (BLOCKS - 4) * BLOCK)
    kv = KVMap.of(d.bm, d.scheduler.running)
    cells = [cell for _, row in kv.rows for cell in row]
    assert sorted(block for block, _ in cells) == list(range(BLOCKS))
    assert kv.rows[0][0] == f"request {a.request_id}" and [s for _, s in kv.rows[0][1]] == ["shared"] * 2 + ["in use"]
    assert kv.rows[1][0] == f"request {b.request_id}" and [s for _, s in kv.rows[1][1]] == ["in use"]
    assert kv.counts() == {"in use": 2, "shared": 2, "reserved": 0, "cached": 0, "free": BLOCKS - 4}
    while d.scheduler.has_unfinished_seqs():
        d.step()
    counts = KVMap.of(d.bm, d.scheduler.running).counts()
    # Freed, the full blocks stay cached: the 2 shared ones and a's 3rd; b's 3rd holds the same
    # tokens (both sampled 1s), a duplicate that is not cached again.
    assert counts == {"in use": 0, "shared": 0, "reserved": 0, "cached": 3, "free": BLOCKS - 3}


def test_map_shows_a_reservation_and_renders_one_rect_per_block(tmp_path):
    d = Driver("orca-oracle")
    group = d.add(5, 6)
    d.step()
    kv = KVMap.of(d.bm, d.scheduler.running)
    assert kv.rows[0] == (f"request {group.request_id}", [(0, "in use"), (1, "in use"), (2, "reserved")])
    path = tmp_path / "kv.svg"
    kv.save(str(path))
    root = ET.parse(path).getroot()  # well-formed SVG
    rects = [r for r in root.iter("{http://www.w3.org/2000/svg}rect") if "block" in r.get("class", "")]
    assert len(rects) == BLOCKS
    assert [r.get("class") for r in rects[:3]] == ["block in-use", "block in-use", "block reserved"]
    assert re.search(r"20 blocks of 4 tokens", path.read_text())
    with pytest.raises(ValueError, match="svg"):
        kv.save(str(tmp_path / "kv.png"))


@pytest.fixture(scope="module")
def engines():
    import jpaged

    kwargs = dict(max_num_seqs=4, max_model_len=64, num_gpu_blocks_override=24, block_size=8, enforce_eager=True)
    return {policy: jpaged.LLM("tiny", kv_allocation=policy, **kwargs) for policy in ("paged", "orca-max", "static")}


def test_engine_baselines_generate_the_same_tokens(engines):
    """Same kernels, only the block tables differ: greedy outputs match paged allocation's. The
    baselines run fewer requests at once (each reserves 8 of the 24 blocks) but finish them all."""
    import jpaged

    prompts = [[5 + i] * (3 + 4 * i) for i in range(5)]
    params = jpaged.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in engines["paged"].generate(prompts, params, use_tqdm=False)]
    for policy in ("orca-max", "static"):
        outputs = engines[policy].generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected, policy
        assert engines[policy].llm_engine.kv_usage().free_slots == 24 * 8
        assert engines[policy].stats()["num_preemptions"] == 0


def test_engine_accounting_and_map_while_running(engines):
    import jpaged

    llm = engines["orca-max"]
    engine = llm.llm_engine
    engine.add_request("a", [3] * 10, jpaged.SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()  # prefill 10, sample the 11th: 8 reserved blocks of 8 (max_model_len 64)
    assert engine.kv_usage() == KVUsage(10, 15 - 10, 64 - 15, 16 * 8)
    states = [s for _, s in llm.kv_map().rows[0][1]]
    assert states == ["in use"] * 2 + ["reserved"] * 6
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.kv_map().counts()["free"] == 24


def test_engine_rejects_what_the_baselines_cannot_do(engines):
    import jpaged

    with pytest.raises(ValueError, match="best_of"):
        engines["orca-max"].generate([[1, 2]], jpaged.SamplingParams(n=2), use_tqdm=False)
    with pytest.raises(ValueError, match="kv_allocation"):
        jpaged.LLM("tiny", kv_allocation="orca-max", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="kv_allocation"):
        jpaged.LLM("tiny", kv_allocation="fastertransformer")
