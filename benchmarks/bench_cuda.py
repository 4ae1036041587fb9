"""GPU microbenchmarks: Numba paged attention vs torch SDPA (contiguous K/V), and decode
bandwidth as a fraction of device peak.

* ``pytest benchmarks/bench_cuda.py --benchmark-only``: sweeps batch, context, heads and
  block size; ``extra_info`` carries ``gbps`` (K/V bytes read / kernel time) and
  ``frac_peak``. Skips without CuPy + a GPU; the SDPA rows skip without CUDA torch.
* The helpers here (inputs, CUDA-event timing, peak bandwidth) also serve
  ``benchmarks/gpu_check_report.py``, the decode comparison of ``benchmarks/gpu_check.sh``.

Kernel time comes from CUDA events around ``REPEATS`` launches queued behind a sleeping
kernel (after a warm-up that also compiles), so the host's per-call overhead is not
counted; ``call_us`` reports that overhead separately (wall time per call).
"""
from __future__ import annotations

import numpy as np

REPEATS = 20
# Peak HBM bandwidth (bytes/s) by device-name fragment; device attributes under-report HBM3e.
PEAK_TABLE = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100": 2.0e12}


def gpu_reason() -> str | None:
    """Why the GPU benchmarks cannot run here (None when they can)."""
    from kvpage.cuda.interop import gpu_unavailable_reason

    return gpu_unavailable_reason()


