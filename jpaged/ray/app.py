"""build_app(args): the Ray Serve application (Ray Serve's application-builder convention, as
Ray Serve LLM's build_openai_app): `OpenAIIngress` bound to `LLMServer`, each deployment's
options from `args` (jpaged/ray/options.py checks them)."""

from ray import serve
from ray.serve.config import RequestRouterConfig

from jpaged.ray.ingress import OpenAIIngress
from jpaged.ray.options import RayOptions, serve_options
from jpaged.ray.router import PowerOfTwoRouter, PrefixAwareRequestRouter, RayPrefixRouter
from jpaged.ray.server import LLMServer


def request_router_config(config, ray: RayOptions) -> RequestRouterConfig:
    period = dict(request_routing_stats_period_s=ray.routing_stats_period_s,
                  request_routing_stats_timeout_s=max(10.0, 4 * ray.routing_stats_period_s))
    if ray.request_router == "ray-prefix":
        return RequestRouterConfig(request_router_class=RayPrefixRouter, **period)
    if ray.request_router == "pow-2":
        return RequestRouterConfig(request_router_class=PowerOfTwoRouter, **period)
    return RequestRouterConfig(request_router_class=PrefixAwareRequestRouter, request_router_kwargs={
        "policy": ray.request_router, "block_size": config.block_size}, **period)


def build_app(args: dict) -> serve.Application:
    """`args`: `jpaged serve`'s options with underscores (model, tensor_parallel_size, ...) and
    Ray Serve's: num_replicas (default 1) or autoscaling_config, ray_actor_options (each
    replica's resources: {"num_gpus": T} for T devices, {"num_cpus": C} on a CPU cluster),
    placement_group_bundles / placement_group_strategy, max_ongoing_requests, request_router
    (prefix | least-loaded | round-robin | ray-prefix | pow-2), routing_stats_period_s,
    health_check_period_s / health_check_timeout_s, ingress_ray_actor_options, name."""
    config, server, ray = serve_options(args)
    if not config.enable_prefix_caching and ray.request_router == "prefix":
        ray.request_router = "least-loaded"  # as --dp-routing prefix without a prefix cache
    replica_options = dict(
        name=ray.name, ray_actor_options=ray.ray_actor_options, max_ongoing_requests=ray.max_ongoing_requests,
        health_check_period_s=ray.health_check_period_s, health_check_timeout_s=ray.health_check_timeout_s,
        request_router_config=request_router_config(config, ray))
    if ray.autoscaling_config is not None:
        replica_options["autoscaling_config"] = ray.autoscaling_config
    else:
        replica_options["num_replicas"] = ray.num_replicas
    if ray.placement_group_bundles is not None:  # the replica's actor takes the first bundle
        replica_options["placement_group_bundles"] = ray.placement_group_bundles
        replica_options["placement_group_strategy"] = ray.placement_group_strategy or "PACK"
    llm_server = serve.deployment(LLMServer).options(**replica_options).bind(
        config, server.served_model_name, server.lora_modules)
    ingress = serve.deployment(OpenAIIngress).options(
        name="OpenAIIngress", ray_actor_options=ray.ingress_ray_actor_options,
        max_ongoing_requests=ray.max_ongoing_requests)
    return ingress.bind(llm_server, config, server)
