"""One engine's side of ``bench_vs_vllm.py``: runs in that engine's own interpreter.

Usage: ``python vs_vllm_worker.py {kvpage|vllm} WORKLOAD.json RESULT.json``. The workload
file holds the model path, ``dtype``, ``kv_cache_dtype``, the requests as token ids, and the
engine's extra options (``work["kvpage"]``: ``LLM`` keywords such as ``enforce_eager`` and
``onednn_linears``, nothing added here; ``work["vllm"]``: vLLM ``LLM`` keywords). The result
file gets the tokens produced, the seconds the timed ``generate`` call took (after a
warm-up), and ``startup_s``: from this worker's start (before the engine is imported) to
the end of the warm-up, i.e. start-up to first result.

This file imports neither engine at module level, so each interpreter loads only its own;
vLLM needs ``from vllm import LLM`` under ``if __name__ == "__main__"``.
"""
from __future__ import annotations

import json
import sys
import time

_BEGIN = time.perf_counter()


def _run_kvpage(work: dict) -> tuple[int, float, float]:
    from kvpage import LLM, SamplingParams

    llm = LLM(work["model"], dtype=work["dtype"], kv_cache_dtype=work.get("kv_cache_dtype", "auto"),
              max_model_len=work["max_model_len"], **work.get("kvpage", {}))
    warm = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)] * 4
    llm.generate(work["prompts"][:4], warm, use_tqdm=False)
    startup = time.perf_counter() - _BEGIN
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work["max_tokens"]]
    start = time.perf_counter()
    outs = llm.generate(work["prompts"], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs), elapsed, startup


def _run_vllm(work: dict) -> tuple[int, float, float]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=work["model"], dtype=work["dtype"], kv_cache_dtype=work.get("kv_cache_dtype", "auto"),
              max_model_len=work["max_model_len"], seed=0, **work.get("vllm", {}))
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in work["prompts"]]
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    startup = time.perf_counter() - _BEGIN
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work["max_tokens"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs), elapsed, startup


if __name__ == "__main__":
    engine, workload_path, result_path = sys.argv[1:4]
    with open(workload_path) as f:
        work = json.load(f)
    tokens, seconds, startup_s = (_run_vllm if engine == "vllm" else _run_kvpage)(work)
    with open(result_path, "w") as f:
        json.dump({"engine": engine, "dtype": work["dtype"], "kv_cache_dtype": work.get("kv_cache_dtype", "auto"),
                   "tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds, "startup_s": startup_s}, f)
