"""The model's paged forward under ``torch.compile`` (inductor), on CPU or GPU.

Attention runs as the ``kvpage::paged_attention`` custom op (``paged_attention_op``), so
dynamo traces the whole HF forward into one graph without breaks. Shapes are dynamic in
the token count ``T`` and the sampled-row count ``S``, so one compilation serves every
step; both are padded up to ``MIN_ROWS`` because dynamo specialises sizes 0 and 1 (a
second graph otherwise). Before inductor, ``graph_passes`` makes sibling oneDNN linears
(q/k/v, gate/up) one matmul and has the rotary tables computed once per step.
Compilation happens once, at engine start-up (``warm_up``), and inductor's caches live on
disk under ``$KVPAGE_CACHE/inductor`` (``~/.cache/kvpage``), so a restart reuses the
generated code.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable

import torch

from .graph_passes import kvpage_inductor

log = logging.getLogger("kvpage.compile")

#: Rows below which ``T`` and ``S`` are padded (see the module docstring).
MIN_ROWS = 2
#: After warm-up, evaluate only the guards that tell this process's compiled entries apart
#: (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``). Every later call has the
#: warm-up's shapes and dtypes with other sizes of the dynamic ``T`` and ``S``, under
#: inference mode, and the model is never changed while it is compiled, so no call needs a
#: recompile: the full guard check (1.2-1.4 ms a step for SmolLM2's 30 layers, measured as
#: "TorchDynamo Cache Lookup" in ``benchmarks/profile_steps.py``) only ever confirms the
#: entry. Several engines in one process still get their own entries (their models differ
#: in the differentiating guards).
SKIP_GUARDS = os.environ.get("KVPAGE_COMPILE_GUARDS", "skip") != "all"
#: Token counts run once at start-up, so the first real steps never wait for the compiler.
WARM_UP_TOKENS = (16, 128, MIN_ROWS)  # distinct T and S first: equal sizes would share a symbol


def _use_disk_cache() -> None:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # Inductor writes its default (under /tmp) into the environment the first time it asks,
    # so a value equal to that default was not the user's choice.
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        from kvpage.model_registry import cache_root

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")
    # Every engine in a process compiles the same forward function; each is its own cache entry.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 1024)


class CompiledForward:
    """``forward(input_ids [T], positions [T], rows [S]) -> logits [S, vocab]`` compiled once.

    The caller binds the step context (``hf_attention.paged_step``) with
    ``num_real_tokens = T`` around each call; padded rows never touch the KV cache.
    """

    def __init__(self, model: torch.nn.Module, takes_logits_to_keep: bool) -> None:
        _use_disk_cache()
        self.model = model
        self.takes_logits_to_keep = takes_logits_to_keep
        self._compiled: Callable = torch.compile(self._forward, dynamic=True, backend=kvpage_inductor)
        self.warmed_up = False

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        kwargs = dict(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False)
        if self.takes_logits_to_keep:
            return self.model(logits_to_keep=rows, **kwargs).logits[0]
        return self.model(**kwargs).logits[0][rows]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        num_rows = rows.shape[0]
        pad_t = MIN_ROWS - input_ids.shape[0]
        if pad_t > 0:
            input_ids = torch.nn.functional.pad(input_ids, (0, pad_t))
            positions = torch.nn.functional.pad(positions, (0, pad_t))
        if num_rows < MIN_ROWS:
            rows = torch.nn.functional.pad(rows, (0, MIN_ROWS - num_rows))  # row 0 again; dropped below
        if not self.warmed_up or not SKIP_GUARDS:
            return self._compiled(input_ids, positions, rows)[:num_rows]
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return self._compiled(input_ids, positions, rows)[:num_rows]

    def warm_up(self, run_probe: Callable[[Callable, int], None]) -> float:
        """Compile now: ``run_probe(self, T)`` runs one stubbed-attention forward of ``T`` tokens.
        Returns the seconds it took."""
        from tqdm.auto import tqdm

        start = time.perf_counter()
        log.info("compiling the model forward with torch.compile (inductor); this takes a while on first use")
        # Python floats (the layers' attention scales) stay constants of the graph: traced as
        # symbols, inductor's scalar pass gives up on them after a whole compile and dynamo
        # starts over, which cost SmolLM2 18 s of its start-up here.
        with torch._dynamo.config.patch(specialize_float=True):
            for num_tokens in tqdm(WARM_UP_TOKENS, desc="Compiling the model", unit="shape", leave=False):
                run_probe(self, num_tokens)
        self.warmed_up = True
        elapsed = time.perf_counter() - start
        log.info("model forward compiled in %.1f s (cache: %s)", elapsed, os.environ["TORCHINDUCTOR_CACHE_DIR"])
        return elapsed
