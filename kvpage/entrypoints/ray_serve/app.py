"""The Ray Serve application: N ``KVPageReplica``s behind one ``KVPageIngress``.

``build_app(model, engine, server, ...)`` builds it from Python; ``app_from_args`` from
``kvpage serve``'s parsed flags (``kvpage serve --replicas N``, and ``serve run`` through
``kvpage.entrypoints.cli.serve_ray.app_builder``, which parses the flags first).

``router``: ``"prefix"`` (``router.PrefixAwareRequestRouter``) or ``"default"`` (Ray Serve's
power-of-two-choices router, for comparison).
"""
from __future__ import annotations

import argparse
from typing import Any, Optional

from ray import serve
from ray.serve.config import RequestRouterConfig

from kvpage.entrypoints.ray_serve.ingress import KVPageIngress
from kvpage.entrypoints.ray_serve.replica import KVPageReplica

PREFIX_ROUTER = "kvpage.entrypoints.ray_serve.router:PrefixAwareRequestRouter"
DEFAULT_ROUTER = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"
ROUTERS = ("prefix", "default")


def build_app(model: str, engine: dict, server: dict, num_replicas: int = 2, router: str = "prefix",
              router_kwargs: Optional[dict] = None, replica_num_cpus: float = 1.0,
              routing_stats_period_s: float = 0.5, max_ongoing_requests: Optional[int] = None,
              health_check_period_s: float = 2.0) -> Any:
    """A bound Serve application; ``engine``/``server`` as in ``KVPageReplica``.

    ``max_ongoing_requests`` per replica defaults to what its engine can hold (running plus
    waiting requests), so Serve's own per-replica limit does not starve the batch.
    """
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    if max_ongoing_requests is None:
        max_ongoing_requests = int(engine.get("max_num_seqs", 256)) + int(engine.get("max_waiting", 1024))
    router_config = RequestRouterConfig(
        request_router_class=PREFIX_ROUTER if router == "prefix" else DEFAULT_ROUTER,
        request_router_kwargs=dict(router_kwargs or {}) if router == "prefix" else {},
        request_routing_stats_period_s=routing_stats_period_s,
        request_routing_stats_timeout_s=max(5.0, 4 * routing_stats_period_s))
    replicas = serve.deployment(KVPageReplica, name="KVPageReplica").options(
        num_replicas=num_replicas, ray_actor_options={"num_cpus": replica_num_cpus},
        max_ongoing_requests=max_ongoing_requests, request_router_config=router_config,
        health_check_period_s=health_check_period_s, health_check_timeout_s=max(30.0, 5 * health_check_period_s))
    ingress = serve.deployment(KVPageIngress, name="KVPageIngress").options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000)
    return ingress.bind(replicas.bind(model, engine, server),
                        max_body_bytes=int(server.get("max_body_bytes", 1 << 20)))


def app_from_args(args: argparse.Namespace, model: str, engine: dict) -> Any:
    """The application ``kvpage serve``'s parsed flags describe (``--replicas`` of them)."""
    server = {"served_model_names": args.served_model_name or [model], "api_key": args.api_key,
              "max_body_bytes": args.max_body_bytes, "max_tokens_cap": args.max_tokens_cap,
              "max_request_seconds": args.max_request_seconds}
    return build_app(model, engine, server, num_replicas=args.replicas or 1, router=args.router,
                     replica_num_cpus=args.replica_num_cpus)
