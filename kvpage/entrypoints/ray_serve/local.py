"""A single-machine Ray Serve instance for tests, benchmarks and trying things out.

``local_serve(num_cpus, port)`` starts Ray (loopback only, no dashboard) and Serve's HTTP
proxy on ``127.0.0.1:port``, yields the base URL, and shuts both down on exit, whatever
happened inside. ``deploy`` runs an application there and waits, bounded, until it is up.
``replica_actor_names`` lists the live ``KVPageReplica`` actors (to kill one in a test).
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator

import ray
from ray import serve

APP_NAME = "kvpage"


@contextlib.contextmanager
def local_serve(num_cpus: int, port: int) -> Iterator[str]:
    """Yield ``http://127.0.0.1:PORT`` of a fresh local Ray Serve; always shuts it down."""
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


def deploy(app: Any, timeout_s: float = 300.0) -> None:
    """Deploy ``app`` as the application ``kvpage`` at ``/``, replacing any before it; wait until it runs.

    Raises what ``serve.run`` raises (a replica that cannot start), or ``TimeoutError``.
    """
    outcome: list = []

    def run() -> None:
        try:
            serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            outcome.append(exc)

    thread = threading.Thread(target=run, name="kvpage-serve-deploy", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise TimeoutError(f"the application did not start within {timeout_s:g} s")
    if outcome[0] is not None:
        raise outcome[0]


def replica_actor_names() -> list[str]:
    """Names (namespace ``serve``) of the running ``KVPageReplica`` actors."""
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == "serve" and "KVPageReplica" in a["name"])


def wait_for_replicas(count: int, timeout_s: float) -> None:
    """Wait until the app reports ``count`` running replicas of ``KVPageReplica``; raise on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications.get(APP_NAME)
        deployment = status.deployments.get("KVPageReplica") if status else None
        running = deployment.replica_states.get("RUNNING", 0) if deployment else 0
        if running >= count and status.status == "RUNNING":
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{running} of {count} replicas running after {timeout_s:g} s")
        time.sleep(0.5)
