"""What every runner gets (``RunContext``) and the run clock."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvpage.tools.bench.metrics import RequestTrace
from kvpage.tools.bench.model import LoadedModel
from kvpage.tools.bench.workload import Workload


@dataclass(frozen=True)
class RunContext:
    """One configuration's inputs. Sizes in tokens except ``kv_budget_bytes``.

    ``token_budget`` is the per-step token budget of the chunked configurations; the
    unchunked one must fit a whole prompt per step and takes ``unchunked_token_budget``.
    """

    workload: Workload
    loaded: LoadedModel
    kv_budget_bytes: int
    block_size: int = 16
    max_num_seqs: int = 64
    token_budget: int = 128
    unchunked_token_budget: int = 2048
    seed: int = 0
    progress: bool = False
    kv_cache_dtype: str = "auto"  # the kvpage configurations' KV format (the budget is in bytes either way)

    @property
    def model(self) -> Any:
        return self.loaded.model

    @property
    def max_len(self) -> int:
        """Tokens a sequence may need: the workload's longest prompt + output, whole blocks."""
        return -(-self.workload.max_len // self.block_size) * self.block_size

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_budget_bytes // (self.block_size * self.loaded.kv_bytes_per_token)

    def new_traces(self) -> dict[str, RequestTrace]:
        return {r.request_id: RequestTrace(r.request_id, r.arrival_s, r.max_tokens) for r in self.workload.requests}

    def progress_bar(self, desc: str):
        from tqdm.auto import tqdm

        return tqdm(total=len(self.workload.requests), desc=desc, unit="req", disable=not self.progress, leave=False)


class Clock:
    """Seconds since construction (``time.perf_counter``); sleeps until a run-relative time."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def relative(self, perf_time: float) -> float:
        """A ``time.perf_counter()`` reading as run-relative seconds."""
        return perf_time - self.origin

    def sleep_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)
