"""The data-parallel router's rules, on replicas made of the model-free engine (test_scheduler's
FakeEngine: a real Scheduler and BlockManager) that report their prefix caches by KV events."""

import numpy as np
import pytest
from test_scheduler import FakeEngine

import jpaged.data_parallel.router as router_module
from jpaged.data_parallel.router import Router
from jpaged.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored

BLOCK = 4


def stored(router, prompt, salt=None):
    """The events a replica sends once it caches `prompt`'s full blocks."""
    hashes = router.block_hashes(prompt + [0], salt)
    return [BlockStored(hashes, None, prompt[:len(hashes) * BLOCK], BLOCK, None, "GPU", None)]


def test_the_longest_cached_prefix_wins_within_the_load_slack():
    router = Router(3, BLOCK, load_slack=4)
    a, b = list(range(100, 124)), list(range(300, 324))
    router.on_events(1, stored(router, a[:8]))  # 2 blocks of a
    router.on_events(2, stored(router, a))  # all 6 blocks of a
    router.on_events(0, stored(router, b))
    router.loads = [0, 1, 3]
    assert router.route(a + [7]) == 2  # the longest prefix, 3 busier than the least-loaded: within 4
    router.loads = [0, 1, 5]
    assert router.route(a + [7]) == 0  # beyond the slack: the least-loaded one
    router.loads = [0, 0, 0]
    assert router.route(b + [7]) == 0
    # Nobody has it: the least-loaded; among equals, the one caching fewest blocks (2 against 6).
    assert router.route(list(range(500, 530))) == 1
    router.loads = [2, 1, 2]
    assert router.route(list(range(500, 530))) == 1
    router.loads = [1, 2, 1]
    assert router.route(list(range(600, 630))) == 0  # 6 blocks each: the lower rank
    # Equal prefixes: the less loaded, then the one caching fewer blocks, then the lower rank.
    router.on_events(0, stored(router, a))
    router.loads = [2, 1, 1]
    assert router.route(a + [9]) == 2
    router.loads = [1, 1, 1]
    assert router.route(a + [9]) == 2  # 6 blocks against rank 0's 12
    router.on_events(2, stored(router, b))
    assert router.route(a + [9]) == 0  # 12 each: the lower rank


def test_a_long_prefix_is_worth_a_longer_queue():
    """The slack grows by one request per PREFIX_TOKENS_PER_REQUEST tokens the hit saves over the
    least-loaded replica (what it already caches of the prompt counts against the hit)."""
    size, per = 16, router_module.PREFIX_TOKENS_PER_REQUEST
    long_prompt, short_prompt = list(range(1, 2049)), list(range(3000, 3000 + per))

    def route(prompt, extra, zero_caches=()):
        router = Router(2, size)  # load_slack 8; a new router each time (a route counts as sent there)
        router.on_events(1, stored(router, prompt))
        router.on_events(0, stored(router, list(zero_caches)) if zero_caches else [])
        router.loads = [2, 2 + extra]
        return router.route(prompt + [5])

    long_slack, short_slack, half_slack = 8 + 2048 // per, 8 + 1, 8 + 1024 // per
    assert (route(long_prompt, long_slack), route(long_prompt, long_slack + 1)) == (1, 0)
    assert (route(short_prompt, short_slack), route(short_prompt, short_slack + 1)) == (1, 0)
    # Replica 0 caches the long prompt's first half: the hit on replica 1 saves the other half only.
    half = long_prompt[:1024]
    assert (route(long_prompt, half_slack, half), route(long_prompt, half_slack + 1, half)) == (1, 0)


def test_a_replica_without_a_free_seat_loses_the_request_to_one_with_a_seat():
    prompt = list(range(40, 64))

    def route(loads, seats=6):
        router = Router(2, BLOCK, seats=seats)  # a new router each time (a route counts as sent there)
        router.on_events(1, stored(router, prompt))
        router.loads = list(loads)
        return router.route(prompt + [1])

    assert route([5, 5]) == 1
    assert route([5, 6]) == 0  # replica 1 full, replica 0 has a seat: there the request would not wait
    assert route([6, 7]) == 1  # both full: the cached prefix wins within the slack
    assert route([5, 6], seats=None) == 1  # seats unknown: the slack alone


def test_a_prefix_just_sent_counts_as_cached_there_until_its_events_or_the_ttl(monkeypatch):
    """Requests with one new prefix, in a burst (before the replica's events): they follow the
    first to its replica, within the load slack, for SENT_TTL_S; an eviction event ends it."""
    clock = [100.0]
    monkeypatch.setattr(router_module.time, "monotonic", lambda: clock[0])
    router = Router(2, BLOCK)
    prefix = list(range(700, 724))
    first = router.route(prefix + [1])
    router.loads[first] = 3  # busier than the other, within the slack
    assert router.route(prefix + [2]) == first
    clock[0] += router_module.SENT_TTL_S + 0.1  # no event came: the guess expires
    assert router.route(prefix + [3]) == 1 - first
    hashes = router.block_hashes(prefix + [4])
    router.on_events(1 - first, [BlockRemoved(hashes[:1], "GPU")])  # evicted there: no longer counted
    assert router.matched_blocks(1 - first, hashes) == 0


