"""build_app's `args`, checked: `jpaged serve`'s options (underscores for dashes) go through the
same parser and checks as `jpaged serve` (serving/cli.py), so a bad key or value is a ValueError
naming it; Ray Serve's keys (replicas, resources, placement, routing) are checked here. Imports
no Ray: the checks run (and are tested) wherever jpaged is installed."""

import argparse
import dataclasses
import difflib
import json

from jpaged.config import EngineConfig
from jpaged.json_option import parsed
from serving.server_options import ServerOptions

# Ray Serve's keys build_app takes besides `jpaged serve`'s options.
REQUEST_ROUTERS = ("prefix", "least-loaded", "round-robin", "ray-prefix", "pow-2")
RAY_KEYS = ("num_replicas", "autoscaling_config", "ray_actor_options", "placement_group_bundles",
            "placement_group_strategy", "max_ongoing_requests", "request_router", "routing_stats_period_s",
            "health_check_period_s", "health_check_timeout_s", "ingress_ray_actor_options", "name")
PLACEMENT_GROUP_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# `jpaged serve`'s options that mean nothing under Ray Serve (its proxy listens; Ray makes replicas).
REFUSED = {"host": "Ray Serve's proxy listens: `serve run --host` / http_options",
           "port": "Ray Serve's proxy listens: `serve run --port` / http_options",
           "ssl_keyfile": "Ray Serve's proxy serves TLS (http_options)",
           "ssl_certfile": "Ray Serve's proxy serves TLS (http_options)",
           "data_parallel_size": "replicas are Ray Serve's: num_replicas or autoscaling_config",
           "enable_lora_runtime_updates": "adapters loaded at run time would reach one replica: use lora_modules",
           "enable_sleep_mode": "/sleep would reach one replica",
           "process_id": "set for each process of a replica by jpaged.ray",
           "coordinator_address": "set for each replica by jpaged.ray (on the node of its process 0)"}
# Requests one replica may hold (queued in its engine): Ray Serve's default, 5, would leave a
# replica's batch nearly empty.
DEFAULT_MAX_ONGOING_REQUESTS = 1024
DEFAULT_ROUTING_STATS_PERIOD_S = 0.5


@dataclasses.dataclass
class RayOptions:
    """How the replicas are deployed and routed to (Ray Serve's deployment options)."""

    num_replicas: int | str | None = 1
    autoscaling_config: dict | None = None
    ray_actor_options: dict = dataclasses.field(default_factory=lambda: {"num_cpus": 1})
    placement_group_bundles: list[dict] | None = None
    placement_group_strategy: str | None = None
    max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS
    request_router: str = "prefix"
    routing_stats_period_s: float = DEFAULT_ROUTING_STATS_PERIOD_S
    health_check_period_s: float = 2.0
    health_check_timeout_s: float = 30.0
    ingress_ray_actor_options: dict = dataclasses.field(default_factory=lambda: {"num_cpus": 0})
    name: str = "LLMServer"


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


def _serve_parser() -> argparse.ArgumentParser:
    from serving.cli import build_parser

    parser = build_parser(_RaisingParser)
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]


def _number(key: str, value, kind, low):
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}={value!r}; expected a number") from None
    if isinstance(value, bool) or number < low or (kind is int and number != float(value)):
        raise ValueError(f"{key}={value!r}; expected {'an integer' if kind is int else 'a number'} >= {low}")
    return number


def ray_options(args: dict) -> RayOptions:
    options = RayOptions()
    if "num_replicas" in args and "autoscaling_config" in args:
        raise ValueError("num_replicas and autoscaling_config: give one (autoscaling_config sets min/max_replicas)")
    if "num_replicas" in args:
        value = args["num_replicas"]
        options.num_replicas = value if value == "auto" else _number("num_replicas", value, int, 1)
    if "autoscaling_config" in args:
        options.autoscaling_config = parsed(args["autoscaling_config"], "autoscaling_config", (dict,))
        options.num_replicas = None
    for key in ("ray_actor_options", "ingress_ray_actor_options"):
        if key in args:
            setattr(options, key, parsed(args[key], key, (dict,)))
    if "placement_group_bundles" in args:
        bundles = parsed(args["placement_group_bundles"], "placement_group_bundles", (list,))
        if not bundles or not all(isinstance(b, dict) and b for b in bundles):
            raise ValueError(f"placement_group_bundles={bundles!r}; expected a list of resource dicts, "
                             "e.g. [{\"GPU\": 1}, {\"GPU\": 1}]")
        options.placement_group_bundles = bundles
    if "placement_group_strategy" in args:
        if args["placement_group_strategy"] not in PLACEMENT_GROUP_STRATEGIES:
            raise ValueError(f"placement_group_strategy={args['placement_group_strategy']!r}; expected one of "
                             f"{PLACEMENT_GROUP_STRATEGIES}")
        if options.placement_group_bundles is None:
            raise ValueError("placement_group_strategy needs placement_group_bundles")
        options.placement_group_strategy = args["placement_group_strategy"]
    if "max_ongoing_requests" in args:
        options.max_ongoing_requests = _number("max_ongoing_requests", args["max_ongoing_requests"], int, 1)
    if "request_router" in args:
        if args["request_router"] not in REQUEST_ROUTERS:
            raise ValueError(f"request_router={args['request_router']!r}; expected one of {REQUEST_ROUTERS}")
        options.request_router = args["request_router"]
    for key in ("routing_stats_period_s", "health_check_period_s", "health_check_timeout_s"):
        if key in args:
            setattr(options, key, _number(key, args[key], float, 0.01))
    if "name" in args:
        options.name = str(args["name"])
    return options


