"""Host time of one decode step of a 32-layer model on a GPU: CUDA-graph replay vs eager.

The engine (``LLM``, default mode: decode steps replay CUDA graphs) runs a Llama-shaped
model with 32 layers (random fp16 weights, narrow so that the GPU time is small; the host
work per step does not depend on the width) over ``--batch`` sequences of ``--context``
prompt tokens. Each decode step's ``runner.execute`` is timed from its call until it returns
with the GPU idle beforehand, so the figure is the host's own time (staging, copies and the
replay's enqueue; eager: every op's and kernel's launch), not the GPU's. The same steps are
then timed with the graphs switched off. Writes ``decode_step_host.json`` into OUT_DIR.

Usage: ``python benchmarks/decode_step_host.py [OUT_DIR] [--batch 32] [--context 512]``.
Prints a skip line without a GPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

LAYERS = 32
STEPS = 40


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=LAYERS, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=32000, max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return LlamaForCausalLM(config).to(torch.float16).eval()


def _timed_steps(llm, steps: int) -> list[float]:
    """Host microseconds of ``steps`` decode steps' ``execute``, each started on an idle GPU."""
    import torch

    runner, times = llm.runner, []
    execute = runner.execute

    def timed(metadata):
        torch.cuda.synchronize()
        start = time.perf_counter()
        logits = execute(metadata)
        times.append((time.perf_counter() - start) * 1e6)
        return logits

    runner.execute = timed
    try:
        for _ in range(steps):
            llm.engine.step()
    finally:
        runner.execute = execute
    return times


def measure(batch: int, context: int) -> dict:
    import torch

    from kvpage import LLM, SamplingParams

    llm = LLM(_model(), max_model_len=context + 4 * STEPS, max_num_seqs=batch, block_size=16,
              max_num_batched_tokens=batch * context, enable_prefix_caching=False)
    try:
        graphs = llm.runner.decode_graphs
        if graphs is None:
            raise RuntimeError("the engine captured no decode graphs (see its warning)")
        params = SamplingParams(max_tokens=3 * STEPS, temperature=0, ignore_eos=True)
        for i in range(batch):
            llm.engine.add_request([3 + (i + j) % 1000 for j in range(context)], params, request_id=str(i))
        llm.engine.step()  # the prefill
        replay_us = _timed_steps(llm, STEPS)
        llm.runner.decode_graphs = None
        eager_us = _timed_steps(llm, STEPS)
        llm.runner.decode_graphs = graphs
        return {"device": torch.cuda.get_device_name(), "layers": LAYERS, "batch": batch, "context": context,
                "graph_sizes": graphs.sizes,
                "host_us_per_decode_step": round(statistics.median(replay_us[2:]), 1),
                "eager_host_us_per_decode_step": round(statistics.median(eager_us[2:]), 1)}
    finally:
        llm.restore()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=".")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("SKIP decode step host time: torch sees no CUDA device")
        return 0
    result = measure(args.batch, args.context)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.out_dir) / "decode_step_host.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"decode step of {result['layers']} layers, batch {result['batch']}, context {result['context']} "
          f"({result['device']}): host {result['host_us_per_decode_step']} us replayed from a CUDA graph, "
          f"{result['eager_host_us_per_decode_step']} us eager")
    return 0


if __name__ == "__main__":
    sys.exit(main())
