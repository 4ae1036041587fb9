"""Runs the selected configurations side by side on each scenario and writes the report.

Every configuration of a scenario sees the same workload and the same KV budget in
bytes. Unless ``kv_budget_bytes`` is given, the budget is what ``static_seqs`` sequences
at the longest scenario's ``max_len`` take: configuration A then batches ``static_seqs``
requests (more on scenarios with shorter ``max_len``), while the paged configurations
fit as many as the actual token counts allow. ``multi-turn`` sizes its own pool
(``Workload.kv_budget_tokens``: a quarter of its conversations' history) so that its
working set is several times the pool; it is left out of the shared budget.
``long-context`` also brings its own model (``workload.SCENARIO_MODELS``) and pool, and
compares E with and without hybrid KV groups (G) under that pool's bytes.

A configuration that raises is recorded as ``status="failed"`` with the exception as its
reason and the suite goes on to the next one, so one broken configuration (an
out-of-memory on a GPU, say) does not cost the others' figures; ``failed_rows`` lists them.
With ``out_dir`` set, ``bench.partial.json`` holds the report so far (``"partial": true``)
after every configuration, so a run killed by a time limit keeps what it measured; it is
removed once the full report is written.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from kvpage.tools.bench import machine, model as model_mod, report, workload as wl
from kvpage.tools.bench.metrics import RunResult
from kvpage.tools.bench.runners import CONFIGS, RunContext

PARTIAL_JSON = "bench.partial.json"
DEFAULT_CONFIGS = {"sharegpt": "ABCDE", "burst": "ABCD", "shared-prefix": "ABDE", "multi-turn": "EF",
                   "long-context": "GE"}


@dataclass
class SuiteOptions:
    """Everything a run depends on. Token counts in tokens, ``kv_budget_bytes`` in bytes.

    ``configs`` maps a scenario to the configuration letters run on it (default
    ``DEFAULT_CONFIGS``); ``rate`` overrides the scale's Poisson arrival rate (requests/s).
    ``dtype`` is the model's (``model.DTYPES``; "auto": fp32 on CPU, bf16 on a GPU).
    """

    model: str = "random-30m"
    scenarios: tuple = wl.SCENARIOS
    configs: Optional[dict] = None
    scale: str = "cpu"
    seed: int = 0
    rate: Optional[float] = None
    static_seqs: int = 8
    kv_budget_bytes: Optional[int] = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # of the kvpage configurations; the byte budget stays the model dtype's
    max_num_seqs: int = 64
    token_budget: int = 128
    unchunked_token_budget: int = 2048
    device: str = "cpu"
    dtype: str = "auto"
    progress: bool = True
    out_dir: Optional[Path] = None
    extra: dict = field(default_factory=dict)


def _budget(opts: SuiteOptions, loaded, workloads: list) -> int:
    if opts.kv_budget_bytes is not None:
        return opts.kv_budget_bytes
    sized = [w for w in workloads if w.kv_budget_tokens is None] or workloads
    longest = max(-(-w.max_len // opts.block_size) * opts.block_size for w in sized)
    return opts.static_seqs * longest * loaded.kv_bytes_per_token


def _scenario_budget(opts: SuiteOptions, loaded, workload, shared: int) -> int:
    if opts.kv_budget_bytes is not None or workload.kv_budget_tokens is None:
        return shared
    return workload.kv_budget_tokens * loaded.kv_bytes_per_token


def _run_scenario(opts: SuiteOptions, loaded, workload, budget: int, bar,
                  checkpoint: Callable[[dict], None]) -> dict[str, Any]:
    """The scenario's report entry; ``checkpoint`` gets the entry so far after each configuration."""
    ctx = RunContext(workload, loaded, budget, opts.block_size, opts.max_num_seqs, opts.token_budget,
                     opts.unchunked_token_budget, opts.seed, opts.progress, opts.kv_cache_dtype)
    letters = (opts.configs or DEFAULT_CONFIGS).get(workload.name, "ABCDE")
    results = []
    for letter in letters:
        bar.set_postfix_str(f"{workload.name} {letter}")
        results.append(_run_config(letter, ctx))
        bar.update(1)
        checkpoint(report.scenario_entry(workload, results, budget))
    return report.scenario_entry(workload, results, budget)


def _run_config(letter: str, ctx: RunContext) -> RunResult:
    """Configuration ``letter`` on ``ctx``; an exception becomes a ``failed`` result naming it."""
    label, run = CONFIGS[letter]
    try:
        return run(ctx)
    except Exception as exc:  # noqa: BLE001 - reported in the row; the other configurations still run
        _release_device_memory()
        return RunResult(letter, label, status="failed", reason=f"{type(exc).__name__}: {exc}")


