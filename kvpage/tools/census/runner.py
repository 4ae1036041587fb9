"""Runs the census: every family in its own process, under a time limit, results as one JSON.

The supervisor imports torch and transformers once and forks one child per family
(``fork`` start method: no re-import per family). A child reports the step it is in and
then its result through a pipe. A child that hangs past ``timeout_s`` is killed, and one
that crashes is reported from the step it was in: a failure while building or running the
model under HF is ``skipped`` (HF cannot run it), one inside kvpage is a ``mismatch``
(kvpage must never hang or crash on a model HF runs). One family cannot stop the census.

JSON layout::

    {"families": {name: {"status", "reason", "modes", "model_class", "config", "seconds"}},
     "summary": {status: count}, "versions": {"transformers": ..., "torch": ...}}
"""
from __future__ import annotations

import multiprocessing
import os
import time
from typing import Callable, Iterable, Optional

STATUSES = ("exact", "refused", "mismatch", "skipped")
DEFAULT_TIMEOUT_S = 300.0


def run_census(families: Optional[Iterable[str]] = None, timeout_s: float = DEFAULT_TIMEOUT_S,
               on_result: Callable[[str, dict], None] = lambda name, result: None) -> dict:
    """Classify ``families`` (default: all of transformers' causal-LM registry), one child each."""
    import torch
    import transformers

    from kvpage.tools.census.family import causal_lm_families

    registry = causal_lm_families()
    names = list(registry) if families is None else list(families)
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise ValueError(f"not in transformers' causal-LM registry: {', '.join(unknown)}")
    results = {}
    for name in names:
        results[name] = _run_in_child(name, timeout_s)
        on_result(name, results[name])
    return {"families": results, "summary": summarize(results),
            "versions": {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]}}


def summarize(results: dict) -> dict:
    """``{status: count}`` over ``STATUSES`` (zeros included)."""
    counts = {status: 0 for status in STATUSES}
    for result in results.values():
        counts[result["status"]] = counts.get(result["status"], 0) + 1
    return counts


def _child(name: str, conn) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    from kvpage.tools.census.family import run_family

    try:
        result = run_family(name, report_phase=lambda phase: conn.send(("phase", phase)))
    except BaseException as exc:  # noqa: BLE001 - reported, never raised past the pipe
        conn.send(("crash", f"raised {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"))
    else:
        conn.send(("result", result))
    finally:
        conn.close()


def _run_in_child(name: str, timeout_s: float) -> dict:
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(name, sender), daemon=True)
    start = time.monotonic()
    child.start()
    sender.close()
    phase, outcome = "start", None
    while outcome is None:
        left = timeout_s - (time.monotonic() - start)
        if left <= 0:
            outcome = ("timeout", f"did not finish in {timeout_s:.0f} s")
        elif receiver.poll(min(left, 1.0)):
            try:
                kind, payload = receiver.recv()
            except EOFError:
                outcome = ("crash", None)
                continue
            if kind == "phase":
                phase = payload
            else:
                outcome = (kind, payload)
        elif not child.is_alive():
            outcome = ("crash", None)
    _stop(child)
    kind, payload = outcome
    if kind == "result":
        return payload
    if kind == "crash" and payload is None:
        payload = f"crashed: the process died (exit code {child.exitcode})"
    return _failure(phase, payload, time.monotonic() - start)


def _failure(phase: str, what: str, seconds: float) -> dict:
    """A child that hung or crashed: HF's fault before kvpage ran, kvpage's after."""
    if phase == "kvpage":
        status, reason = "mismatch", f"kvpage {what} (a hang or crash on a model HF runs is a bug)"
    else:
        doing = "building" if phase in ("start", "build") else "running"
        status, reason = "skipped", f"HF {what} while {doing} the tiny model"
    return {"status": status, "reason": reason, "modes": {}, "seconds": round(seconds, 1)}


def _stop(child) -> None:
    child.join(timeout=5)
    if child.is_alive():
        child.kill()
        child.join(timeout=5)
