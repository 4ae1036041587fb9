"""Microbenchmarks behind the compiled CPU forward's non-attention fixes, side by side.

    .venv/bin/pytest benchmarks/bench_cpu_forward_ops.py --benchmark-only

- ``test_bench_sibling_linears``: SmolLM2's five input-sharing linears of one layer (q, k,
  v on the attention input; gate, up on the MLP input) as five oneDNN matmuls against the
  two fused ones ``graph_passes.fuse_sibling_linears`` makes, at 1, 16 and 64 rows.
- ``test_bench_greedy_argmax``: the sampler's row max + argmax of 64 rows of SmolLM2's
  49152 logits, torch's ``max(dim=-1)`` against the native pass.

Calls are interleaved (``interleaved_medians``) so drift on a shared machine hits both
sides alike; the medians land in ``extra_info``.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from bench_attention_cpu import interleaved_medians  # noqa: E402
from conftest import bench_threads  # noqa: E402

HIDDEN, HEADS_OUT, KV_OUT, MLP = 576, 576, 192, 1536  # SmolLM2-135M


def _packed(out_features: int, in_features: int, dtype):
    weight = torch.randn(out_features, in_features, dtype=dtype) * 0.05
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def _linear(x, packed):
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_bench_sibling_linears(benchmark, rows, dtype):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN unavailable")
    dt = getattr(torch, dtype)
    if dt == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no oneDNN bf16 on this CPU")
    q, k, v = _packed(HEADS_OUT, HIDDEN, dt), _packed(KV_OUT, HIDDEN, dt), _packed(KV_OUT, HIDDEN, dt)
    gate, up = _packed(MLP, HIDDEN, dt), _packed(MLP, HIDDEN, dt)
    qkv, gate_up = _packed(HEADS_OUT + 2 * KV_OUT, HIDDEN, dt), _packed(2 * MLP, HIDDEN, dt)
    x = torch.randn(rows, HIDDEN, dtype=dt)

    def separate():
        for w in (q, k, v, gate, up):
            _linear(x, w)

    def fused():
        _linear(x, qkv)
        _linear(x, gate_up)

    with torch.inference_mode():
        medians = interleaved_medians({"separate": separate, "fused": fused}, rounds=60)
        benchmark(fused)
    benchmark.extra_info.update(us={k: round(t * 1e6, 1) for k, t in medians.items()},
                                separate_over_fused=round(medians["separate"] / medians["fused"], 2),
                                threads=bench_threads())


def test_bench_greedy_argmax(benchmark):
    from kvpage.kernels import native_cpu
    from kvpage.engine.sampler import _row_max_argmax

    if native_cpu.library() is None:
        pytest.skip("native kernels unavailable here")
    logits = torch.randn(64, 49152)
    medians = interleaved_medians({"torch_max": lambda: logits.max(dim=-1),
                                   "native": lambda: _row_max_argmax(logits)}, rounds=60)
    benchmark(lambda: _row_max_argmax(logits))
    benchmark.extra_info.update(us={k: round(t * 1e6, 1) for k, t in medians.items()},
                                torch_over_native=round(medians["torch_max"] / medians["native"], 2),
                                threads=bench_threads())