def _flag_words(key: str, value, action: argparse.Action) -> list[str]:
    flag = "--" + key.replace("_", "-")
    if isinstance(action, argparse.BooleanOptionalAction) or isinstance(action, argparse._StoreTrueAction):
        if isinstance(value, str):  # `serve run ... enable_prefix_caching=true`
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"{key}={value!r}; expected true or false")
            value = value.lower() in ("true", "1")
        if not isinstance(value, bool):
            raise ValueError(f"{key}={value!r}; expected true or false")
        if isinstance(action, argparse._StoreTrueAction):
            return [flag] if value else []
        return [flag] if value else ["--no-" + key.replace("_", "-")]
    if value is None:
        return []
    if action.nargs in ("+", "*"):
        values = value if isinstance(value, (list, tuple)) else [value]
        return [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in values)]
    if isinstance(value, (dict, list)):  # EngineConfig's dict options come as JSON, lists as "2,3"
        value = json.dumps(value) if isinstance(value, dict) else ",".join(map(str, value))
    return [flag + "=" + str(value)]


def serve_options(args: dict) -> tuple[EngineConfig, ServerOptions, RayOptions]:
    """`args` (build_app's) as the engine's, the server's and Ray Serve's options; a ValueError
    naming the key for an unknown key or a bad value."""
    if not isinstance(args, dict):
        raise ValueError(f"build_app args must be a dict, got {type(args).__name__}")
    parser = _serve_parser()
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "log_level")}
    words = []
    for key, value in args.items():
        if key in RAY_KEYS:
            continue
        if key in REFUSED:
            raise ValueError(f"{key}: not an option under Ray Serve ({REFUSED[key]})")
        if key not in actions:
            close = difflib.get_close_matches(key, [*actions, *RAY_KEYS], n=1)
            raise ValueError(f"unknown option {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "") +
                             ": build_app takes `jpaged serve`'s options with underscores, and " + ", ".join(RAY_KEYS))
        words += _flag_words(key, value, actions[key])
    if "model" not in args:
        raise ValueError("model: required (a Hugging Face id, a local directory, or 'tiny')")
    from serving import cli

    config, server = cli.serve_options(parser.parse_args(words))
    from jpaged.pooling.engine import resolve_runner
    if resolve_runner(config) == "pooling":
        raise ValueError(f"model={config.model!r} is a pooling model: jpaged.ray serves generation models")
    ray = ray_options(args)
    if config.num_processes and config.num_processes > 1:
        _place_processes(config.num_processes, ray)
    return config, server, ray


def _place_processes(num_processes: int, ray: RayOptions):
    """A replica over several processes (hosts; jax.distributed) takes one placement group
    bundle per process: by default each like the replica's own resources, on distinct nodes."""
    if ray.placement_group_bundles is None:
        resources = ray.ray_actor_options
        bundle = {"CPU": resources.get("num_cpus", 1) or 1, **({"GPU": resources["num_gpus"]}
                                                               if resources.get("num_gpus") else {})}
        ray.placement_group_bundles = [dict(bundle) for _ in range(num_processes)]
        ray.placement_group_strategy = ray.placement_group_strategy or "STRICT_SPREAD"
    elif len(ray.placement_group_bundles) != num_processes:
        raise ValueError(f"placement_group_bundles: {len(ray.placement_group_bundles)} bundles for num_processes="
                         f"{num_processes}; a replica over several processes needs one bundle per process")
