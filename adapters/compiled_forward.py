"""The model's paged forward under ``torch.compile`` (inductor), on CPU or GPU.

Attention runs as the ``kvpage::paged_attention`` custom op (``paged_attention_op``), so
dynamo traces the whole HF forward into one graph without breaks. Shapes are dynamic in
the token count ``T`` and the sampled-row count ``S``, so one compilation serves every
step; both are padded up to a bucket (``padded_rows``): at least ``MIN_ROWS``, because
dynamo specialises sizes 0 and 1 (a second graph otherwise), and then to a multiple of 8
or 64, because oneDNN builds a matmul primitive (milliseconds) per row count of each
weight shape on first use; the warm-up builds those of the decode buckets. Before
inductor, ``graph_passes`` makes sibling oneDNN linears (q/k/v, gate/up) one matmul and has
the rotary tables computed once per step.
Compilation happens once, at engine start-up (``warm_up``), and inductor's caches live on
disk under ``$KVPAGE_CACHE/inductor`` (``~/.cache/kvpage``), so a restart reuses the
generated code.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, Sequence

import torch

from .graph_passes import kvpage_inductor

log = logging.getLogger("kvpage.compile")

#: Rows below which ``T`` and ``S`` are padded (see the module docstring).
MIN_ROWS = 2
#: After warm-up, evaluate only the guards that tell this process's compiled entries apart
#: (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``). Every later call has the
#: warm-up's shapes and dtypes with other sizes of the dynamic ``T`` and ``S``, under
#: inference mode, and the model is never changed while it is compiled, so no call needs a
#: recompile: the full guard check (about a millisecond a step) only ever confirms the
#: entry. Several engines in one process still get their own entries (their models differ
#: in the differentiating guards). Should global state the guards cover change anyway (a
#: caller's ``torch.set_num_threads``), the call falls back to full guards (``__call__``).
SKIP_GUARDS = os.environ.get("KVPAGE_COMPILE_GUARDS", "skip") != "all"
#: Token counts run once at start-up, so the first real steps never wait for the compiler.
WARM_UP_TOKENS = (16, 128, MIN_ROWS)  # distinct T and S first: equal sizes would share a symbol
#: Row-count buckets: multiples of the first up to the second, then of the third.
SMALL_BUCKET, SMALL_LIMIT, LARGE_BUCKET = 8, 512, 64


def padded_rows(n: int) -> int:
    """The bucket a step of ``n`` token (or sampled) rows is padded to (see the module
    docstring): padded rows cost little, a matmul at 34 rows takes as long as at 40."""
    if n <= MIN_ROWS:
        return MIN_ROWS
    step = SMALL_BUCKET if n <= SMALL_LIMIT else LARGE_BUCKET
    return -(-n // step) * step


def _use_disk_cache() -> None:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # Inductor writes its default (under /tmp) into the environment the first time it asks,
    # so a value equal to that default was not the user's choice.
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        from kvpage.platform.paths import cache_root

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")
    # Every engine in a process compiles the same forward function; each is its own cache entry.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 1024)


class CompiledForward:
    """``forward(input_ids [T], positions [T], rows [S]) -> logits [S, vocab]`` compiled once.

    The caller binds the forward's context (``forward_context``) with
    ``num_real_tokens = T`` around each call; padded rows never touch the KV cache.
    """

    def __init__(self, model: torch.nn.Module, takes_logits_to_keep: bool) -> None:
        _use_disk_cache()
        self.model = model
        self.takes_logits_to_keep = takes_logits_to_keep
        self._compiled: Callable = torch.compile(self._forward, dynamic=True, backend=kvpage_inductor)
        self.warmed_up = False
        self.compile_seconds = 0.0  # set by warm_up
        self.skip_guards = SKIP_GUARDS  # cleared for good if a skipping call would have recompiled

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        kwargs = dict(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False)
        if self.takes_logits_to_keep:
            return self.model(logits_to_keep=rows, **kwargs).logits[0]
        return self.model(**kwargs).logits[0][rows]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        num_rows = rows.shape[0]
        pad_t = padded_rows(input_ids.shape[0]) - input_ids.shape[0]
        if pad_t > 0:
            input_ids = torch.nn.functional.pad(input_ids, (0, pad_t))
            positions = torch.nn.functional.pad(positions, (0, pad_t))
        pad_s = padded_rows(num_rows) - num_rows
        if pad_s > 0:
            rows = torch.nn.functional.pad(rows, (0, pad_s))  # row 0 again; dropped below
        if self.warmed_up and self.skip_guards:
            try:
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    return self._compiled(input_ids, positions, rows)[:num_rows]
            except RuntimeError as exc:
                # Raised before the graph runs, so the call can be made again. Global state
                # the guards cover changed after warm-up (the caller's torch thread count,
                # default dtype, grad mode...): from here on every call checks its guards.
                if "skip_guard_eval_unsafe" not in str(exc):
                    raise
                self.skip_guards = False
                log.warning("a step needed a new compiled entry (torch's global state changed after warm-up: "
                            "%s); compiling it, and checking guards on every step from now on",
                            str(exc).splitlines()[0])
        return self._compiled(input_ids, positions, rows)[:num_rows]

    def warm_up(self, run_probe: Callable[[Callable, int, int], None], max_decode_rows: int = 0,
                other_thread_counts: Sequence[int] = ()) -> float:
        """Compile now: ``run_probe(self, T, S)`` runs one stubbed-attention forward of ``T``
        tokens with logits for the last ``S``. Then one such forward per decode bucket up to
        ``max_decode_rows`` (``T = S``), so those steps find their matmul primitives built.
        Then, for each of ``other_thread_counts``, the same under that many compute threads:
        dynamo guards the graph on torch's thread count, so each count a thread governor may
        switch to needs its own entry (compiled now rather than mid-run). Returns the seconds
        it took."""
        from tqdm.auto import tqdm

        from kvpage.platform.threads import set_compute_threads

        start = time.perf_counter()
        log.info("compiling the model forward with torch.compile (inductor), or loading it from the compile "
                 "cache; a first start takes a while")
        counts = [torch.get_num_threads(), *other_thread_counts]
        shapes = [(c, n) for c in counts for n in WARM_UP_TOKENS]
        # Python floats (the layers' attention scales) stay constants of the graph: traced as
        # symbols, inductor's scalar pass gives up on them after a whole compile and dynamo
        # starts over, which cost SmolLM2 18 s of its start-up here.
        try:
            with torch._dynamo.config.patch(specialize_float=True):
                for count, num_tokens in tqdm(shapes, desc="Compiling the model", unit="shape", leave=False):
                    set_compute_threads(count)
                    run_probe(self, num_tokens, 1)
                    if num_tokens == WARM_UP_TOKENS[-1]:
                        for rows in sorted({padded_rows(n) for n in range(1, max_decode_rows + 1)}):
                            run_probe(self, rows, rows)
        finally:
            set_compute_threads(counts[0])
        self.warmed_up = True  # guards are checked in full until here (see SKIP_GUARDS)
        elapsed = self.compile_seconds = time.perf_counter() - start
        log.info("model forward compiled in %.1f s (cache: %s)", elapsed, os.environ["TORCHINDUCTOR_CACHE_DIR"])
        return elapsed
