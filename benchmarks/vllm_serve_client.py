"""Servers and vLLM's own serving client for ``bench_vs_vllm.py --online``.

- ``Server``: one OpenAI-compatible server process (vLLM's ``api_server`` or ``kvpage serve``)
  on 127.0.0.1, in a process group of its own so that stopping it also stops the engine
  processes it spawned. ``startup_s`` is the wall time from ``Popen`` to the first 200 of
  ``GET /health``.
- ``bench_serve``: vLLM's ``bench serve`` (``vllm.benchmarks.serve``) run in vLLM's venv
  against such a server, with ``--save-result``; returns the figures of its result JSON that
  the comparison table shows. The ``vllm`` console script is not used: that wheel's metadata
  breaks it, so the module's ``add_cli_args`` and ``main`` are called through ``-c``.

The client talks to ``/v1/completions`` (``--backend vllm``: streaming, ``stream_options.
include_usage``, ``ignore_eos``, ``repetition_penalty``) and, for the random and
prefix-repetition datasets, calls ``/tokenize`` once to check that the server's tokenizer
agrees with its own; both servers serve all three.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

#: ``bench serve`` entry point without the console script (see the module docstring).
_BENCH_SERVE = ("import argparse, sys; from vllm.benchmarks.serve import add_cli_args, main; "
                "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (other jobs on this machine may hold fixed ones)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A server command started and stopped by this process; ``start`` waits for ``/health``."""

    name: str
    cmd: list[str]
    env: Optional[dict] = None
    port: int = 0
    startup_s: float = float("nan")
    log_path: str = ""
    _proc: Optional[subprocess.Popen] = field(default=None, repr=False)

    def start(self, timeout_s: float = 900) -> "Server":
        import httpx

        log = tempfile.NamedTemporaryFile("w+", prefix=f"vs_vllm_{self.name.replace(' ', '_')}_", suffix=".log",
                                          delete=False)
        self.log_path = log.name
        begin = time.monotonic()
        self._proc = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        while time.monotonic() - begin < timeout_s:
            if self._proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited early (log {self.log_path}):\n"
                                   f"{Path(self.log_path).read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    self.startup_s = time.monotonic() - begin
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer /health in {timeout_s:.0f} s (log {self.log_path})")

    @property
    def process(self) -> Optional[subprocess.Popen]:
        return self._proc

    def stop(self) -> None:
        """SIGTERM to the server's process group (ours: ``start_new_session``), SIGKILL after 60 s."""
        if self._proc is None or self._proc.poll() is not None:
            return
        pgid = self._proc.pid  # the group leader's id, set by start_new_session
        os.killpg(pgid, signal.SIGTERM)
        try:
            self._proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self._proc.wait(30)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass(frozen=True)
class ClientShape:
    """What ``bench serve`` sends: the dataset and its shape, the load and the sampling."""

    dataset: str  # "random" or "prefix_repetition"
    num_prompts: int = 64
    max_concurrency: int = 16
    input_len: int = 256  # random: prompt tokens
    output_len: int = 64
    prefix_len: int = 256  # prefix_repetition: shared prefix, then a unique suffix
    suffix_len: int = 256
    num_prefixes: int = 4
    num_warmups: int = 4
    seed: int = 0

    def dataset_args(self) -> list[str]:
        if self.dataset == "random":
            return ["--random-input-len", str(self.input_len), "--random-output-len", str(self.output_len),
                    "--random-range-ratio", "0"]
        if self.dataset == "prefix_repetition":
            return ["--prefix-repetition-prefix-len", str(self.prefix_len),
                    "--prefix-repetition-suffix-len", str(self.suffix_len),
                    "--prefix-repetition-num-prefixes", str(self.num_prefixes),
                    "--prefix-repetition-output-len", str(self.output_len)]
        raise ValueError(f"dataset must be random or prefix_repetition; got {self.dataset!r}")


def bench_serve_argv(port: int, model_path: str, shape: ClientShape, result_dir: str, result_file: str,
                     label: str) -> list[str]:
    """``bench serve`` arguments: greedy, ``--ignore-eos`` (every request yields ``output_len``
    tokens on both servers), all requests at once behind ``--max-concurrency``, P50 and P99."""
    return ["--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
            "--model", model_path, "--tokenizer", model_path, "--dataset-name", shape.dataset,
            *shape.dataset_args(), "--num-prompts", str(shape.num_prompts),
            "--max-concurrency", str(shape.max_concurrency), "--request-rate", "inf", "--ignore-eos",
            "--temperature", "0", "--seed", str(shape.seed), "--num-warmups", str(shape.num_warmups),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--label", label, "--save-result", "--result-dir", result_dir, "--result-filename", result_file,
            "--disable-tqdm"]


#: Result-JSON keys of ``bench serve`` -> the names of the comparison table.
SUMMARY_KEYS = {"output_throughput": "output_tok_s", "median_ttft_ms": "ttft_p50_ms", "p99_ttft_ms": "ttft_p99_ms",
                "median_itl_ms": "itl_p50_ms", "p99_itl_ms": "itl_p99_ms", "median_tpot_ms": "tpot_p50_ms",
                "p99_tpot_ms": "tpot_p99_ms", "completed": "completed", "failed": "failed",
                "total_input_tokens": "input_tokens", "total_output_tokens": "output_tokens", "duration": "duration_s"}


def summarise(result: dict) -> dict:
    """The table's figures from one ``bench serve`` result JSON (missing keys become None)."""
    return {ours: result.get(theirs) for theirs, ours in SUMMARY_KEYS.items()}


def bench_serve(python: str, env: Optional[dict], port: int, model_path: str, shape: ClientShape,
                result_dir: str, label: str, timeout_s: float = 3600) -> dict:
    """Run vLLM's client once against the server on ``port``; keep its JSON and stdout in
    ``result_dir`` (``<label>.json``, ``<label>.log``) and return ``summarise`` of it plus
    ``result_json``. Raises ``RuntimeError`` with the client's last output if it fails."""
    Path(result_dir).mkdir(parents=True, exist_ok=True)
    result_file = f"{label}.json"
    argv = bench_serve_argv(port, model_path, shape, result_dir, result_file, label)
    proc = subprocess.run([python, "-c", _BENCH_SERVE, *argv], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    log = Path(result_dir) / f"{label}.log"
    log.write_text(proc.stdout + proc.stderr)
    result_path = Path(result_dir) / result_file
    if proc.returncode != 0 or not result_path.exists():
        raise RuntimeError(f"bench serve failed for {label} (log {log}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return {**summarise(json.loads(result_path.read_text())), "result_json": str(result_path)}
