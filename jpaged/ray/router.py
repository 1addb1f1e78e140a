"""Which LLMServer replica serves a request: Ray Serve request routers (`request_router_config`).

`PrefixAwareRequestRouter` (build_app's `request_router="prefix"`, the default) routes as
`jpaged serve --data-parallel-size` does (jpaged/data_parallel/router.py, whose rules it runs): to
the replica whose prefix cache holds the longest run of the request's leading blocks, unless
that replica is busier than the least-loaded one by more than its slack (`load_slack`, plus one
request per PREFIX_TOKENS_PER_REQUEST tokens the hit saves). What a replica caches
comes from the replica itself (its `record_routing_stats`: the block hashes its engine's KV events
describe, pulled by Ray Serve every `request_routing_stats_period_s`); between two reports the
router also counts the prefixes it sent each replica since (SENT_TTL_S), which that replica
caches once their prefill runs. `least-loaded` and `round-robin` are the same rules' other policies.

`RayPrefixRouter` (`request_router="ray-prefix"`) is Ray's own PrefixCacheAffinityRouter, which
learns only from where it sent prompts (GenerateRequest.prompt: one character per token), and
`PowerOfTwoRouter` (`"pow-2"`) Ray Serve's default. Every router here also sends a call with
`target_replica=ID` to that replica (the ingress's /metrics and /kv reach each replica so) and
registers itself in this process (`routers`): the ingress reads the replicas' reports from it.
"""

import itertools
import sys
import typing

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
# Ray Serve LLM's router itself: ray.serve.llm's package needs ray[llm] (pyarrow, ...), this module does not.
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from jpaged.data_parallel.router import DEFAULT_LOAD_SLACK, Router, note_sent

if typing.TYPE_CHECKING:
    from jpaged.ray.server import GenerateRequest

_ROUTERS: dict[tuple[str, str], list] = {}  # (app, deployment) -> the routers made in this process


def routers(app_name: str, deployment_name: str) -> list:
    """This process's routers for a deployment, newest last (the ingress reads their replicas)."""
    return _ROUTERS.get((app_name, deployment_name), [])


def _generate_request(pending_request: PendingRequest | None) -> "GenerateRequest | None":
    if pending_request is None:
        return None
    # By its fields: this class may be a by-value copy (see _TargetedCalls), not the ingress's.
    return next((a for a in pending_request.args if hasattr(a, "prompt_token_ids")), None)


class _TargetedCalls:
    """A call with `target_replica=ID` goes to that replica (none other), and the router is
    registered for the ingress to find."""

    # Ray Serve asks a replica for its queue length before sending it a request (unless cached):
    # a jpaged replica queues in its engine, and answers late while its engine thread computes
    # (a loaded CPU: over Ray's default 0.1-1 s, which then backs the request off for seconds).
    queue_len_response_deadline_s = 1.0
    max_queue_len_response_deadline_s = 10.0

    def initialize_state(self, **kwargs):
        deployment = self._deployment_id
        # Through sys.modules: Ray Serve may ship this class by value, with a copy of our globals.
        registry = sys.modules["jpaged.ray.router"]._ROUTERS
        registry.setdefault((deployment.app_name, deployment.name), []).append(self)
        super().initialize_state(**kwargs)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None:
            return await super().choose_replicas(candidate_replicas, pending_request)
        # Back off between tries that find no replica: Ray Serve's loop retries at once otherwise,
        # never yielding its event loop.
        pending_request.routing_context.should_backoff = True
        target = pending_request.kwargs.get("target_replica")
        if target is not None:  # none while that replica is not up: the router retries (the caller times out)
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        return await super().choose_replicas(candidate_replicas, pending_request)

    def on_request_routed(self, pending_request, replica_id, result):
        if _generate_request(pending_request) is not None:
            super().on_request_routed(pending_request, replica_id, result)


class _PrefixRouting(RequestRouter):
    def initialize_state(self, policy: str = "prefix", load_slack: int = DEFAULT_LOAD_SLACK, block_size: int = 16):
        Router(1, block_size, policy, load_slack)  # checks the policy
        self.policy, self.load_slack, self.block_size = policy, load_slack, block_size
        self._cached: dict[str, tuple[dict, set]] = {}  # replica -> (its last report, the hashes in it)
        self._sent: dict[str, dict] = {}  # replica -> {block hash: when sent}, since its last report
        self._in_flight: dict[str, set] = {}  # replica -> internal ids of this router's requests on it
        self._turns = itertools.count()

    def _replica_cache(self, replica: RunningReplica) -> set:
        replica_id, stats = replica.replica_id.unique_id, replica.routing_stats or {}
        last = self._cached.get(replica_id)
        if last is None or last[0] is not stats:  # a new report: it covers what was sent before it
            last = self._cached[replica_id] = (stats, set(stats.get("hashes", ())))
        sent = self._sent.get(replica_id)
        if sent:
            note_sent(sent, [])  # drops the expired
            return last[1] | sent.keys()
        return last[1]

    def _load(self, replica: RunningReplica) -> int:
        replica_id = replica.replica_id.unique_id
        return max(len(self._in_flight.get(replica_id, ())), (replica.routing_stats or {}).get("load", 0))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        request = _generate_request(pending_request)
        if self.policy == "round-robin" or request is None:
            return [[candidate_replicas[next(self._turns) % len(candidate_replicas)]]]
        router = Router(len(candidate_replicas), self.block_size, self.policy, self.load_slack)
        for rank, replica in enumerate(candidate_replicas):
            router.set_load(rank, self._load(replica))
            if self.policy == "prefix":
                router.cached[rank] = self._replica_cache(replica)
        rank = router.route(request.prompt_token_ids, request.cache_salt)
        # The rest, least loaded first, if that one cannot take it now (Ray Serve tries them in order).
        rest = sorted((r for i, r in enumerate(candidate_replicas) if i != rank), key=self._load)
        return [[candidate_replicas[rank]], rest] if rest else [[candidate_replicas[rank]]]

    def on_request_routed(self, pending_request, replica_id, result):
        request = _generate_request(pending_request)
        replica = replica_id.unique_id
        self._in_flight.setdefault(replica, set()).add(pending_request.metadata.internal_request_id)
        if self.policy == "prefix":
            note_sent(self._sent.setdefault(replica, {}),
                      Router(1, self.block_size).block_hashes(request.prompt_token_ids, request.cache_salt))

    def on_request_completed(self, replica_id, internal_request_id: str):
        self._in_flight.get(replica_id.unique_id, set()).discard(internal_request_id)

    def on_replica_actor_died(self, replica_id):
        super().on_replica_actor_died(replica_id)
        for state in (self._cached, self._sent, self._in_flight):
            state.pop(replica_id.unique_id, None)


class PrefixAwareRequestRouter(_TargetedCalls, _PrefixRouting):
    """jpaged's routing rules over the replicas' own prefix caches (request_router_kwargs: policy
    prefix | least-loaded | round-robin, load_slack, block_size)."""

    async def _select_from_candidate_replicas(self, candidates: list[RunningReplica], backoff_index: int):
        """The rank's first replica, without Ray's queue-length probe (a round trip to the replica
        per request): a jpaged replica queues requests in its engine (max_ongoing_requests is
        large) and reports its load in its routing stats. A full one rejects the request, and the
        router tries again."""
        return candidates[0] if candidates else None


class RayPrefixRouter(_TargetedCalls, PrefixCacheAffinityRouter):
    """Ray Serve LLM's PrefixCacheAffinityRouter over jpaged replicas."""


class PowerOfTwoRouter(_TargetedCalls, PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default router (two random replicas, the shorter queue)."""
