"""Simulator cases for the quantized KV formats of the Numba CUDA kernels (``test_cuda_quant.py``).

Run as ``NUMBA_ENABLE_CUDASIM=1 python -P tests/cuda_quant_cases.py [names]`` (the variable
must be set before ``numba.cuda`` is first imported); prints one JSON line per case.
Importing this file (to list ``CASES``) imports neither numba nor the kernels.

* Store: ``kvpage.cuda.store_kv(..., cache_format)`` writes exactly the bytes of
  ``kv_quant.quantize_rows`` (rows widened to float32) into the slots' rows, and nothing
  else, for values built to hit every rounding path (ties, fp16 and fp8 subnormals, zero and
  negative-zero rows, constant groups, tiny and huge rows, float16 inputs).
* Attention: decode and prefill over a quantized cache against the numpy oracle, which is
  ``paged_attention_reference`` over the cache dequantized by ``kv_quant.dequantize_rows``.
  The kernels decode each element to the same float32 value ``dequantize_rows`` gives
  (int4's ``code * scale + min`` may fuse into one FMA on a GPU, not in the simulator), then
  run the unquantized path's float32 arithmetic; so the tolerance is the unquantized cases'
  (``cuda_sim_cases.TOL``: summation order only, and float16 rounding of a float16 output).
* Fast decode kernel (int8, fp8; ``decode_kernel="fast"``, float16 q): its row reader turns
  every code byte and scale into exactly ``dequantize_rows``' value (``check_code_values``:
  the reader's loads, byte permutes and bit patterns run as the PTX instructions define them),
  and whole decodes (tiling, split-K with the folded merge, windows, softcap, sinks, scales
  folded into scores and weights) match the oracle. The scale multiplies a dot product
  instead of each element, one more fp32 rounding per score and weight: within the same
  tolerance, which is dominated by the float16 output.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import numpy as np

FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8", "int4")
#: The formats the fast decode kernel reads.
FAST_FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2", "int4")
TOL = {np.float32: dict(rtol=1e-5, atol=1e-5), np.float16: dict(rtol=2e-3, atol=1e-3)}
THREADS = 16


def _cache_format(name: str, block_size: int):
    from kvpage.core.kv_formats import CacheFormat, KVFormat

    return CacheFormat(KVFormat(name), block_size)


def edge_rows(head_dim: int, rng: np.random.Generator) -> np.ndarray:
    """float32 ``[rows, head_dim]`` rows that hit every path of the encoders."""
    d = np.arange(head_dim, dtype=np.float32)
    rows = [rng.standard_normal(head_dim) * 10.0 ** rng.uniform(-6, 4) for _ in range(6)]
    rows += [np.zeros(head_dim), -np.zeros(head_dim), np.full(head_dim, 0.7),  # zero / constant rows
             np.where(d % 2 == 0, -0.0, 3.0),  # -0.0 beside positives
             np.resize([0.0, -0.0, 1.0, -0.0, 2.0, 0.0, 0.5, -0.0], head_dim),  # int4: a zero min of both signs
             np.resize([-0.0, 0.0, 0.0, -0.0], head_dim),
             np.resize([63.5, 0.25, 0.75, 1.25, -2.5, -0.25], head_dim),  # int8: s = 0.5, x / s on ties
             np.resize([0.0, 15.0, 0.5, 1.5, 2.5, 13.5, 14.5], head_dim),  # int4: s = 1, min 0, ties
             # fp8: amax 448 (e = 0), ties between E4M3 normals and subnormals (and E5M2's)
             np.resize([448.0, 1.0625, 1.1875, 3 * 2.0 ** -10, 2.0 ** -10, -5 * 2.0 ** -10, 2.0 ** -17], head_dim),
             rng.standard_normal(head_dim) * 1e-30,  # fp8 exponent clamp, fp16 scales underflow
             rng.standard_normal(head_dim) * 2e-7,  # fp16 subnormal scales
             rng.standard_normal(head_dim) * 3e4]  # int4 min beyond fp16's range for some
    return np.stack(rows).astype(np.float32)


def _host(x):
    """``x`` as numpy (a CuPy array is copied back; the simulator's arrays are numpy)."""
    return x if isinstance(x, np.ndarray) else x.get()


def check_store(name: str, head_dim: int, dtype=np.float32, block_size: int = 4, heads: int = 2,
                to_device=lambda x: x, extra_rows: int = 0) -> str:
    """Store every edge row and ``extra_rows`` random ones (as K, shuffled as V) at scattered
    slots; compare all bytes. ``to_device``: identity in the simulator, ``cupy.asarray`` on a GPU."""
    from kvpage.cuda import store_kv
    from kvpage.kernels import kv_quant

    cf = _cache_format(name, block_size)
    fmt = cf.kv_format
    rng = np.random.default_rng(head_dim)
    rows = np.concatenate([edge_rows(head_dim, rng), rng.standard_normal((extra_rows, head_dim)) * 4])
    num_tokens = -(-rows.shape[0] // heads) + 1
    flat = np.resize(rows, (num_tokens * heads, head_dim))
    if dtype == np.float16:
        flat = np.clip(flat, -65504, 65504)  # finite float16 rows
    k = flat.reshape(num_tokens, heads, head_dim).astype(dtype)
    v = rng.permutation(flat).reshape(num_tokens, heads, head_dim).astype(dtype)
    num_blocks = -(-num_tokens // block_size) + 2
    slots = rng.permutation(num_blocks * block_size)[:num_tokens].astype(np.int64)
    slots[1] = -1  # padding: skipped
    fill = rng.integers(0, 256, fmt.buffer_shape(num_blocks, block_size, heads, head_dim), dtype=np.uint8)
    kc, vc = fill.copy(), fill[::-1].copy()
    want_k, want_v = kc.copy(), vc.copy()
    keep = slots >= 0
    for want, x in ((want_k, k), (want_v, v)):
        codes, scales = kv_quant.block_views(want, fmt, block_size, heads, head_dim)
        rc, rs = kv_quant.quantize_rows(x[keep].astype(np.float32), fmt)
        blk, off = slots[keep] // block_size, slots[keep] % block_size
        codes[blk, off], scales[blk, off] = rc, rs
    kc, vc = to_device(kc), to_device(vc)
    store_kv(kc, vc, to_device(k), to_device(v), slots, cf)
    for got, want in ((_host(kc), want_k), (_host(vc), want_v)):
        bad = np.argwhere(got != want)
        assert bad.size == 0, f"{len(bad)} bytes differ, first at {bad[:4].tolist()}"
    return f"exact ({keep.sum() * heads * 2} rows)"


def _dequantized(cache: np.ndarray, cf, heads: int, head_dim: int) -> np.ndarray:
    from kvpage.kernels import kv_quant

    codes, scales = kv_quant.block_views(cache, cf.kv_format, cf.block_size, heads, head_dim)
    return kv_quant.dequantize_rows(codes, scales, cf.kv_format)


def _quantized_cache(values: np.ndarray, cf) -> np.ndarray:
    """A uint8 buffer holding ``values`` ``[N, B, H, D]`` quantized (numpy reference)."""
    from kvpage.kernels import kv_quant

    num_blocks, block_size, heads, head_dim = values.shape
    buf = np.empty(cf.kv_format.buffer_shape(num_blocks, block_size, heads, head_dim), np.uint8)
    codes, scales = kv_quant.block_views(buf, cf.kv_format, block_size, heads, head_dim)
    codes[...], scales[...] = kv_quant.quantize_rows(values, cf.kv_format)
    return buf


def check_attention(name: str, shapes: list, num_heads: int, num_kv_heads: int, head_dim: int, dtype=np.float32,
                    block_size: int = 4, seed: int = 0, sliding_window=None, softcap=None, with_sinks=False,
                    to_device=lambda x: x, tol=None, spread: float = 0.0, **kernel_kwargs) -> str:
    """``paged_attention`` over a quantized cache vs the oracle on the dequantized cache.
    ``shapes``: per sequence (query length, context length); ``to_device`` as ``check_store``;
    ``tol``: ``assert_allclose``'s (default ``TOL[dtype]``); ``spread``: each V row is scaled
    by ``10**u``, ``u`` uniform in ``[-spread, spread]``, each K row by a quarter of that range
    (row scales far apart, scores not so far that one key takes all the weight)."""
    from kvpage.attention.reference import paged_attention_reference
    from kvpage.cuda import paged_attention

    cf = _cache_format(name, block_size)
    rng = np.random.default_rng(seed)
    q_lens = np.array([s[0] for s in shapes], np.int32)
    seq_lens = np.array([s[1] for s in shapes], np.int32)
    per_seq = -(-seq_lens // block_size)
    num_blocks = int(per_seq.sum()) + 2
    perm = rng.permutation(num_blocks)
    tables = np.zeros((len(shapes), int(per_seq.max())), np.int32)
    starts = np.concatenate([[0], np.cumsum(per_seq)])
    for i, n in enumerate(per_seq.tolist()):
        tables[i, :n] = perm[starts[i]:starts[i] + n]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    row_scale = 10.0 ** (rng.uniform(-spread, spread, (2, *shape[:3], 1)) * np.array([0.25, 1.0])[:, None, None, None,
                                                                                                      None])
    kc = _quantized_cache((rng.standard_normal(shape) * row_scale[0]).astype(np.float32), cf)
    vc = _quantized_cache((rng.standard_normal(shape) * 2 * row_scale[1]).astype(np.float32), cf)
    meta = dict(query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32), seq_lens=seq_lens,
                block_tables=tables)
    q = rng.standard_normal((int(q_lens.sum()), num_heads, head_dim)).astype(dtype)
    sinks = rng.standard_normal(num_heads).astype(np.float32) * 2 if with_sinks else None
    flags = dict(scaling=0.35, sliding_window=sliding_window, softcap=softcap, sinks=sinks)
    out = _host(paged_attention(to_device(q), to_device(kc), to_device(vc), **meta, **flags, cache_format=cf,
                                **kernel_kwargs))
    ref = paged_attention_reference(q, _dequantized(kc, cf, num_kv_heads, head_dim),
                                    _dequantized(vc, cf, num_kv_heads, head_dim), **meta, **flags)
    assert out.dtype == q.dtype and out.shape == ref.shape, (out.dtype, out.shape, ref.shape)
    np.testing.assert_allclose(out.astype(np.float32), ref.astype(np.float32), **(tol or TOL[dtype]))
    return f"max_abs_err={float(np.abs(out.astype(np.float32) - ref.astype(np.float32)).max()):.3g}"


def check_step_end_to_end(name: str) -> str:
    """store_kv (the kernel) then paged_attention over a mixed batch of decodes and a chunk:
    the store matches the numpy writer byte for byte, attention matches the oracle."""
    from kvpage.attention.reference import paged_attention_reference
    from kvpage.cuda import paged_attention, store_kv
    from kvpage.kernels import kv_quant

    block_size, heads, num_heads, head_dim, num_blocks = 4, 2, 4, 16, 12
    cf = _cache_format(name, block_size)
    rng = np.random.default_rng(5)
    kc = _quantized_cache(rng.standard_normal((num_blocks, block_size, heads, head_dim)).astype(np.float32), cf)
    vc = kc[::-1].copy()
    q_lens, seq_lens = np.array([1, 1, 3]), np.array([6, 9, 7], np.int32)
    tables = rng.permutation(num_blocks)[:9].reshape(3, 3).astype(np.int32)
    positions = np.concatenate([np.arange(n - q, n) for q, n in zip(q_lens, seq_lens)])
    seq_of = np.repeat(np.arange(3), q_lens)
    slots = (tables[seq_of, positions // block_size] * block_size + positions % block_size).astype(np.int64)
    k = rng.standard_normal((len(slots), heads, head_dim)).astype(np.float16)
    v = rng.standard_normal((len(slots), heads, head_dim)).astype(np.float16)
    want_k, want_v = kc.copy(), vc.copy()
    for want, x in ((want_k, k), (want_v, v)):
        codes, scales = kv_quant.block_views(want, cf.kv_format, block_size, heads, head_dim)
        codes[slots // block_size, slots % block_size], scales[slots // block_size, slots % block_size] = \
            kv_quant.quantize_rows(x.astype(np.float32), cf.kv_format)
    store_kv(kc, vc, k, v, slots, cf, threads_per_block=THREADS)
    assert np.array_equal(kc, want_k) and np.array_equal(vc, want_v), "store bytes differ"
    q = rng.standard_normal((len(slots), num_heads, head_dim)).astype(np.float16)
    meta = (np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32), seq_lens, tables)
    out = paged_attention(q, kc, vc, *meta, 0.3, cache_format=cf, num_splits=2, kv_tile=2, threads_per_block=THREADS)
    ref = paged_attention_reference(q, _dequantized(kc, cf, heads, head_dim), _dequantized(vc, cf, heads, head_dim),
                                    *meta, 0.3)
    np.testing.assert_allclose(out.astype(np.float32), ref.astype(np.float32), **TOL[np.float16])
    return "store exact, attention within fp16 tolerance"


def check_errors() -> str:
    """One-line ValueErrors: the fast kernel, a wrong dtype, a buffer of the wrong width."""
    from kvpage.cuda import paged_attention, store_kv

    cf = _cache_format("int8", 4)
    q = np.zeros((1, 2, 16), np.float32)
    meta = (np.array([0, 1], np.int32), np.array([3], np.int32), np.zeros((1, 1), np.int32))
    buf = np.zeros(cf.kv_format.buffer_shape(2, 4, 2, 16), np.uint8)
    failures = []
    for call, want in (
            (lambda: paged_attention(q, buf, buf, *meta, 1.0, cache_format=cf, decode_kernel="fast"),
             "q must be float16 for the fast kernel over int8 caches"),
            (lambda: paged_attention(q.astype(np.float16), buf, buf, *meta, 1.0, cache_format=cf, decode_kernel="fast"),
             "no fast variant for head_dim 16"),
            (lambda: paged_attention(q, buf.astype(np.int8), buf, *meta, 1.0, cache_format=cf), "uint8"),
            (lambda: paged_attention(q, buf[:, :-1], buf[:, :-1], *meta, 1.0, cache_format=cf), "does not hold"),
            (lambda: store_kv(buf, buf, q.astype(np.float64), q, np.zeros(1, np.int64), cf), "float16 or float32"),
            (lambda: store_kv(buf, buf, q, q, np.array([8]), cf), "slot_mapping")):
        try:
            call()
            failures.append(f"no error for {want!r}")
        except ValueError as exc:
            if want not in str(exc) or "\n" in str(exc):
                failures.append(f"{want!r} not in {exc}")
    assert not failures, failures
    return "ok"


def _code_block(name: str, head_dim: int, block_size: int) -> tuple:
    """One block of one head, ``(buffer, codes, scales)``: every code byte in every row position
    (rows rotate a 0..255 ramp), with scales at the format's extremes."""
    from kvpage.core.kv_formats import KVFormat

    fmt = KVFormat(name)
    codes = ((np.arange(fmt.code_bytes(head_dim))[None, :] + 97 * np.arange(block_size)[:, None]) % 256)
    codes = codes.astype(np.uint8)
    if name == "int4":  # (scale, min) fp16 pairs per group: subnormal, tiny, 1, large, zero, negative
        pool = np.array([0x0001, 0x0400, 0x3C00, 0x7BFF, 0x0000, 0xBC00, 0x2E66, 0xC500, 0x1234, 0x5A00], np.uint16)
        count = block_size * fmt.scale_bytes(head_dim) // 2
        scales = pool[(np.arange(count) * 7) % len(pool)].view(np.uint8).reshape(block_size, -1)
    elif name == "int8":  # fp16 scales: subnormal, smallest normal, 1, largest, zero, ordinary
        bits = np.resize(np.array([0x0001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0x0000, 0x2E66, 0x1234], np.uint16),
                         block_size)
        scales = bits.view(np.uint8).reshape(block_size, 2)
    else:  # signed exponents, down to a subnormal 2**-127 and up to the largest finite E5M2 row
        scales = np.resize(np.array([-127, -126, -9, 0, 7, 60, 112, -3], np.int8), block_size).view(np.uint8)
        scales = scales.reshape(block_size, 1)
    buf = np.concatenate([codes.reshape(1, -1), scales.reshape(1, -1)], axis=1)
    assert buf.shape == fmt.buffer_shape(1, block_size, 1, head_dim)
    return buf, codes, scales


def check_code_values(name: str, head_dim: int = 64, block_size: int = 8) -> str:
    """The fast kernel's row reader (``fast_rows``: 8-byte code loads, the scale load, byte
    permutes, bit patterns) in a simulator kernel, one lane per 8 elements as in the decode
    kernel: every code byte times every scale must be ``dequantize_rows``' value, bit for bit
    (each is exact up to one rounding of the product, the same one ``np.ldexp``/the multiply
    makes; int4's ``code * scale + min`` rounds twice, as the reference). Codes the encoder
    never writes (fp8 NaN/inf) are skipped."""
    from numba import cuda as numba_cuda, float32

    from kvpage.core.kv_formats import KVFormat
    from kvpage.cuda.fast_rows import row_reader

    globals()["cuda"] = numba_cuda  # the simulator swaps a kernel's *global* ``cuda`` for its own
    from kvpage.kernels import kv_quant

    buf, codes, scales = _code_block(name, head_dim, block_size)
    rd = row_reader(name, head_dim, simulate=True)
    lanes, adj = head_dim // 8, rd.k_adj

    @cuda.jit
    def kernel(cache, out, sizes):
        t = cuda.threadIdx.x
        row, part = t // lanes, t % lanes
        f8 = cuda.local.array(8, float32)
        bs = rd.block_size(cache, 1)
        w0, w1, w2, w3, sraw = rd.load(cache, 0, row, 0, 1, bs, part)
        rd.unpack8(w0, w1, w2, w3, f8)
        s = rd.scale(sraw)
        for e in range(8):
            out[row, part * 8 + e] = (f8[e] * float32(adj)) * s
        sizes[t] = bs

    out = np.full((block_size, head_dim), np.nan, np.float32)
    sizes = np.zeros(block_size * lanes, np.int32)
    kernel[1, block_size * lanes](buf, out, sizes)
    want = kv_quant.dequantize_rows(codes, scales, KVFormat(name))
    assert (sizes == block_size).all(), sizes
    ok = np.isfinite(want)
    assert ok.sum() >= block_size * head_dim * 0.9
    bad = np.argwhere(out[ok].view(np.uint32) != want[ok].view(np.uint32))
    assert bad.size == 0, f"{len(bad)} values differ, e.g. {out[ok][bad[:3, 0]]} vs {want[ok][bad[:3, 0]]}"
    return f"exact ({int(ok.sum())} values, {len(np.unique(codes))} code bytes)"


EDGE_LENS = [1, 3, 4, 5, 14]
DECODES = [(1, n) for n in EDGE_LENS]
PREFILLS = [(2, 6), (5, 9), (3, 3), (1, 4)]
SIM = dict(threads_per_block=THREADS)

CASES: dict[str, Callable[[], str]] = {}
for _fmt in FORMATS:
    CASES[f"store_{_fmt}_d16"] = lambda f=_fmt: check_store(f, 16)
    CASES[f"store_{_fmt}_d96_fp16"] = lambda f=_fmt: check_store(f, 96, np.float16, heads=1)
    CASES[f"decode_{_fmt}_gqa_splitk"] = lambda f=_fmt: check_attention(f, DECODES, 4, 2, 16, num_splits=2, kv_tile=4,
                                                                         **SIM)
    CASES[f"prefill_{_fmt}_gqa"] = lambda f=_fmt: check_attention(f, PREFILLS, 4, 2, 16, seed=1, kv_tile=4, **SIM)
    CASES[f"step_{_fmt}_end_to_end"] = lambda f=_fmt: check_step_end_to_end(f)
CASES.update({
    "store_int4_d128_two_groups": lambda: check_store("int4", 128, heads=1, block_size=2),
    "store_int8_d8_block1": lambda: check_store("int8", 8, block_size=1, heads=3),
    "decode_int4_d64_features_fp16": lambda: check_attention("int4", [(1, 5), (1, 11)], 2, 1, 64, np.float16, seed=2,
                                                             sliding_window=6, softcap=2.0, with_sinks=True,
                                                             num_splits=2, kv_tile=4, **SIM),
    "prefill_fp8_e4m3_window_sinks_fp16": lambda: check_attention("fp8_e4m3", [(5, 9), (3, 7)], 4, 2, 16, np.float16,
                                                                   seed=3, sliding_window=3, softcap=2.0,
                                                                   with_sinks=True, kv_tile=2, **SIM),
    "mixed_int8_block_size_3": lambda: check_attention("int8", [(1, 5), (1, 7), (4, 8)], 4, 2, 16, block_size=3,
                                                       seed=4, num_splits=3, kv_tile=2, **SIM),
    "errors": check_errors,
})
FAST = dict(decode_kernel="fast", **SIM)  # the prefill rows (if any) run the reference kernel
for _fmt in FAST_FORMATS:
    CASES[f"fast_codes_{_fmt}"] = lambda f=_fmt: check_code_values(f)
CASES.update({
    # Block sizes keep block_bytes a multiple of 8 (the 8-byte code loads). A block covers 32
    # (head_dim 64) or 16 (128) keys per round of its 4 warps (8 steps at group 1, 4 else).
    "fast_int8_g4_d64_splitk": lambda: check_attention("int8", [(1, 70), (1, 9)], 8, 2, 64, np.float16, seed=6,
                                                       num_splits=2, **FAST),
    "fast_fp8_e4m3_g1_d128_window_cap_sinks": lambda: check_attention(
        "fp8_e4m3", [(1, 100), (1, 3)], 2, 2, 128, np.float16, block_size=8, seed=7, sliding_window=50, softcap=5.0,
        with_sinks=True, num_splits=3, **FAST),
    "fast_fp8_e5m2_g8_d64_one_split_spread": lambda: check_attention(
        "fp8_e5m2", [(1, 45), (1, 17)], 8, 1, 64, np.float16, block_size=16, seed=8, spread=2.0, num_splits=1, **FAST),
    "fast_int8_g1_d128_mixed_spread": lambda: check_attention(
        "int8", [(1, 40), (1, 5), (3, 9)], 1, 1, 128, np.float16, seed=9, spread=1.5, kv_tile=4, **FAST),
    "fast_int4_g1_d128_splitk_window": lambda: check_attention(
        "int4", [(1, 40), (1, 7)], 2, 2, 128, np.float16, block_size=8, seed=10, sliding_window=25, num_splits=2,
        **FAST),
    "fast_codes_int4_d128": lambda: check_code_values("int4", head_dim=128),
    "fast_int4_g4_d64_mixed": lambda: check_attention(
        "int4", [(1, 33), (2, 6), (1, 4)], 8, 2, 64, np.float16, seed=11, spread=1.5, **FAST),
})


if __name__ == "__main__":
    sys.path.append(str(Path(__file__).resolve().parent))  # run with -P: the tests folder, last
    from _cuda_subprocess import serve_cases

    sys.exit(serve_cases(CASES, sys.argv[1:]))
