"""Quantized KV caches in the native CPU kernels (``kvpage.kernels.native_cpu``): the quantizing
store byte for byte against ``kv_quant.quantize_rows``, decode and prefill attention against
the oracle (``paged_attention_reference`` over the caches ``kv_quant.dequantize_rows`` makes
of the same bytes), the fused write-and-decode, the refusals, and the AVX2 variant on the
same cases.

Tolerances: a dequantized value is exact in fp32 on both sides (int8 and fp8 products of a
code and a scale are exact; int4's min + code * scale rounds once in the oracle's multiply-add
and once in the kernel's FMA, the product being exact), so the kernels and the oracle differ
only in the order of fp32 sums, the kernels' exp polynomial (relative error below 1e-6) and
where q's scale is applied. With rows up to 4 sigma at magnitudes up to 4, the dot products
sum |q_d k_d| up to a few hundred, so a score moves by up to ~1e-5 and an output (|V| < 20)
by up to ~1e-4 between two summation orders: atol 1e-4, rtol 1e-5 for fp32 outputs.
fp16/bf16 outputs add the kernel's final rounding, at most half an ulp: 2**-11 (fp16) and
2**-8 (bf16, 8 significant bits) relative.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kvpage.attention.reference import paged_attention_reference  # noqa: E402
from kvpage.core.kv_formats import CacheFormat, KVFormat  # noqa: E402
from kvpage.kernels import kv_quant, native_cpu  # noqa: E402

pytestmark = pytest.mark.skipif(native_cpu.library() is None,
                                reason="native kernels unavailable here (no AVX-512F or AVX2, or no C++ compiler)")

FORMATS = ["fp8_e4m3", "fp8_e5m2", "int8", "int4"]
TOL = {torch.float32: (1e-4, 1e-5), torch.float16: (1e-4, 2**-11 + 1e-5), torch.bfloat16: (1e-4, 2**-8 + 1e-5)}
SHAPES = {"gqa3-64": (9, 3, 64), "group4-128": (8, 2, 128), "mha-80": (4, 4, 80), "gqa2-96": (4, 2, 96),
          "mqa10-256": (10, 1, 256)}
POISON = 0x7F  # unwritten bytes: int8/int4 scales read as fp16 NaN, fp8 codes at 2**127 (inf), E5M2 codes NaN


def name_of(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rows(rng, shape) -> np.ndarray:
    """Normal values with each (token, head) row at its own magnitude (2**-2 .. 2**2)."""
    x = rng.standard_normal(shape).astype(np.float32)
    return x * np.exp2(rng.uniform(-2, 2, (*shape[:-1], 1))).astype(np.float32)


class Case:
    """K/V buffers of ``fmt`` whose context slots hold rows quantized by the numpy reference,
    blocks shuffled over the pool; block 0 (table padding) and every other slot is poison, so
    reading one shows in the output. ``kd``/``vd`` are the oracle's dequantized caches."""

    def __init__(self, rng, fmt: str, seq_lens, kv_heads: int, head_dim: int, block_size: int = 16):
        self.fmt, self.block_size = KVFormat(fmt), block_size
        blocks = [-(-s // block_size) for s in seq_lens]
        num_blocks = 1 + sum(blocks) + 2
        self.shape = (num_blocks, block_size, kv_heads, head_dim)
        ids = (rng.permutation(num_blocks - 1) + 1).tolist()
        self.tables = np.zeros((len(seq_lens), max(blocks) + 1), np.int32)
        slots = []
        for i, (n, s) in enumerate(zip(blocks, seq_lens)):
            self.tables[i, :n] = ids[:n]
            ids = ids[n:]
            slots += [self.tables[i, t // block_size] * block_size + t % block_size for t in range(s)]
        self.lens = np.asarray(seq_lens, np.int32)
        self.k, self.v = (self._buffer(rng, np.asarray(slots)) for _ in range(2))
        self.kd, self.vd = (self.dequantized(b) for b in (self.k, self.v))

    def _buffer(self, rng, slots) -> np.ndarray:
        num_blocks, bs, heads, dim = self.shape
        buf = np.full(self.fmt.buffer_shape(num_blocks, bs, heads, dim), POISON, np.uint8)
        codes, scales = kv_quant.block_views(buf, self.fmt, bs, heads, dim)
        c, s = kv_quant.quantize_rows(rows(rng, (len(slots), heads, dim)), self.fmt)
        codes[slots // bs, slots % bs] = c  # (block, offset) indexing writes through the strided views
        scales[slots // bs, slots % bs] = s
        return buf

    def dequantized(self, buf) -> np.ndarray:
        with np.errstate(invalid="ignore", over="ignore"):
            return kv_quant.dequantize_rows(*kv_quant.block_views(buf, self.fmt, *self.shape[1:]), self.fmt)


def options(rng, option: str, heads: int, window: int) -> dict:
    return {"window": {"sliding_window": window}, "softcap": {"softcap": 3.0},
            "sinks": {"sinks": rng.standard_normal(heads).astype(np.float32)}}.get(option, {})


def oracle(q, case: Case, qsl, opts) -> np.ndarray:
    return paged_attention_reference(q.float().numpy(), case.kd, case.vd, qsl, case.lens, case.tables, 0.125, **opts)


# ---- The store -------------------------------------------------------------------------------

def store(fmt, cache: np.ndarray, shape, x: torch.Tensor, slots: np.ndarray) -> None:
    native_cpu.store_quantized(native_cpu.library(), fmt, cache.ctypes.data, shape, name_of(x.dtype), x.data_ptr(),
                               x.stride()[:2], slots)


def stored_rows(fmt, cache, shape, slots):
    codes, scales = kv_quant.block_views(cache, KVFormat(fmt), *shape[1:])
    block, offset = slots // shape[1], slots % shape[1]
    return codes[block, offset], scales[block, offset]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype,head_dim,block_size", [(torch.float32, 64, 16), (torch.bfloat16, 64, 16),
                                                       (torch.float16, 128, 8), (torch.bfloat16, 80, 32),
                                                       (torch.float32, 32, 16), (torch.bfloat16, 256, 16)],
                         ids=lambda p: name_of(p) if isinstance(p, torch.dtype) else str(p))
def test_store_is_quantize_rows_byte_for_byte(fmt, dtype, head_dim, block_size):
    """Rows as the HF attention hands them ([1, H, T, D] transposed: strided tokens and heads),
    at magnitudes from 2**-2 to 2**2 per row, into scattered slots of every block; the slots
    not written keep their bytes."""
    rng = np.random.default_rng(head_dim + block_size)
    heads, num_blocks = 3, 5
    fmt_ = KVFormat(fmt)
    shape = (num_blocks, block_size, heads, head_dim)
    cache = np.full(fmt_.buffer_shape(*shape), POISON, np.uint8)
    slots = rng.permutation(num_blocks * block_size)[: 2 * block_size + 3].astype(np.int64)
    x = torch.from_numpy(rows(rng, (1, heads, len(slots), head_dim))).to(dtype)[0].transpose(0, 1)
    store(fmt, cache, shape, x, slots)
    codes, scales = kv_quant.quantize_rows(x.float().numpy(), fmt_)
    got_codes, got_scales = stored_rows(fmt, cache, shape, slots)
    np.testing.assert_array_equal(got_codes, codes)
    np.testing.assert_array_equal(got_scales, scales)
    untouched = np.setdiff1d(np.arange(num_blocks * block_size), slots)
    assert all((part == POISON).all() for part in stored_rows(fmt, cache, shape, untouched))


def edge_rows(fmt: str, head_dim: int) -> np.ndarray:
    """Rows that pin the rounding: exact ties (x / s at k + 1/2), zero rows, -0.0, values at
    fp8's largest, subnormal and midpoint codes, tiny and huge magnitudes, a constant row."""
    ramp = np.arange(head_dim, dtype=np.float32)
    out = [np.zeros(head_dim, np.float32), np.full(head_dim, -0.0, np.float32), np.full(head_dim, 3.25, np.float32)]
    if fmt == "int8":  # absmax 127: s = 1, so x / s = x exactly and the halves are ties
        out.append(np.where(ramp % 2 == 0, 127.0, (ramp - 64) / 2).astype(np.float32))
        out.append(np.where(ramp == 0, -127.0, -(ramp % 9) - 0.5).astype(np.float32))
    elif fmt == "int4":  # min 0, max 15: on the plain grid (s = 1, low = 0) halves are ties
        row = (ramp % 16) + np.where(ramp % 3 == 0, 0.5, 0.0)
        row[::16] = 0.0
        row[1::16] = 15.0
        out.append(row.astype(np.float32))
        out.append((-row).astype(np.float32))
    else:
        largest = kv_quant.FP8[fmt][3]
        table = kv_quant.fp8_table(fmt)
        finite = np.sort(np.unique(np.abs(table[np.isfinite(table)])))
        mids = (finite[:-1] + finite[1:]) / 2  # every tie between neighbouring codes
        row = np.resize(np.concatenate([mids, finite]), head_dim).astype(np.float32)
        row[0] = largest  # e = 0: the values are coded as they are
        out += [row, -row, (row * 2.0**-20).astype(np.float32), (row * 2.0**20).astype(np.float32)]
    out.append((np.linspace(-1, 1, head_dim) * 1e-30).astype(np.float32))
    out.append((np.linspace(-1, 1, head_dim) * 3e4).astype(np.float32))
    return np.stack(out)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_store_rounds_edge_values_as_the_reference(fmt, head_dim):
    x = edge_rows(fmt, head_dim)[:, None, :]  # [T, 1, D]
    shape = (2, 16, 1, head_dim)
    cache = np.zeros(KVFormat(fmt).buffer_shape(*shape), np.uint8)
    slots = np.arange(len(x), dtype=np.int64)
    store(fmt, cache, shape, torch.from_numpy(x), slots)
    codes, scales = kv_quant.quantize_rows(x, KVFormat(fmt))
    got_codes, got_scales = stored_rows(fmt, cache, shape, slots)
    np.testing.assert_array_equal(got_codes, codes)
    np.testing.assert_array_equal(got_scales, scales)


def int4_groups(rng, count: int, head_dim: int) -> np.ndarray:
    """float32 ``[count, head_dim]`` rows of the shapes int4's range search meets: normal,
    heavy-tailed, uniform, a few levels, one outlier, a ramp, and constant groups."""
    kinds = [lambda: rng.standard_normal(head_dim),
             lambda: rng.standard_t(2, head_dim),
             lambda: rng.uniform(-1, 1, head_dim),
             lambda: rng.integers(-2, 3, head_dim) * 0.375,
             lambda: np.where(np.arange(head_dim) == rng.integers(head_dim), 40.0, rng.standard_normal(head_dim)),
             lambda: np.linspace(-3, 5, head_dim),
             lambda: np.full(head_dim, rng.standard_normal())]
    out = [kinds[i % len(kinds)]() * np.exp2(rng.uniform(-12, 6)) for i in range(count)]
    return np.stack(out).astype(np.float32)


@pytest.mark.parametrize("head_dim", [64, 80, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=name_of)
def test_int4_range_search_matches_the_reference_on_many_groups(head_dim, dtype):
    """The least-squares search (``kv_quant.int4_ranges``) over 700 rows of every shape: the
    native store picks the reference's grid in every group, bit for bit."""
    x = torch.from_numpy(int4_groups(np.random.default_rng(head_dim), 700, head_dim)).to(dtype)[:, None, :]
    shape = (44, 16, 1, head_dim)
    cache = np.full(KVFormat("int4").buffer_shape(*shape), POISON, np.uint8)
    slots = np.arange(len(x), dtype=np.int64)
    store("int4", cache, shape, x, slots)
    codes, scales = kv_quant.quantize_rows(x.float().numpy(), KVFormat("int4"))
    got_codes, got_scales = stored_rows("int4", cache, shape, slots)
    np.testing.assert_array_equal(got_scales, scales)
    np.testing.assert_array_equal(got_codes, codes)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_int4_range_search_matches_the_reference_on_any_floats(data):
    """Property: rows of any finite float32s (subnormals, spans that overflow, repeated values,
    a few distinct levels) get the reference's bytes from the native store."""
    head_dim = data.draw(st.sampled_from([32, 64, 80]))
    values = st.floats(allow_nan=False, allow_infinity=False, width=32)
    levels = data.draw(st.lists(values, min_size=1, max_size=6))
    row = st.lists(st.one_of(values, st.sampled_from(levels)), min_size=head_dim, max_size=head_dim)
    x = np.array(data.draw(st.lists(row, min_size=1, max_size=20)), dtype=np.float32)[:, None, :]
    shape = (2, 16, 1, head_dim)
    cache = np.full(KVFormat("int4").buffer_shape(*shape), POISON, np.uint8)
    slots = np.arange(len(x), dtype=np.int64)
    store("int4", cache, shape, torch.from_numpy(x), slots)
    with np.errstate(over="ignore", invalid="ignore"):
        codes, scales = kv_quant.quantize_rows(x, KVFormat("int4"))
    got_codes, got_scales = stored_rows("int4", cache, shape, slots)
    np.testing.assert_array_equal(got_scales, scales)
    np.testing.assert_array_equal(got_codes, codes)


def test_int4_range_search_beats_min_max():
    """The grid int4 stores loses less than the plain ``[min, max]`` grid: on normal rows about a
    fifth less squared error (0.80 of it), and never a group more than fp16's rounding of the
    two parameters can cost."""
    fmt = KVFormat("int4")
    x = np.random.default_rng(5).standard_normal((4000, 64)).astype(np.float32)
    groups = x.reshape(-1, 32)
    low = groups.min(-1, keepdims=True).astype(np.float16).astype(np.float32)
    scale = ((groups.max(-1, keepdims=True) - groups.min(-1, keepdims=True)) / np.float32(15))
    scale = scale.astype(np.float16).astype(np.float32)
    plain = low + np.clip(np.rint((groups - low) / scale), 0, 15) * scale
    searched = kv_quant.dequantize_rows(*kv_quant.quantize_rows(x, fmt), fmt).reshape(-1, 32)
    plain_error = ((plain - groups) ** 2).sum(-1)
    searched_error = ((searched - groups) ** 2).sum(-1)
    assert searched_error.sum() < 0.82 * plain_error.sum()
    assert (searched_error <= plain_error * 1.02 + 1e-6).all()
    # the search keeps every code in range and its grid's ends near the group's
    assert np.abs(searched - groups).max() < 0.25 * (groups.max(-1) - groups.min(-1)).max()


def test_store_checks_every_slot_before_writing():
    shape = (2, 16, 2, 64)
    cache = np.full(KVFormat("int8").buffer_shape(*shape), POISON, np.uint8)
    x = torch.randn(3, 2, 64)
    with pytest.raises(IndexError, match="KV slot 32 outside the cache"):
        store("int8", cache, shape, x, np.array([0, 5, 32], np.int64))
    assert (cache == POISON).all()


# ---- Decode and prefill ------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", list(SHAPES), ids=str)
@pytest.mark.parametrize("option,splits,dtype", [("plain", 1, torch.bfloat16), ("split-k", 3, torch.float32),
                                                 ("window", 3, torch.bfloat16), ("softcap", 1, torch.float16),
                                                 ("sinks", 3, torch.bfloat16)],
                         ids=lambda p: name_of(p) if isinstance(p, torch.dtype) else str(p))
def test_decode_matches_the_oracle(fmt, shape, option, splits, dtype):
    """GQA groups of 2 to 4, MHA and MQA of 10 query heads (two passes of the transposed
    scores); head sizes 64, 128 and 256 (AVX-512BW: transposed scores), 96 and 80 (scored row
    by row; int4 in groups of 32, and 80 in one group of the whole head); contexts of one
    token to several partitions; split-K (with the window and the sinks too)."""
    heads, kv_heads, head_dim = SHAPES[shape]
    rng = np.random.default_rng([FORMATS.index(fmt), head_dim, splits])
    case = Case(rng, fmt, [1, 15, 17, 70, 150], kv_heads, head_dim)
    opts = options(rng, option, heads, 37)
    q = torch.from_numpy(rng.standard_normal((5, heads, head_dim)).astype(np.float32)).to(dtype)
    out = torch.full_like(q, float("nan"))
    native_cpu.decode_attention(native_cpu.library(), name_of(dtype), q.data_ptr(), q.stride()[:2], case.k.ctypes.data,
                                case.v.ctypes.data, case.shape, heads, case.tables, case.lens, 5, 0.125,
                                opts.get("sliding_window", 0), opts.get("softcap", 0.0), opts.get("sinks"),
                                out.data_ptr(), splits, 2, cache_format=fmt)
    want = oracle(q, case, np.arange(6, dtype=np.int32), opts)
    assert np.isfinite(want).all()
    atol, rtol = TOL[dtype]
    np.testing.assert_allclose(out.float().numpy(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("group", [1, 2, 5, 8])
def test_decode_takes_groups_of_every_size(fmt, group):
    """Query heads per KV head that the score passes handle separately (1 to 8 per pass)."""
    rng = np.random.default_rng(group)
    case = Case(rng, fmt, [33, 64, 100], 2, 64)
    heads = 2 * group
    q = torch.from_numpy(rng.standard_normal((3, heads, 64)).astype(np.float32))
    out = torch.empty_like(q)
    native_cpu.decode_attention(native_cpu.library(), "float32", q.data_ptr(), q.stride()[:2], case.k.ctypes.data,
                                case.v.ctypes.data, case.shape, heads, case.tables, case.lens, 3, 0.125, 0, 0.0,
                                None, out.data_ptr(), 1, 2, cache_format=fmt)
    atol, rtol = TOL[torch.float32]
    np.testing.assert_allclose(out.numpy(), oracle(q, case, np.arange(4, dtype=np.int32), {}), atol=atol, rtol=rtol)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", list(SHAPES), ids=str)
@pytest.mark.parametrize("option,dtype", [("plain", torch.bfloat16), ("window", torch.float16),
                                          ("softcap", torch.float32), ("sinks", torch.bfloat16)],
                         ids=lambda p: name_of(p) if isinstance(p, torch.dtype) else str(p))
def test_prefill_matches_the_oracle(fmt, shape, option, dtype):
    """Whole prompts, a chunk over a cached prefix, a prefix hit with one new token, an empty
    query, and a decode row first that the call must leave alone; contexts past one 64-key
    chunk."""
    heads, kv_heads, head_dim = SHAPES[shape]
    rng = np.random.default_rng([FORMATS.index(fmt), head_dim, 7])
    seq_lens, q_lens = [9, 30, 16, 41, 100, 5], [1, 30, 16, 1, 70, 0]
    case = Case(rng, fmt, seq_lens, kv_heads, head_dim, block_size=16 if head_dim != 80 else 8)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = torch.from_numpy(rng.standard_normal((int(qsl[-1]), heads, head_dim)).astype(np.float32)).to(dtype)
    opts = options(rng, option, heads, 11)
    out = torch.full_like(q, 5.0)
    native_cpu.prefill_attention(native_cpu.library(), name_of(dtype), q.data_ptr(), q.stride()[:2],
                                 case.k.ctypes.data, case.v.ctypes.data, case.shape, heads, case.tables, qsl, case.lens,
                                 1, 0.125, opts.get("sliding_window", 0), opts.get("softcap", 0.0), opts.get("sinks"),
                                 out.data_ptr(), 2, cache_format=CacheFormat(case.fmt, case.block_size))
    assert bool((out[:1] == 5.0).all())
    want = oracle(q, case, qsl, opts)[1:]
    assert np.isfinite(want).all()
    atol, rtol = TOL[dtype]
    np.testing.assert_allclose(out[1:].float().numpy(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=name_of)
def test_write_decode_quantizes_then_attends(fmt, dtype):
    """The fused call writes the bytes store_quantized writes (the rows as strided views) and
    returns exactly what decode_attention returns over them."""
    rng = np.random.default_rng(FORMATS.index(fmt))
    case = Case(rng, fmt, [5, 17, 40], 2, 64)
    lens = case.lens
    slots = np.array([case.tables[i, (s - 1) // 16] * 16 + (s - 1) % 16 for i, s in enumerate(lens)], np.int64)
    k, v = (torch.from_numpy(rows(rng, (1, 2, 3, 64))).to(dtype)[0].transpose(0, 1) for _ in range(2))
    q = torch.from_numpy(rng.standard_normal((3, 6, 64)).astype(np.float32)).to(dtype)
    want_k, want_v = case.k.copy(), case.v.copy()
    store(fmt, want_k, case.shape, k, slots)
    store(fmt, want_v, case.shape, v, slots)
    lib = native_cpu.library()
    want = torch.empty_like(q)
    native_cpu.decode_attention(lib, name_of(dtype), q.data_ptr(), q.stride()[:2], want_k.ctypes.data,
                                want_v.ctypes.data, case.shape, 6, case.tables, lens, 3, 0.125, 0, 0.0, None,
                                want.data_ptr(), 1, 2, cache_format=fmt)
    got = torch.empty_like(q)
    step = (case.tables.ctypes.data, case.tables.strides[0] // 4, lens.ctypes.data, 3, 1)
    native_cpu.write_decode(lib, name_of(dtype), (q.data_ptr(), *q.stride()[:2]), (k.data_ptr(), *k.stride()[:2]),
                            (v.data_ptr(), *v.stride()[:2]), slots.ctypes.data, 3, case.k.ctypes.data,
                            case.v.ctypes.data, case.shape, 6, step, 0.125, 0, 0.0, None, got.data_ptr(), 2,
                            cache_format=KVFormat(fmt))
    np.testing.assert_array_equal(case.k, want_k)
    np.testing.assert_array_equal(case.v, want_v)
    assert torch.equal(got, want)
    bad = np.array([slots[0], case.shape[0] * 16], np.int64)
    with pytest.raises(IndexError, match="outside the cache"):
        native_cpu.write_decode(lib, name_of(dtype), (q.data_ptr(), *q.stride()[:2]), (k.data_ptr(), *k.stride()[:2]),
                                (v.data_ptr(), *v.stride()[:2]), bad.ctypes.data, 2, case.k.ctypes.data,
                                case.v.ctypes.data, case.shape, 6, step, 0.125, 0, 0.0, None, got.data_ptr(), 2,
                                cache_format=fmt)
    np.testing.assert_array_equal(case.k, want_k)


# ---- The API -----------------------------------------------------------------------------------

def test_formats_and_refusals():
    assert native_cpu.CACHE_FORMATS == {"float32": 0, "float16": 1, "bfloat16": 2, "fp8_e4m3": 3, "fp8_e5m2": 4,
                                        "int8": 5, "int4": 6}
    assert native_cpu.format_name("fp8") == "fp8_e4m3"
    assert native_cpu.format_name(CacheFormat(KVFormat("int4"), 16)) == "int4"
    for fmt in (None, "bfloat16", "fp8", KVFormat("int8"), CacheFormat(KVFormat("fp8_e5m2"), 16)):
        assert native_cpu.decode_supported(64, 9, 3, "bfloat16", fmt)
    assert not native_cpu.decode_supported(64, 9, 3, "bfloat16", "float16")  # caches of another dtype than q
    assert not native_cpu.decode_supported(64, 9, 3, "bfloat16", "int2")
    assert not native_cpu.decode_supported(72, 9, 3, "bfloat16", "int8")
    lib, shape = native_cpu.library(), (2, 16, 2, 64)
    x, slots = torch.zeros(1, 2, 64), np.zeros(1, np.int64)
    cache = np.zeros(KVFormat("int8").buffer_shape(*shape), np.uint8)
    with pytest.raises(ValueError, match="quantized formats, not bfloat16"):
        native_cpu.store_quantized(lib, "bfloat16", cache.ctypes.data, shape, "float32", x.data_ptr(), (128, 64), slots)
    with pytest.raises(ValueError, match="rows of float32, float16, bfloat16, not float64"):
        native_cpu.store_quantized(lib, "int8", cache.ctypes.data, shape, "float64", x.data_ptr(), (128, 64), slots)
    with pytest.raises(ValueError, match="blocks of 8 tokens for a cache of blocks of 16"):
        native_cpu.store_quantized(lib, CacheFormat(KVFormat("int8"), 8), cache.ctypes.data, shape, "float32",
                                   x.data_ptr(), (128, 64), slots)
    with pytest.raises(ValueError, match="do not read KV cache format 'int2'"):
        native_cpu.format_name("int2")
    with pytest.raises(ValueError, match="refused head_dim 72"):
        native_cpu.store_quantized(lib, "int8", cache.ctypes.data, (2, 16, 2, 72), "float32", x.data_ptr(),
                                   (144, 72), slots)


def test_avx2_variant_passes_the_same_cases_on_avx512_cpus():
    """Where the AVX-512 variant serves, the AVX2 one (what AVX2-only CPUs run) passes this
    file's cases too (a child process: the variant is chosen once per process)."""
    if native_cpu.variant() != "avx512":
        pytest.skip("the in-process cases already run the AVX2 variant here")
    env = {**os.environ, "KVPAGE_NATIVE_KERNELS": "avx2"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", __file__, "-k",
                          "not avx2_variant"], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout.splitlines()[-1], out.stdout[-500:]
