"""What hybrid KV groups cost per step when memory is not the limit: hybrid on against off.

The same 8 prompts of 1,024 tokens and 64 greedy output tokens on ``random-gemma3`` (five
sliding layers to one full), with pools big enough that neither layout preempts, so the
only difference is the per-group bookkeeping (block tables, slot mappings, one backend
``prepare`` per group). The two layouts alternate ``--rounds`` times; only the generate
call is timed, after a warm-up. Reports what it measures; never fails.

    .venv/bin/python benchmarks/bench_hybrid_overhead.py
"""
from __future__ import annotations

import argparse
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import numpy as np

    from kvpage import LLM, SamplingParams
    from kvpage.tools.bench.model import load

    loaded = load("random-gemma3", 0, "cpu")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, loaded.vocab_size, 1024).tolist() for _ in range(8)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    seconds: dict[str, list[float]] = {"hybrid off": [], "hybrid on": []}
    for _ in range(args.rounds):
        for name, disable in (("hybrid off", True), ("hybrid on", False)):
            llm = LLM(loaded.model, max_model_len=2048, kv_cache_memory=256 << 20, max_num_batched_tokens=512,
                      onednn_linears=True, disable_hybrid_kv_cache_manager=disable)
            try:
                llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                seconds[name].append(time.perf_counter() - start)
                assert llm.stats()["num_preemptions"] == 0
            finally:
                llm.restore()
    for name, runs in seconds.items():
        print(f"{name}: " + ", ".join(f"{s:.2f} s" for s in runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
