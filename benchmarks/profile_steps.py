"""Where a step's time goes: ``torch.profiler`` over kvpage's steps on the vs-vLLM workload.

Run::

    python benchmarks/profile_steps.py --phase decode    # decode-only steps of batch >= 48
    python benchmarks/profile_steps.py --phase prefill   # steps that carry prompt tokens

The workload is ``bench_vs_vllm.offline_workload`` (64 requests, SmolLM2-135M-Instruct),
compiled unless ``--eager``. The first ``--steps`` steps of the chosen phase (after a
warm-up) run under the profiler; the table of operators by self CPU time is printed, with
each step's mean wall time. A diagnostic, not a timed test: run it on an idle machine.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=("decode", "prefill"), default="decode")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--min-batch", type=int, default=48, help="decode steps of at least this many sequences")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args(argv)

    import torch

    from bench_vs_vllm import offline_workload
    from kvpage import LLM, SamplingParams
    from kvpage.platform.model_registry import resolve_model_path

    work = offline_workload(str(resolve_model_path(args.model)), args.dtype)
    llm = LLM(work["model"], dtype=args.dtype, max_model_len=work["max_model_len"], onednn_linears=True,
              enforce_eager=args.eager)
    llm.generate(work["prompts"][:4], [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)] * 4,
                 use_tqdm=False)
    runner = llm.runner
    execute = runner.execute
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
    seconds: list[float] = []

    def wanted(metadata) -> bool:
        decode_only = metadata.num_tokens == metadata.num_seqs
        if args.phase == "prefill":
            return not decode_only
        return decode_only and metadata.num_seqs >= args.min_batch

    def profiled(metadata):
        if len(seconds) >= args.steps or not wanted(metadata):
            return execute(metadata)
        if not seconds and not profiler.profiler:
            profiler.__enter__()
        start = time.perf_counter()
        out = execute(metadata)
        seconds.append(time.perf_counter() - start)
        if len(seconds) == args.steps:
            profiler.__exit__(None, None, None)
        return out

    runner.execute = profiled
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work["max_tokens"]]
    llm.generate(work["prompts"], params, use_tqdm=False)
    if len(seconds) < args.steps and seconds:
        profiler.__exit__(None, None, None)
    if not seconds:
        print(f"profile_steps: no {args.phase} step matched")
        return 1
    print(f"{len(seconds)} {args.phase} steps, mean {sum(seconds) / len(seconds) * 1e3:.1f} ms (profiled)")
    print(profiler.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=25))
    return 0


if __name__ == "__main__":
    sys.exit(main())
