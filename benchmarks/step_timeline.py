"""Where the online time goes: the same workload's engine steps offline and behind ``kvpage serve``.

Run (prints a table and writes ``bench_out/step_timeline.json``)::

    python benchmarks/step_timeline.py --dtype bfloat16            # the default (fast) mode
    python benchmarks/step_timeline.py --dtype bfloat16 --exact

Offline, ``LLM.generate`` runs ``--num-prompts`` random token-id prompts of ``--input-len``
tokens (``--output-len`` tokens each, EOS ignored) with ``max_num_seqs = --concurrency``, in
this process. Online, ``kvpage serve`` (its default flags, plus ``--exact`` when given and
``--server-args``) gets the same prompts from a streaming client at most ``--concurrency``
at a time (``bench_online_itl``'s client), with ``KVPAGE_STEP_TIMELINE`` set so that the
server's engine writes its step records on shutdown. Both sets of records
(``kvpage.engine.step_timeline``) are reduced to means over the decode steps of exactly
``--concurrency`` sequences (the steady state both reach) and over the steps with prompt
tokens: wall, schedule, forward and post-processing ms; the engine thread's CPU ms and its
off-CPU ms (waiting for the interpreter lock, or descheduled); the other threads' CPU ms; and
the gap between steps (the loop's own work: commands, handing out tokens).

The client shares this machine's cores with the server, as a real client would: compare the
two columns of one run, and run on an idle machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

from bench_online_itl import _drive, add_workload_args, random_prompts  # benchmarks/ is on sys.path
from bench_vs_vllm import _start_server

ROWS = ("steps", "mean_seqs", "mean_tokens", "wall_ms", "schedule_ms", "forward_ms", "post_ms", "engine_cpu_ms",
        "engine_off_cpu_ms", "other_threads_cpu_ms", "gap_ms")


def offline(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from kvpage import LLM, SamplingParams
    from kvpage.engine.step_timeline import StepTimeline, summarize

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.concurrency, **({"exact": True} if args.exact else {}))
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    llm.engine.timeline = StepTimeline()
    llm.generate(prompts, params, use_tqdm=False)
    records = list(llm.engine.timeline.records)
    llm.close()
    return {"all": summarize(records), "at_concurrency": summarize(records, args.concurrency)}


def online(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from kvpage.engine.step_timeline import load, summarize

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "steps.jsonl")
        kvpage = Path(sys.executable).with_name("kvpage")
        cmd = [str(kvpage), "serve", args.model, "--port", str(args.port), "--served-model-name", "kvpage",
               "--dtype", args.dtype, *(["--exact"] if args.exact else []), *args.server_args.split()]
        proc = _start_server(cmd, {**os.environ, "KVPAGE_STEP_TIMELINE": path}, args.port)
        try:
            client = asyncio.run(_drive(args.port, prompts, args.output_len, args.concurrency))
        finally:
            proc.terminate()
            proc.wait(timeout=120)
        records = load(path)
    warm = records[2:]  # the server's own warm-up request
    return {"client": client, "all": summarize(warm), "at_concurrency": summarize(warm, args.concurrency)}


def table(result: dict, kind: str) -> str:
    off = result["offline"]["at_concurrency"].get(kind, {})
    on = result["online"]["at_concurrency"].get(kind, {})
    lines = [f"| {kind} steps of {result['workload']['concurrency']} sequences | offline | online |", "|---|---|---|"]
    for name in ROWS:
        cells = [f"{d[name]:.1f}" if name in d else "-" for d in (off, on)]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(parser, port=8124, out="bench_out/step_timeline.json")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--exact", action="store_true", help="both sides in the exact mode (default: the fast mode)")
    args = parser.parse_args(argv)
    prompts = random_prompts(args)
    result = {"workload": {k: getattr(args, k) for k in ("model", "dtype", "exact", "server_args", "num_prompts",
                                                         "input_len", "output_len", "concurrency", "seed")},
              "offline": offline(args, prompts)}
    result["online"] = online(args, prompts)  # after the offline engine is gone: one engine at a time
    print(f"online client: {result['online']['client']}")
    print(table(result, "decode"))
    print(table(result, "mixed"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