def _release_device_memory() -> None:
    """Hand a failed run's cached GPU blocks back, so that the next configuration has them."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def failed_rows(result: dict[str, Any]) -> list[str]:
    """``"<scenario> <letter>: <reason>"`` for every configuration of ``result`` that raised."""
    return [f"{sc['name']} {row['config']}: {row['reason']}" for sc in result["scenarios"]
            for row in sc["results"] if row["status"] == "failed"]


def run_suite(opts: SuiteOptions) -> dict[str, Any]:
    """Run every scenario; return the report dict (and write JSON/PNG/MD under ``out_dir``)."""
    from tqdm.auto import tqdm

    started = time.time()
    loaded = model_mod.load(opts.model, opts.seed, opts.device, opts.dtype)
    models = {opts.model: loaded}

    def model_for(scenario: str):
        name = wl.SCENARIO_MODELS.get(scenario, opts.model)
        if name not in models:
            models[name] = model_mod.load(name, opts.seed, opts.device, opts.dtype)
        return models[name]

    scale = wl.SCALES[opts.scale]
    workloads = [wl.build(name, scale, model_for(name).vocab_size, opts.seed, opts.rate) for name in opts.scenarios]
    budget = _budget(opts, loaded, workloads)
    result = {"format": "kvpage-bench/1", "machine": machine.describe(), "settings": _settings(opts, loaded, budget),
              "scenarios": [], "elapsed_s": None}

    def checkpoint(entry: dict) -> None:  # the finished scenarios and the one under way
        if opts.out_dir is not None:
            partial = dict(result, scenarios=[*result["scenarios"], entry], elapsed_s=time.time() - started,
                           partial=True)
            Path(opts.out_dir).mkdir(parents=True, exist_ok=True)
            report.write_json(partial, Path(opts.out_dir) / PARTIAL_JSON)

    letters = opts.configs or DEFAULT_CONFIGS
    total = sum(len(letters.get(w.name, "ABCDE")) for w in workloads)
    with tqdm(total=total, desc="kvpage bench", unit="run", disable=not opts.progress) as bar:
        for workload in workloads:
            own = model_for(workload.name)
            scenario_budget = _scenario_budget(opts, own, workload, budget)
            result["scenarios"].append(_run_scenario(opts, own, workload, scenario_budget, bar, checkpoint))
    result["elapsed_s"] = time.time() - started
    if opts.out_dir is not None:
        write_outputs(result, Path(opts.out_dir))
    return result


def _settings(opts: SuiteOptions, loaded, budget: int) -> dict[str, Any]:
    """The options as JSON values, and what the model and budget fixed (parameters, dtype, bytes)."""
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()}
    settings.update(num_params=loaded.num_params, model_dtype=str(next(loaded.model.parameters()).dtype),
                    kv_bytes_per_token=loaded.kv_bytes_per_token, kv_budget_bytes=budget,
                    scale_params=asdict(wl.SCALES[opts.scale]))
    return settings


def write_outputs(result: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Write ``bench.json``, ``bench.md`` and ``bench.png`` into ``out_dir`` (and drop any
    ``bench.partial.json``); return their paths. Without matplotlib (the ``bench`` extra)
    there is no chart: ``chart_renderer`` is None and the rest is written."""
    from kvpage.tools.bench.chart import write_png

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "bench.json", "md": out_dir / "bench.md", "png": out_dir / "bench.png"}
    try:
        result["chart_renderer"] = write_png(result, paths["png"])
    except ImportError:  # a GPU machine may lack the plotting extra; the figures matter more
        result["chart_renderer"] = None
        del paths["png"]
    paths["md"].write_text(markdown_report(result) + "\n", encoding="utf-8")
    report.write_json(result, paths["json"])
    (out_dir / PARTIAL_JSON).unlink(missing_ok=True)  # superseded by the full report
    return paths


def markdown_report(result: dict[str, Any]) -> str:
    m, s = result["machine"], result["settings"]
    gpu = m["gpu"]["name"] if m["gpu"] else "none"
    dtype = s.get("model_dtype", "").removeprefix("torch.")
    head = (f"kvpage bench — model {s['model']} ({_count(s['num_params'])} params{', ' + dtype if dtype else ''}), "
            f"scale {s['scale']}, "
            f"KV budget {s['kv_budget_bytes'] / 2**20:.2f} MiB for every configuration"
            f"{_kv_format_note(s.get('kv_cache_dtype', 'auto'))}; "
            f"{m['cpu_model']} ({m['usable_cpus']} CPUs), torch {m['torch']}, GPU {gpu}")
    return "\n\n".join([head] + [report.markdown(sc) for sc in result["scenarios"]])


def _count(num_params: int) -> str:
    return f"{num_params / 1e9:.2f}B" if num_params >= 1e9 else f"{num_params / 1e6:.1f}M"


def _kv_format_note(kv_cache_dtype: str) -> str:
    """How the kvpage configurations store KV, when not in the model's dtype."""
    return "" if kv_cache_dtype == "auto" else f" (kvpage configurations store KV as {kv_cache_dtype})"
