"""Which replica serves a request (`--dp-routing prefix | least-loaded | round-robin`).

`prefix` (the default) sends a request to the replica whose prefix cache holds the longest run of
its leading full blocks, unless that replica is busier than the least-loaded one by more than its
slack (waiting + running requests): then the least-loaded one takes it, so one hot prefix cannot
pile every request onto one replica. The slack is `load_slack` plus one request per
PREFIX_TOKENS_PER_REQUEST tokens of prefill the hit saves over the least-loaded replica: a long
prefix is worth a longer queue than a short one, since sending its request elsewhere recomputes it
there and evicts what that replica caches (bench_dp's few-long pattern: with a fixed slack of 8, a
burst that left one replica 9 requests busier sent its prefixes to the other one too, and both
pools thrashed: hit rate 0.54-0.68 against 0.88). A replica whose seats (`max_num_seqs`) are all
taken loses the request to one with a free seat whatever it caches: there it would wait. Ties go
to the less loaded replica, then to the one caching fewer blocks, then the lower rank. A request
no replica has a block of goes to the least-loaded one, and among equally loaded ones to the one
caching fewer blocks (SGLang's cache-aware router's smallest-tree rule): new prefixes spread over
the replicas even when they idle, where the lower rank would take every one and the other
replicas' caches stay empty.

The router knows what a replica caches from that replica's KV events (jpaged/kv_events:
BlockStored adds hashes, BlockRemoved drops them, AllBlocksCleared empties the replica's set),
and, for SENT_TTL_S after it sends a request, counts that request's blocks as cached there too:
the events come only once the replica has computed them, and a burst of requests with one new
prefix would otherwise be spread over every replica, each computing the prefix. It hashes a request's blocks as the engines do
(`block_manager.hash_block_tokens`, chained from the request's cache salt; a LoRA adapter salts
its requests), in the events' external form, so adapters and salts separate prefixes here as in
one engine. Loads come from the replicas' own counts (`set_load`).
"""

import itertools
import time

from jpaged.config import DP_ROUTINGS as POLICIES
from jpaged.core.block_manager import hash_block_tokens
from jpaged.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, external_block_hash

# Requests (waiting + running) the replica with the best prefix may have beyond the least-loaded
# one and still take the request.
DEFAULT_LOAD_SLACK = 8
# Tokens of prefill a prefix hit must save to be worth one more request of that slack.
PREFIX_TOKENS_PER_REQUEST = 256
# How long a prefix the router sent a replica counts as cached there without the replica saying so.
SENT_TTL_S = 5.0


def note_sent(sent: dict, hashes: list):
    """Records `hashes` as sent now in `sent` ({block hash: when}, kept in the order of those
    times) and drops what has expired, from the oldest: a route costs what it adds."""
    now = time.monotonic()
    for block_hash in hashes:
        sent.pop(block_hash, None)
        sent[block_hash] = now
    while sent:
        oldest = next(iter(sent))
        if sent[oldest] > now - SENT_TTL_S:
            break
        del sent[oldest]


class Router:
    def __init__(self, num_replicas: int, block_size: int, policy: str = "prefix",
                 load_slack: int = DEFAULT_LOAD_SLACK, seats: int | None = None):
        if policy not in POLICIES:
            raise ValueError(f"dp_routing={policy!r}; expected one of {POLICIES}")
        if num_replicas < 1:
            raise ValueError(f"data_parallel_size={num_replicas!r}; expected >= 1")
        self.policy, self.block_size, self.load_slack = policy, block_size, load_slack
        self.seats = seats  # each replica's max_num_seqs (None: unknown, no seat rule)
        self.cached: list[set] = [set() for _ in range(num_replicas)]  # external block hashes, per replica
        self.sent: list[dict] = [{} for _ in range(num_replicas)]  # {block hash: when sent}, per replica
        self.loads = [0] * num_replicas
        self.up = [True] * num_replicas
        self._turns = itertools.cycle(range(num_replicas))

    @property
    def num_replicas(self) -> int:
        return len(self.cached)

    # ---- what the replicas report
    def on_events(self, rank: int, events):
        cached, sent = self.cached[rank], self.sent[rank]
        for event in events:
            if isinstance(event, BlockStored):
                cached.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                cached.difference_update(event.block_hashes)
                for block_hash in event.block_hashes:
                    sent.pop(block_hash, None)
            elif isinstance(event, AllBlocksCleared):
                cached.clear()
                sent.clear()

    def set_load(self, rank: int, load: int):
        self.loads[rank] = load

    def set_up(self, rank: int, up: bool):
        """A replica down takes no requests; when it comes back its cache is empty (a new process)."""
        self.up[rank] = up
        self.cached[rank].clear()
        self.sent[rank].clear()

    # ---- the choice
    def block_hashes(self, prompt_token_ids: list[int], cache_salt: bytes | None = None) -> list:
        """The request's leading full blocks that a cache hit can cover (never the block of the
        last prompt token, which is always computed), as the engines publish their hashes."""
        size, hashes, parent = self.block_size, [], cache_salt
        for i in range((len(prompt_token_ids) - 1) // size):
            parent = hash_block_tokens(parent, prompt_token_ids[i * size:(i + 1) * size])
            hashes.append(external_block_hash(parent))
        return hashes

    def matched_blocks(self, rank: int, hashes: list) -> int:
        cached, sent, n = self.cached[rank], self.sent[rank], 0
        expired = time.monotonic() - SENT_TTL_S
        for block_hash in hashes:
            if block_hash not in cached and sent.get(block_hash, expired) <= expired:
                break
            n += 1
        return n

    def _note_sent(self, rank: int, hashes: list):
        note_sent(self.sent[rank], hashes)

    def _within_slack(self, best: int, least: int, matched: dict) -> bool:
        """Whether `best` (the longest cached prefix) keeps the request against the least-loaded
        replica: its extra load is within load_slack plus the saved prefill's worth, and it has a
        seat free wherever `least` has one."""
        loads, seats = self.loads, self.seats
        if seats is not None and loads[best] >= seats > loads[least]:
            return False
        saved = (matched[best] - matched[least]) * self.block_size
        return loads[best] <= loads[least] + self.load_slack + saved // PREFIX_TOKENS_PER_REQUEST

    def route(self, prompt_token_ids: list[int], cache_salt: bytes | None = None) -> int:
        """The rank that should serve this prompt."""
        ranks = [r for r in range(self.num_replicas) if self.up[r]]
        if not ranks:
            raise RuntimeError("no data-parallel replica is up")
        if self.policy == "round-robin":
            return next(r for r in self._turns if self.up[r])
        if self.policy == "least-loaded":
            return min(ranks, key=lambda r: (self.loads[r], r))
        least = min(ranks, key=lambda r: (self.loads[r], len(self.cached[r]), r))
        hashes = self.block_hashes(prompt_token_ids, cache_salt)
        matched = {r: self.matched_blocks(r, hashes) for r in ranks}
        best = min(ranks, key=lambda r: (-matched[r], self.loads[r], len(self.cached[r]), r))
        rank = best if matched[best] and self._within_slack(best, least, matched) else least
        self._note_sent(rank, hashes)
        return rank
