"""The vs-vLLM workload run several times in one kvpage process: tokens/s, CPU and page faults per pass.

Run::

    python benchmarks/repeat_passes.py --passes 3                     # bf16, compiled, oneDNN linears
    KVPAGE_CPP_WRAPPER=0 python benchmarks/repeat_passes.py --passes 3  # one setting against another

The workload is ``bench_vs_vllm.offline_workload`` (64 requests, SmolLM2-135M-Instruct),
with oneDNN linears, compiled unless ``--eager``, and
the prefix cache off, so every pass computes every prompt again.
Each pass is one ``LLM.generate`` of all 64 requests, timed alone, with the process's user
and system CPU seconds and minor page faults over that pass from ``getrusage``. The first
pass after start-up shows first-use costs (matmul primitives, pages); later ones the steady
state. For A/B comparisons of process-wide settings (``KVPAGE_CPP_WRAPPER``,
``KVPAGE_MALLOC_TUNING``, ``KVPAGE_COMPILE_GUARDS``), alternate the runs, keep
``KVPAGE_THREAD_GOVERNOR=0`` so the thread count stays fixed, and use an idle machine.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args(argv)

    from bench_vs_vllm import offline_workload
    from kvpage import LLM, SamplingParams
    from kvpage.platform.model_registry import resolve_model_path

    start = time.perf_counter()
    work = offline_workload(str(resolve_model_path(args.model)), args.dtype)
    llm = LLM(work["model"], dtype=args.dtype, max_model_len=work["max_model_len"], onednn_linears=True,
              enforce_eager=args.eager, enable_prefix_caching=False)
    llm.generate(work["prompts"][:4], [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)] * 4,
                 use_tqdm=False)
    print(f"engine ready in {time.perf_counter() - start:.1f} s", flush=True)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work["max_tokens"]]
    for number in range(1, args.passes + 1):
        before, begin = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        outs = llm.generate(work["prompts"], params, use_tqdm=False)
        seconds, after = time.perf_counter() - begin, resource.getrusage(resource.RUSAGE_SELF)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"pass {number}: {seconds:.2f} s, {tokens / seconds:.1f} tok/s, "
              f"user {after.ru_utime - before.ru_utime:.2f} s, sys {after.ru_stime - before.ru_stime:.2f} s, "
              f"minor faults {after.ru_minflt - before.ru_minflt}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
