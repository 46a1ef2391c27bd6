"""The Serve application: `serve run deploy/ray/kvserve.yaml`, or
`serve run kvserve.ray_serve.app:build serve_args="--model smollm2-135m --threads 2"`.

args: `serve_args`, `kvserve serve`'s own arguments for every replica (a string or a list); and
`retries`, how often the ingress sends a request again after its replica died before answering.
Deployment options given here are defaults a config file's `deployments:` entries override:
replica counts, autoscaling, CPUs, the router's options.
"""
from __future__ import annotations

from ray import serve
from ray.serve import Application, Deployment
from ray.serve.config import RequestRouterConfig

from kvserve.ray_serve.ingress import IngressSettings, KvserveIngress
from kvserve.ray_serve.replica import KvserveReplica, parse_serve_args

ROUTER_CLASS = "kvserve.ray_serve.router.CacheAwareRouter"
ARGS = ("serve_args", "retries")


def build(args: dict) -> Application:
    unknown = sorted(set(args) - set(ARGS))
    if unknown:
        raise ValueError(f"unknown application args {', '.join(unknown)}: give {' and '.join(ARGS)}")
    serve_args = args.get("serve_args", "")
    parsed = parse_serve_args(serve_args)  # a bad flag fails the deploy now, not in every replica
    retries = int(args.get("retries", IngressSettings.retries))
    if retries < 0:
        raise ValueError(f"retries must be at least 0, got {retries}")
    # Ray's annotations are wrong twice here: serve.deployment(cls) is a Deployment (annotated as the
    # decorator it returns without one), and RequestRouterConfig's **kwargs as `dict[str, Any]` each.
    router = RequestRouterConfig(request_router_class=ROUTER_CLASS, request_routing_stats_period_s=1.0)  # type: ignore[arg-type]
    replica: Deployment = serve.deployment(  # type: ignore[assignment]
        KvserveReplica, name="KvserveReplica",
        # A replica's queue is its engine's: let Serve send it as many as the engine batches.
        max_ongoing_requests=parsed.max_num_seqs,
        request_router_config=router,
    )
    ingress: Deployment = serve.deployment(  # type: ignore[assignment]
        KvserveIngress, name="KvserveIngress", ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=4 * parsed.max_num_seqs)
    settings = IngressSettings(max_body_bytes=int(parsed.max_body_mib * (1 << 20)), retries=retries)
    return ingress.bind(replica.bind(serve_args), settings)