def device_name() -> str:
    """The current CuPy device's name."""
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def peak_bandwidth() -> tuple[float, str]:
    """(bytes/s, source): the table entry for known parts, else memory clock x bus width x 2."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = device_name()
    for key, value in PEAK_TABLE.items():
        if key in name:
            return value, f"table[{key}] ({name})"
    attr = props["memoryClockRate"] * 1e3 * props["memoryBusWidth"] / 8 * 2
    return attr, f"attributes ({name})"


def make_decode(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                dtype=np.float16, seed: int = 0) -> dict:
    """Device inputs for ``batch`` decode sequences of ``context`` tokens (shuffled blocks)."""
    import cupy

    rng = np.random.default_rng(seed)
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq
    tables = rng.permutation(num_blocks).astype(np.int32).reshape(batch, per_seq)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return dict(q=cupy.asarray(_host_random(rng, (batch, heads, head_dim), dtype)),
                key_cache=cupy.asarray(_host_random(rng, shape, dtype)),
                value_cache=cupy.asarray(_host_random(rng, shape, dtype)),
                query_start_loc=cupy.asarray(np.arange(batch + 1, dtype=np.int32)),
                seq_lens=cupy.asarray(np.full(batch, context, np.int32)),
                block_tables=cupy.asarray(tables))


def _host_random(rng, shape, dtype) -> np.ndarray:
    """Normal-ish values built on the host from a 1M-element pattern: fast for GB-sized caches,
    and device copies are plain memcpys (CuPy's own kernels would need NVRTC at runtime)."""
    pattern = rng.standard_normal(min(1 << 20, int(np.prod(shape)))).astype(dtype)
    return np.resize(pattern, shape)


def kv_bytes(batch: int, context: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of K and V one decode step must read."""
    return 2 * batch * context * kv_heads * head_dim * itemsize


def time_gpu(fn, repeats: int = REPEATS) -> float:
    """Mean seconds of GPU time per call of ``fn`` on the current CuPy stream.

    The timed calls queue behind a kernel that sleeps about ``SPIN_MS``, so the GPU runs
    them back to back however long the host takes to launch each (Python wrapper, Numba
    dispatch): the events then time the kernels alone. ``time_calls`` gives the host side.
    """
    import cupy

    for _ in range(2):
        fn()
    stream = cupy.cuda.get_current_stream()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    _spin(stream)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / 1e3 / repeats


def time_calls(fn, repeats: int = REPEATS) -> float:
    """Mean wall seconds per call, synchronised once at the end: the host's cost per call
    when it exceeds the kernel's, else about the kernel's."""
    import time

    import cupy

    fn()
    cupy.cuda.get_current_stream().synchronize()
    begin = time.perf_counter()
    for _ in range(repeats):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    return (time.perf_counter() - begin) / repeats


#: How long the GPU sleeps before the timed calls (they must all be launched by then).
SPIN_MS = 250


def _spin(stream) -> None:
    """Keep the GPU busy about ``SPIN_MS`` on ``stream`` (a CuPy stream)."""
    from numba import cuda

    from kvpage.cuda.interop import resolve_stream

    global _SPIN_KERNEL
    if _SPIN_KERNEL is None:
        @cuda.jit
        def spin(rounds):
            for _ in range(rounds):
                cuda.nanosleep(1000000)  # at most ~1 ms per call

        _SPIN_KERNEL = spin
    _SPIN_KERNEL[1, 1, resolve_stream(stream, ())](SPIN_MS)


_SPIN_KERNEL = None


def numba_decode_fn(inputs: dict, batch: int, context: int, num_splits=None, **knobs):
    from kvpage.cuda import paged_attention

    scaling = 1.0 / np.sqrt(inputs["q"].shape[-1])
    # Device metadata + explicit stats: no host round trip per call.
    return lambda: paged_attention(**inputs, scaling=scaling, num_splits=num_splits, num_decodes=batch,
                                   max_prefill_query_len=0, max_seq_len=context, **knobs)


def sdpa_decode_fn(inputs: dict, batch: int, context: int):
    """torch SDPA on the same K/V gathered contiguous ``[B, H_kv, S, D]`` (gather not timed)."""
    import torch
    import torch.nn.functional as F

    k = torch.as_tensor(inputs["key_cache"], device="cuda")
    v = torch.as_tensor(inputs["value_cache"], device="cuda")
    tables = torch.as_tensor(inputs["block_tables"], device="cuda").long()
    kc = k[tables].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    vc = v[tables].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    q = torch.as_tensor(inputs["q"], device="cuda").unsqueeze(2)  # [B, H, 1, D]
    return lambda: F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)


# ---- pytest-benchmark sweep -------------------------------------------------------------
try:
    import pytest
except ImportError:  # script mode without pytest
    pytest = None

if pytest is not None:
    _REASON = gpu_reason()
    pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

    SWEEP = [  # (batch, context, heads, kv_heads, block_size)
        (1, 4096, 32, 8, 16), (8, 2048, 32, 8, 16), (32, 2048, 32, 8, 16), (32, 8192, 32, 8, 16),
        (64, 1024, 32, 8, 16), (16, 4096, 64, 8, 16), (16, 4096, 32, 32, 16), (16, 4096, 32, 8, 32),
        (16, 4096, 32, 8, 64),
    ]

    def _bench(benchmark, fn, batch, context, kv_heads, block_size, backend):
        import cupy

        seconds = time_gpu(fn)
        nbytes = kv_bytes(batch, context, kv_heads, 128, 2)
        peak, _ = peak_bandwidth()
        benchmark.extra_info.update(backend=backend, batch=batch, context=context, kv_heads=kv_heads,
                                    block_size=block_size, kernel_us=seconds * 1e6, call_us=time_calls(fn) * 1e6,
                                    gbps=nbytes / seconds / 1e9, frac_peak=nbytes / seconds / peak)

        def call_and_sync():
            fn()
            cupy.cuda.get_current_stream().synchronize()

        benchmark.pedantic(call_and_sync, rounds=10, iterations=1, warmup_rounds=1)

    @pytest.mark.parametrize("batch,context,heads,kv_heads,block_size", SWEEP)
    def test_numba_decode(benchmark, batch, context, heads, kv_heads, block_size):
        inputs = make_decode(batch, context, heads, kv_heads, 128, block_size)
        _bench(benchmark, numba_decode_fn(inputs, batch, context), batch, context, kv_heads, block_size, "numba")

    @pytest.mark.parametrize("batch,context,heads,kv_heads,block_size", SWEEP)
    def test_torch_sdpa_decode(benchmark, batch, context, heads, kv_heads, block_size):
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("torch has no CUDA (CPU build)")
        inputs = make_decode(batch, context, heads, kv_heads, 128, block_size)
        _bench(benchmark, sdpa_decode_fn(inputs, batch, context), batch, context, kv_heads, block_size, "sdpa")

    @pytest.mark.parametrize("num_tokens,context", [(512, 512), (256, 2048)])
    def test_numba_prefill(benchmark, num_tokens, context):
        """One prefill chunk of ``num_tokens`` ending a ``context``-token sequence (prefix hit)."""
        import cupy

        from kvpage.cuda import paged_attention

        base = make_decode(1, context, 32, 8, 128, 16)
        base["q"] = cupy.asarray(_host_random(np.random.default_rng(1), (num_tokens, 32, 128), np.float16))
        base["query_start_loc"] = cupy.asarray(np.array([0, num_tokens], np.int32))
        fn = lambda: paged_attention(**base, scaling=0.088, num_decodes=0, max_prefill_query_len=num_tokens,  # noqa: E731
                                     max_seq_len=context)
        seconds = time_gpu(fn, repeats=5)
        flops = 4 * 32 * 128 * num_tokens * (context - num_tokens / 2)
        benchmark.extra_info.update(backend="numba", num_tokens=num_tokens, context=context,
                                    kernel_us=seconds * 1e6, tflops=flops / seconds / 1e12)
        benchmark.pedantic(lambda: (fn(), cupy.cuda.get_current_stream().synchronize()), rounds=3, iterations=1)

