"""jpaged replicas as a Ray Serve application (`pip install jpaged[ray]`):

    serve run jpaged.ray:build_app model=tiny num_replicas=2

`build_app(args)` (Ray Serve's application-builder convention) returns an application of two
deployments: `OpenAIIngress` (the same OpenAI endpoints as `jpaged serve`, served by the same
handlers) and `LLMServer` (one jpaged engine per replica, on its own devices), routed to by
`PrefixAwareRequestRouter` from the replicas' own prefix caches. Ray is imported only when
build_app runs, so `import jpaged` works without it."""


def build_app(args: dict):
    """A Ray Serve Application from `jpaged serve`'s options (underscores) and Ray Serve's
    (num_replicas or autoscaling_config, ray_actor_options, placement_group_bundles, ...)."""
    from jpaged.ray.app import build_app as build

    return build(args)
