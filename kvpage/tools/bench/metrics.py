"""What a runner measures, and the figures derived from it.

Times are seconds from the start of the run (``t=0`` when the first request may be
served). A request's TTFT is its first useful token's time minus its *scheduled* arrival
time, so time spent queued (behind a static batch, or behind a step that ran past the
arrival) counts. ITL is the gap between consecutive useful tokens of one request. Only a
request's own ``max_tokens`` tokens are useful: tokens a static batch generates past them
are waste, not throughput.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np


@dataclass
class RequestTrace:
    """Per-request record: scheduled arrival (s), the time each useful token appeared (s)."""

    request_id: str
    arrival_s: float
    max_tokens: int
    token_times: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)

    def useful_times(self) -> np.ndarray:
        return np.asarray(self.token_times[: self.max_tokens], dtype=np.float64)


@dataclass
class RunResult:
    """One configuration on one workload. ``status`` is "ok" or "skipped" (with ``reason``).

    ``kv_waste_samples`` holds, per model step, the fraction of reserved KV token slots that
    hold no useful token (see each runner for what "reserved" means there).
    ``concurrency_samples`` holds the number of sequences in each step's batch.
    """

    config: str
    label: str
    status: str = "ok"
    reason: str = ""
    wall_s: float = 0.0
    traces: list = field(default_factory=list)
    concurrency_samples: list = field(default_factory=list)
    kv_waste_samples: list = field(default_factory=list)
    num_preemptions: Optional[int] = None
    prefix_queried_tokens: Optional[int] = None
    prefix_hit_tokens: Optional[int] = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def skipped(cls, config: str, label: str, reason: str) -> "RunResult":
        return cls(config, label, status="skipped", reason=reason)


def _pct(values: np.ndarray, q: float) -> Optional[float]:
    return float(np.percentile(values, q)) if values.size else None


def _mean(values: np.ndarray) -> Optional[float]:
    return float(values.mean()) if values.size else None


def summarize(result: RunResult) -> dict[str, Any]:
    """Every headline figure of ``result``: tokens, tokens/s, TTFT and ITL in ms, waste %..."""
    if result.status != "ok":
        return {"config": result.config, "label": result.label, "status": result.status, "reason": result.reason}
    times = [t.useful_times() for t in result.traces]
    useful = int(sum(len(t) for t in times))
    ttft = np.array([t[0] - tr.arrival_s for t, tr in zip(times, result.traces) if len(t)])
    itl = np.concatenate([np.diff(t) for t in times if len(t) > 1] or [np.zeros(0)])
    waste = np.asarray(result.kv_waste_samples, dtype=np.float64)
    conc = np.asarray(result.concurrency_samples, dtype=np.float64)
    hit_rate = None
    if result.prefix_queried_tokens:
        hit_rate = result.prefix_hit_tokens / result.prefix_queried_tokens
    return {
        "config": result.config, "label": result.label, "status": "ok",
        "num_requests": len(result.traces), "useful_tokens": useful, "wall_s": result.wall_s,
        "useful_tokens_per_s": useful / result.wall_s if result.wall_s > 0 else None,
        "max_concurrency": int(conc.max()) if conc.size else None, "mean_concurrency": _mean(conc),
        "kv_waste_pct": None if not waste.size else 100.0 * float(waste.mean()),
        "ttft_mean_ms": _ms(_mean(ttft)), "ttft_p99_ms": _ms(_pct(ttft, 99)),
        "itl_median_ms": _ms(_pct(itl, 50)), "itl_p99_ms": _ms(_pct(itl, 99)),
        "prefix_hit_rate": hit_rate, "num_preemptions": result.num_preemptions, **result.extra,
    }


def itl_ms(result: RunResult) -> np.ndarray:
    """All inter-token latencies of ``result`` in ms (for the distribution chart)."""
    gaps = [np.diff(t.useful_times()) for t in result.traces]
    return 1000.0 * np.concatenate([g for g in gaps if g.size] or [np.zeros(0)])


def _ms(value: Optional[float]) -> Optional[float]:
    return None if value is None else 1000.0 * value
