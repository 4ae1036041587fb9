"""Host cost of one ``kvpage.cuda.paged_attention`` decode call, and where it goes.

A decode step calls the wrapper once per layer, so its host time (validation, array
views, allocations, Numba's dispatch of two launches) adds up per step whatever the
kernels take. Prints the mean wall time per call with the GPU kept busy (so the host is
what is measured), then the wrapper's largest costs from ``cProfile``. Needs CuPy and a
GPU; prints a skip line otherwise. Run: ``python benchmarks/cuda_call_overhead.py``.
"""
from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CALLS = 300


def main() -> int:
    from bench_cuda import _spin, gpu_reason, make_decode, numba_decode_fn

    reason = gpu_reason()
    if reason:
        print(f"SKIP call overhead: {reason}")
        return 0
    import cupy

    for label, batch, context in (("decode, split-K (2 launches)", 32, 4096), ("decode, one launch", 256, 256)):
        fn = numba_decode_fn(make_decode(batch, context, 32, 8, 128, 16), batch, context)
        fn()
        stream = cupy.cuda.get_current_stream()
        stream.synchronize()
        _spin(stream)  # the GPU sleeps while the host launches: the loop times the host alone
        begin = time.perf_counter()
        for _ in range(CALLS):
            fn()
        host_us = (time.perf_counter() - begin) / CALLS * 1e6
        stream.synchronize()
        print(f"{label} (batch {batch}, context {context}): {host_us:.1f} us of host time per call")
    profile = cProfile.Profile()
    _spin(cupy.cuda.get_current_stream())
    profile.enable()
    for _ in range(CALLS):
        fn()
    profile.disable()
    cupy.cuda.get_current_stream().synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
