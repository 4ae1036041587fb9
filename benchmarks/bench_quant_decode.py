"""Decode attention over quantized KV caches vs bf16: the native CPU kernel, one layer per call.

Run: ``python benchmarks/bench_quant_decode.py [--batch 32 --context 1024 --json]``.

SmolLM2-135M's attention shape by default (9 query and 3 KV heads of 64, blocks of 16): each
format gets a pool of ``--layers`` layers' worth of scattered blocks, and successive calls
walk the layers in rotation, so K/V come from DRAM as in a served model (one layer's KV
would stay in the caches and flatter whichever format is smaller). Calls of every format are
interleaved round by round, so drift on a shared machine hits them alike; the table gives
the median microseconds per call and each format's speedup over bf16 (bf16 time / its time).
Queries are bf16; the quantized caches are filled by the native quantizing store.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from kvpage.core.kv_formats import KVFormat
from kvpage.kernels import native_cpu
from kvpage.kernels.numba_decode import decode_splits

FORMATS = ("bfloat16", "fp8_e4m3", "fp8_e5m2", "int8", "int4")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32, help="decoding sequences per call")
    p.add_argument("--context", type=int, default=1024, help="context tokens of every sequence")
    p.add_argument("--heads", type=int, default=9, help="query heads")
    p.add_argument("--kv-heads", type=int, default=3, help="KV heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=30, help="layers' caches in rotation")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated cache formats")
    p.add_argument("--rounds", type=int, default=60, help="timed calls per format")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    return p.parse_args(argv)


class Case:
    """One format's pool of ``layers`` layers' K and V blocks and each layer's block tables."""

    def __init__(self, name: str, args: argparse.Namespace, rng: np.random.Generator) -> None:
        self.name, self.fmt = name, KVFormat(name)
        bs, heads, dim = args.block_size, args.kv_heads, args.head_dim
        per_seq = -(-args.context // bs)
        num_blocks = args.layers * args.batch * per_seq
        self.shape = (num_blocks, bs, heads, dim)
        self.tables = rng.permutation(num_blocks).astype(np.int32).reshape(args.layers, args.batch, per_seq)
        self.caches = [self._filled(rng) for _ in range(2)]
        self.kv_bytes = 2 * args.batch * args.context * heads * self.fmt.row_bytes(dim)

    def _filled(self, rng: np.random.Generator) -> torch.Tensor:
        num_blocks, bs, heads, dim = self.shape
        if not self.fmt.quantized:
            return torch.from_numpy(rng.standard_normal(self.shape, np.float32)).to(getattr(torch, self.name))
        cache = torch.zeros(self.fmt.buffer_shape(num_blocks, bs, heads, dim), dtype=torch.uint8)
        lib, chunk = native_cpu.library(), 1 << 16  # slots per store call, to bound the fp32 rows' memory
        for first in range(0, num_blocks * bs, chunk):
            slots = np.arange(first, min(first + chunk, num_blocks * bs), dtype=np.int64)
            rows = rng.standard_normal((len(slots), heads, dim), np.float32)
            native_cpu.store_quantized(lib, self.name, cache.data_ptr(), self.shape, "float32", rows.ctypes.data,
                                       (heads * dim, dim), slots)
        return cache


def run(args: argparse.Namespace) -> dict:
    lib = native_cpu.library()
    if lib is None:
        raise SystemExit("the native CPU kernels are unavailable here")
    rng = np.random.default_rng(0)
    cases = [Case(name, args, rng) for name in args.formats.split(",")]
    q = torch.randn(args.batch, args.heads, args.head_dim).to(torch.bfloat16)
    out = torch.empty_like(q)
    lens = np.full(args.batch, args.context, np.int32)
    splits = decode_splits(args.batch, args.context, args.block_size, args.threads)
    scale = args.head_dim ** -0.5

    def call(case: Case, layer: int) -> None:
        native_cpu.decode_attention(lib, "bfloat16", q.data_ptr(), q.stride()[:2], case.caches[0].data_ptr(),
                                    case.caches[1].data_ptr(), case.shape, args.heads, case.tables[layer], lens,
                                    args.batch, scale, 0, 0.0, None, out.data_ptr(), splits, args.threads,
                                    cache_format=case.name)

    times = {case.name: [] for case in cases}
    for layer in range(args.layers):  # warm-up: one pass over every layer
        for case in cases:
            call(case, layer)
    for r in range(args.rounds):
        for case in cases:
            start = time.perf_counter()
            call(case, r % args.layers)
            times[case.name].append(time.perf_counter() - start)
    median = {name: float(np.median(t)) * 1e6 for name, t in times.items()}
    base = median.get("bfloat16")
    rows = [{"format": c.name, "us_per_call": round(median[c.name], 1), "kv_mb": round(c.kv_bytes / 1e6, 2),
             "gbps": round(c.kv_bytes / median[c.name] / 1e3, 2),
             "speedup_vs_bf16": round(base / median[c.name], 3) if base else None} for c in cases]
    return {"variant": native_cpu.variant(), "threads": args.threads, "splits": splits,
            "shape": {k: getattr(args, k) for k in ("batch", "context", "heads", "kv_heads", "head_dim", "block_size",
                                                     "layers")},
            "results": rows}


def main(argv=None) -> int:
    args = parse_args(argv)
    report = run(args)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"decode attention, {report['variant']}, {report['threads']} threads, {report['splits']} splits: "
          + ", ".join(f"{k} {v}" for k, v in report["shape"].items()))
    print(f"{'format':<10} {'us/call':>9} {'KV MB':>7} {'GB/s':>6} {'vs bf16':>8}")
    for row in report["results"]:
        ratio = "" if row["speedup_vs_bf16"] is None else f"{row['speedup_vs_bf16']:.2f}x"
        print(f"{row['format']:<10} {row['us_per_call']:>9.1f} {row['kv_mb']:>7.2f} {row['gbps']:>6.2f} {ratio:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