def test_idle_replicas_share_new_prefixes():
    """One request at a time (every load 0): each new prefix goes to the replica caching fewer
    blocks, so both caches fill, and a prefix seen before returns to its replica."""
    router = Router(2, BLOCK)
    prefixes = [list(range(1000 * k, 1000 * k + 24)) for k in range(1, 7)]
    placed = {}
    for k, prefix in enumerate(prefixes):
        rank = router.route(prefix + [k])
        router.on_events(rank, stored(router, prefix + [k]))
        placed[k] = rank
    assert sorted(placed.values()) == [0, 0, 0, 1, 1, 1]
    for k, prefix in enumerate(prefixes):
        assert router.route(prefix + [99]) == placed[k]


def test_the_block_of_the_last_token_never_counts():
    router = Router(2, BLOCK)
    prompt = list(range(16))  # 4 full blocks; the 4th holds the last token, computed anyway
    assert len(router.block_hashes(prompt)) == 3 and len(router.block_hashes(prompt + [1])) == 4


def test_salts_and_adapters_separate_prefixes():
    router = Router(2, BLOCK)
    prompt = list(range(40, 60))
    router.on_events(1, stored(router, prompt, salt=b"lora:1"))
    router.loads = [0, 0]
    assert router.route(prompt + [1], cache_salt=b"lora:1") == 1
    assert router.route(prompt + [1]) == 0  # the base model's blocks are others
    assert router.route(prompt + [1], cache_salt=b"lora:2") == 0


def test_removals_clears_and_replicas_going_down():
    router = Router(2, BLOCK)
    prompt = list(range(20))
    events = stored(router, prompt)
    router.on_events(1, events)
    assert router.route(prompt + [1]) == 1
    router.on_events(1, [BlockRemoved(events[0].block_hashes[:1], "GPU")])  # the first block evicted
    assert router.matched_blocks(1, router.block_hashes(prompt + [1])) == 0 and router.route(prompt + [1]) == 0
    router.on_events(1, events)
    router.on_events(1, [AllBlocksCleared()])
    assert router.cached[1] == set()
    router.on_events(0, events)
    router.set_up(0, False)
    assert router.route(prompt + [1]) == 1 and router.cached[0] == set()
    router.set_up(1, False)
    with pytest.raises(RuntimeError, match="no data-parallel replica"):
        router.route(prompt)


def test_round_robin_and_least_loaded_ignore_the_caches():
    router = Router(3, BLOCK, policy="round-robin")
    router.on_events(2, stored(router, list(range(12))))
    assert [router.route(list(range(13))) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    router.set_up(1, False)
    assert [router.route([1, 2]) for _ in range(4)] == [0, 2, 0, 2]
    router = Router(3, BLOCK, policy="least-loaded")
    router.on_events(2, stored(router, list(range(12))))
    router.loads = [3, 1, 2]
    assert router.route(list(range(13))) == 1


@pytest.mark.parametrize("field, value", [("policy", "cache"), ("num_replicas", 0)])
def test_bad_arguments(field, value):
    kwargs = {"num_replicas": 2, "block_size": BLOCK, "policy": "prefix", field: value}
    with pytest.raises(ValueError, match="dp_routing|data_parallel_size"):
        Router(**kwargs)


def run_fleet(policy: str, seed: int) -> tuple[float, list]:
    """2 replicas, 12 system prompts of 8 blocks with 6 users each, in random order; each replica's
    pool holds about half of the prompts. Returns the fleet's prefix-cache hit rate (tokens)."""
    rng = np.random.default_rng(seed)
    replicas = [FakeEngine(block_size=BLOCK, num_gpu_blocks=72, max_num_seqs=4, max_num_batched_tokens=64,
                           enable_caching=True) for _ in range(2)]
    for replica in replicas:
        replica.bm.enable_kv_events()
    router = Router(2, BLOCK, policy=policy)
    systems = [rng.integers(0, 1000, 32).tolist() for _ in range(12)]
    requests = [(s, u) for s in range(12) for u in range(6)]
    order = rng.permutation(len(requests))
    placed = []
    for k, i in enumerate(order):
        system, user = requests[i]
        prefix = tuple(systems[system])
        rank = router.route(list(prefix) + [user])
        placed.append(rank)
        replicas[rank].add(f"s{system}u{user}", 32 + 4, 3, prefix=prefix)
        for r, replica in enumerate(replicas):  # a step per arrival; loads and events come back after it
            if replica.scheduler.has_unfinished_seqs():
                replica.step()
            router.on_events(r, replica.bm.take_events())
            router.set_load(r, len(replica.scheduler.running) + len(replica.scheduler.waiting))
    for replica in replicas:
        replica.run()
    hits = sum(r.bm.prefix_cache_hits for r in replicas)
    queries = sum(r.bm.prefix_cache_queries for r in replicas)
    return hits / queries, placed


@pytest.mark.parametrize("seed", range(3))
def test_prefix_routing_finds_more_cached_blocks_than_round_robin(seed):
    prefix, placed = run_fleet("prefix", seed)
    round_robin, _ = run_fleet("round-robin", seed)
    least, _ = run_fleet("least-loaded", seed)
    print(f"seed {seed}: hit rate prefix {prefix:.3f}, round-robin {round_robin:.3f}, least-loaded {least:.3f}; "
          f"prefix placed {placed.count(0)} / {placed.count(1)}")
    assert prefix > round_robin and prefix > least
    assert min(placed.count(0), placed.count(1)) >= len(placed) // 4  # both replicas work
