"""``kvpage serve --replicas N``: the same server, as a Ray Serve application.

Starts (or joins, with ``--ray-address``) a Ray cluster, starts Serve's HTTP proxy on
``--host``/``--port``, deploys ``kvpage.entrypoints.ray_serve.app`` (N replicas, each loading and warming
the model as ``kvpage serve`` does, behind the prefix-aware router), and serves until Ctrl-C
or SIGTERM, then shuts Serve down. Ray is imported here only, so kvpage runs without it;
without it this command fails with one line naming the extra to install (exit 1).
"""
from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading

from kvpage.core.config import EngineConfig
from kvpage.entrypoints.cli.serve_startup import check_port_free, configure_logging, log


def serve_on_ray(args: argparse.Namespace, model: str, config: EngineConfig) -> int:
    """Deploy, serve until interrupted, shut down; returns the exit status."""
    configure_logging(args.log_level)
    try:
        import ray
        from ray import serve

        from kvpage.entrypoints.ray_serve.app import app_from_args
    except ImportError as exc:
        print(f"kvpage serve: error: --replicas needs Ray Serve: pip install 'kvpage[ray]' ({exc})", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        check_port_free(args.host, args.port)
        ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=args.log_level == "debug")
        serve.start(http_options={"host": args.host, "port": args.port})
        app = app_from_args(args, model, dataclasses.asdict(config))
        log.info("deploying %d replicas of %s (router: %s) ...", args.replicas, model, args.router)
        serve.run(app, name="kvpage", route_prefix="/", blocking=False)
    except Exception as exc:  # noqa: BLE001 - every start-up failure is reported the same way
        if args.log_level == "debug":
            raise
        print(f"kvpage serve: error: {' '.join(str(exc).split())[:2000]}", file=sys.stderr)
        _shutdown()
        return 1
    log.info("serving %s on http://%s:%d with %d replicas", model, args.host, args.port, args.replicas)
    while not stop.wait(0.5):
        pass
    _shutdown()
    return 0


def _shutdown() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()
