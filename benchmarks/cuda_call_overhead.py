"""Host cost of one ``kvpage.cuda.paged_attention`` decode call, and where it goes.

A decode step calls the wrapper once per layer, so its host time (validation, array
views, Numba's dispatch of the launches) adds up per step whatever the kernels take.
Prints the mean host time per call of the fast and the reference decode kernels with the
GPU kept busy (so the host is what is measured), then the wrapper's largest costs from
``cProfile``. Needs CuPy and a GPU; prints a skip line otherwise. Run: ``python benchmarks/cuda_call_overhead.py``.
"""
from __future__ import annotations

import cProfile
import io
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CALLS = 300


def main() -> int:
    from bench_cuda import _spin, gpu_reason, make_decode, numba_decode_fn
    from gpu_check_report import host_us_per_call

    reason = gpu_reason()
    if reason:
        print(f"SKIP call overhead: {reason}")
        return 0
    import cupy

    for batch, context in ((32, 4096), (256, 256)):
        inputs = make_decode(batch, context, 32, 8, 128, 16)
        for kernel in ("fast", "reference"):
            fn = numba_decode_fn(inputs, batch, context, decode_kernel=kernel)
            print(f"decode batch {batch}, context {context}, {kernel} kernel: {host_us_per_call(fn, CALLS):.1f} us "
                  "of host time per call")
    fn = numba_decode_fn(make_decode(32, 4096, 32, 8, 128, 16), 32, 4096)  # "auto": the fast kernel
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
