"""Attention over quantized KV caches (fp8, int8, int4): stores, the reference, the CPU
kernels (torch and native) and the backends, and that a prompt's attention output cannot
depend on how its steps were scheduled."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvpage.adapters import attention_backends  # noqa: E402
from kvpage.adapters.attention_backends import CpuBackend, ReferenceBackend, select_backend  # noqa: E402
from kvpage.adapters.rotated_backend import RotatedBackend  # noqa: E402
from kvpage.attention import paged_attention_reference, write_kv_reference  # noqa: E402
from kvpage.attention.cpu import (AttentionLayout, CPUAttention, CPUKernelChoice, CPUKernels,  # noqa: E402
                                  paged_attention_cpu, write_kv_cpu)
from kvpage.attention.cpu_kernels import QuantizedStore  # noqa: E402
from kvpage.attention.cpu_metadata import LayerCall, prepare_cpu_attention_metadata  # noqa: E402
from kvpage.core.kv_formats import CacheFormat, KVFormat  # noqa: E402
from kvpage.core.sched.metadata import StepMetadata  # noqa: E402
from kvpage.kernels import kv_quant, native_cpu  # noqa: E402

FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8", "int4")
BS, HEADS, KV_HEADS, HEAD_DIM = 16, 8, 2, 64  # GQA: four query heads per KV head
SCALE = 0.125
TORCH = CPUKernelChoice("torch", "torch")
# (query lengths, context lengths): decodes (1, a block edge, longer), a prefix hit, a whole prompt.
MIXED = ([1, 1, 1, 9, 33], [1, BS, 40, 41, 33])
OPTIONS = {"plain": {}, "window": {"sliding_window": 7}, "softcap": {"softcap": 4.0}, "sinks": {"sinks": True}}


def cache_format(name: str) -> CacheFormat:
    return CacheFormat(KVFormat(name), BS)


def native_takes(name: str) -> bool:
    """Whether the native kernels load here and read this format."""
    return (native_cpu.library() is not None and name in getattr(native_cpu, "CACHE_FORMATS", {})
            and native_cpu.decode_supported(HEAD_DIM, HEADS, KV_HEADS, "float32", cache_format=name))


def slots_of(table: np.ndarray, start: int, end: int) -> np.ndarray:
    pos = np.arange(start, end)
    return (table[pos // BS] * BS + pos % BS).astype(np.int64)


class Case:
    """Quantized caches holding a step's context, shuffled block tables; every slot no
    sequence owns holds the quantized rows of large values (reading one would show)."""

    def __init__(self, name: str, q_lens, seq_lens, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.fmt = cache_format(name)
        blocks = [-(-s // BS) for s in seq_lens]
        num_blocks = 1 + sum(blocks) + 2
        shape = self.fmt.kv_format.buffer_shape(num_blocks, BS, KV_HEADS, HEAD_DIM)
        self.kc, self.vc = np.zeros(shape, np.uint8), np.zeros(shape, np.uint8)
        junk = np.full((num_blocks * BS, KV_HEADS, HEAD_DIM), 1e3, np.float32)
        write_kv_reference(self.kc, self.vc, junk, -junk, np.arange(num_blocks * BS), self.fmt)
        ids = rng.permutation(np.arange(1, num_blocks))
        self.tables = np.zeros((len(seq_lens), max(blocks) + 1), np.int32)
        used = 0
        for i, n in enumerate(blocks):
            self.tables[i, :n] = ids[used:used + n]
            used += n
        self.slots = np.concatenate([slots_of(self.tables[i], 0, s) for i, s in enumerate(seq_lens)])
        self.k = rng.standard_normal((len(self.slots), KV_HEADS, HEAD_DIM)).astype(np.float32)
        self.v = rng.standard_normal(self.k.shape).astype(np.float32)
        write_kv_reference(self.kc, self.vc, self.k, self.v, self.slots, self.fmt)
        self.qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        self.seq_lens = np.asarray(seq_lens, np.int32)
        self.q = rng.standard_normal((int(self.qsl[-1]), HEADS, HEAD_DIM)).astype(np.float32)
        self.sinks = rng.standard_normal(HEADS).astype(np.float32)

    def options(self, name: str) -> dict:
        opts = dict(OPTIONS[name])
        if opts.pop("sinks", False):
            opts["sinks"] = self.sinks
        return opts

    def reference(self, **opts) -> np.ndarray:
        return paged_attention_reference(self.q, self.kc, self.vc, self.qsl, self.seq_lens, self.tables, SCALE,
                                         cache_format=self.fmt, **opts)


# --- stores -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FORMATS)
def test_reference_store_writes_quantize_rows_bytes(name):
    fmt = cache_format(name)
    rng = np.random.default_rng(1)
    shape = fmt.kv_format.buffer_shape(5, BS, KV_HEADS, HEAD_DIM)
    kc, vc = np.zeros(shape, np.uint8), np.zeros(shape, np.uint8)
    slots = rng.choice(5 * BS, size=23, replace=False)
    k = (rng.standard_normal((23, KV_HEADS, HEAD_DIM)) * 3).astype(np.float32)
    v = rng.standard_normal(k.shape).astype(np.float32)
    write_kv_reference(kc, vc, k, v, slots, fmt)
    for cache, rows in ((kc, k), (vc, v)):
        codes, scales = kv_quant.block_views(cache, fmt.kv_format, BS, KV_HEADS, HEAD_DIM)
        want_codes, want_scales = kv_quant.quantize_rows(rows, fmt.kv_format)
        assert np.array_equal(codes[slots // BS, slots % BS], want_codes)
        assert np.array_equal(scales[slots // BS, slots % BS], want_scales)
        untouched = np.setdiff1d(np.arange(5 * BS), slots)
        assert not codes[untouched // BS, untouched % BS].any() and not scales[untouched // BS, untouched % BS].any()


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rows_dtype", [torch.float32, torch.bfloat16])
def test_cpu_stores_write_the_reference_bytes(name, rows_dtype):
    """The CPU store (native where the library has it) and the numpy-encoder fallback write
    the reference's bytes; bf16 rows are widened exactly first."""
    fmt = cache_format(name)
    rng = np.random.default_rng(2)
    shape = fmt.kv_format.buffer_shape(4, BS, KV_HEADS, HEAD_DIM)
    slots = rng.choice(4 * BS, size=19, replace=False)
    k = torch.from_numpy(rng.standard_normal((19, KV_HEADS, HEAD_DIM)).astype(np.float32)).to(rows_dtype)
    v = torch.from_numpy(rng.standard_normal((19, KV_HEADS, HEAD_DIM)).astype(np.float32)).to(rows_dtype)
    want_k, want_v = np.zeros(shape, np.uint8), np.zeros(shape, np.uint8)
    write_kv_reference(want_k, want_v, k.float().numpy(), v.float().numpy(), slots, fmt)
    stores = {"cpu": lambda *a: write_kv_cpu(*a, cache_format=fmt), "fallback": QuantizedStore(None, fmt).store}
    for store in stores.values():
        kc, vc = torch.zeros(shape, dtype=torch.uint8), torch.zeros(shape, dtype=torch.uint8)
        store(kc, vc, k, v, torch.from_numpy(slots))
        assert np.array_equal(kc.numpy(), want_k) and np.array_equal(vc.numpy(), want_v)


# --- the reference ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FORMATS)
def test_reference_attends_the_dequantized_rows(name):
    """Exactly the unquantized reference over a float cache holding the dequantized values."""
    case = Case(name, *MIXED)
    codes, scales = kv_quant.block_views(case.kc, case.fmt.kv_format, BS, KV_HEADS, HEAD_DIM)
    k_values = kv_quant.dequantize_rows(codes, scales, case.fmt.kv_format)
    codes, scales = kv_quant.block_views(case.vc, case.fmt.kv_format, BS, KV_HEADS, HEAD_DIM)
    v_values = kv_quant.dequantize_rows(codes, scales, case.fmt.kv_format)
    opts = case.options("sinks") | case.options("window")
    plain = paged_attention_reference(case.q, k_values, v_values, case.qsl, case.seq_lens, case.tables, SCALE, **opts)
    np.testing.assert_array_equal(case.reference(**opts), plain)


# --- the CPU kernels against the reference ------------------------------------------------------------------


def _cpu_choices(name):
    yield "torch", TORCH
    if native_takes(name):
        yield "native", CPUKernelChoice()
        yield "native decode, torch prefill", CPUKernelChoice("native", "torch")
        yield "torch decode, native prefill", CPUKernelChoice("torch", "native")


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("option", OPTIONS)
def test_cpu_kernels_match_the_reference(name, option):
    """Mixed decode + prefill + prefix-hit step. Both read the same dequantized values, so
    they differ only in fp32 summation order: well under 1e-4 at these sizes."""
    case = Case(name, *MIXED)
    opts = case.options(option)
    want = case.reference(**opts)
    for label, choice in _cpu_choices(name):
        got = paged_attention_cpu(torch.from_numpy(case.q), torch.from_numpy(case.kc), torch.from_numpy(case.vc),
                                  case.qsl, case.seq_lens, case.tables, SCALE, decode_backend=choice.decode_backend,
                                  prefill_backend=choice.prefill_backend, cache_format=case.fmt, **opts)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=2e-5, err_msg=label)
    numpy_out = paged_attention_cpu(case.q, case.kc, case.vc, case.qsl, case.seq_lens, case.tables, SCALE,
                                    cache_format=case.fmt, **opts)
    np.testing.assert_array_equal(numpy_out, want)  # numpy inputs: the reference itself


@pytest.mark.parametrize("name", ["fp8_e4m3", "int4"])
def test_bf16_queries_match_the_reference(name):
    """bf16 q and output (K/V dequantized to bf16 on torch): bf16 rounding, 2e-2."""
    case = Case(name, *MIXED)
    want = case.reference(sinks=case.sinks)
    for label, choice in _cpu_choices(name):
        got = paged_attention_cpu(torch.from_numpy(case.q).bfloat16(), torch.from_numpy(case.kc),
                                  torch.from_numpy(case.vc), case.qsl, case.seq_lens, case.tables, SCALE,
                                  sinks=case.sinks, decode_backend=choice.decode_backend,
                                  prefill_backend=choice.prefill_backend, cache_format=case.fmt)
        assert got.dtype == torch.bfloat16
        np.testing.assert_allclose(got.float().numpy(), want, rtol=2e-2, atol=2e-2, err_msg=label)


def _every_fp8_code_case(name: str, head_dim: int, context: int = 48):
    """One decode row over a cache whose K rows hold finite codes of the format drawn at
    random, every third row only subnormal codes; the row exponents put both kinds of row
    at values of about 1, so a wrong subnormal would move the scores. V: small codes."""
    rng = np.random.default_rng(7)
    fmt = cache_format(name)
    largest_exponent = 0xF if name == "fp8_e4m3" else 0x1F
    table = kv_quant.fp8_table(name)
    finite = np.flatnonzero(np.isfinite(table)).astype(np.uint8)
    subnormal = finite[(finite >> (3 if name == "fp8_e4m3" else 2)) & largest_exponent == 0]
    # Row exponents that put both kinds of row at values of about 1 (E4M3 codes reach 448,
    # its subnormals 7 * 2^-9; E5M2 57344 and 3 * 2^-16).
    subnormal_exponent, normal_exponents = (9, (-9, -6)) if name == "fp8_e4m3" else (16, (-17, -14))
    num_blocks = -(-context // BS) + 1
    kc = np.zeros(fmt.kv_format.buffer_shape(num_blocks, BS, KV_HEADS, head_dim), np.uint8)
    vc = np.zeros_like(kc)
    (k_codes, k_scales), (v_codes, v_scales) = (kv_quant.block_views(c, fmt.kv_format, BS, KV_HEADS, head_dim)
                                                for c in (kc, vc))
    for t in range(context):
        for h in range(KV_HEADS):
            pool = subnormal if t % 3 == 0 else finite
            k_codes[1 + t // BS, t % BS, h] = rng.choice(pool, head_dim)
            exponent = subnormal_exponent if t % 3 == 0 else rng.integers(*normal_exponents)
            k_scales[1 + t // BS, t % BS, h] = np.int8(exponent).view(np.uint8)
            v_codes[1 + t // BS, t % BS, h] = rng.choice(finite[np.abs(table[finite]) < 8], head_dim)
    tables = np.arange(1, num_blocks, dtype=np.int32)[None]
    q = torch.randn(1, HEADS, head_dim).bfloat16()
    qsl, seq_lens = np.array([0, 1], np.int32), np.array([context], np.int32)
    want = paged_attention_reference(q.float().numpy(), kc, vc, qsl, seq_lens, tables, SCALE, cache_format=fmt)
    return fmt, q, kc, vc, qsl, seq_lens, tables, want


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_queries_read_every_fp8_code(name, head_dim):
    """bf16 queries over fp8 K rows of every finite code, subnormals included, at both head
    sizes of the transposed scores: a code widened wrongly moves the output well past 1e-2."""
    fmt, q, kc, vc, qsl, seq_lens, tables, want = _every_fp8_code_case(name, head_dim)
    choices = [("torch", TORCH)]
    if native_cpu.library() is not None and native_cpu.decode_supported(head_dim, HEADS, KV_HEADS, "bfloat16",
                                                                         cache_format=name):
        choices.append(("native", CPUKernelChoice()))
    for label, choice in choices:
        got = paged_attention_cpu(q, torch.from_numpy(kc), torch.from_numpy(vc), qsl, seq_lens, tables, SCALE,
                                  decode_backend=choice.decode_backend, prefill_backend=choice.prefill_backend,
                                  cache_format=fmt)
        np.testing.assert_allclose(got.float().numpy(), want, rtol=1e-2, atol=1e-2, err_msg=label)


@pytest.mark.parametrize("variant", [{"attention_chunk": 8}, {"alibi_slopes": True}])
def test_chunked_attention_and_alibi_over_quantized_caches(variant):
    case = Case("int8", *MIXED)
    if variant.get("alibi_slopes"):
        variant = {"alibi_slopes": np.linspace(-0.5, -0.01, HEADS).astype(np.float32)}
    want = case.reference(**variant)
    got = paged_attention_cpu(torch.from_numpy(case.q), torch.from_numpy(case.kc), torch.from_numpy(case.vc),
                              case.qsl, case.seq_lens, case.tables, SCALE, cache_format=case.fmt, **variant)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=2e-5)


def test_kernel_choice_never_takes_numba_for_quantized_caches():
    fmt = cache_format("int8")
    kc = torch.zeros(fmt.kv_format.buffer_shape(4, BS, KV_HEADS, HEAD_DIM), dtype=torch.uint8)
    q = torch.zeros((1, HEADS, HEAD_DIM))
    native = "native" if native_takes("int8") else "torch"
    for choice, want in ((CPUKernelChoice("numba", "numba"), ("torch", "torch")), (TORCH, ("torch", "torch")),
                         (CPUKernelChoice(), (native, native))):
        kernels = CPUKernels(AttentionLayout.of(q, kc, kc.clone(), fmt), choice)
        assert (kernels.decode_backend, kernels.prefill_backend) == want


# --- scheduling independence --------------------------------------------------------------------------------


def _prompt_outputs(name, choice, splits, dtype, opts, neighbour: bool):
    """Write and attend one 45-token prompt in steps ending at ``splits``; with
    ``neighbour``, every step also carries another sequence's decode row."""
    fmt = cache_format(name)
    rng = np.random.default_rng(3)
    n = splits[-1]
    q, k, v = (torch.from_numpy(rng.standard_normal((n, h, HEAD_DIM)).astype(np.float32)).to(dtype)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    other = torch.from_numpy(rng.standard_normal((3, HEADS + 2 * KV_HEADS, HEAD_DIM)).astype(np.float32)).to(dtype)
    shape = fmt.kv_format.buffer_shape(8, BS, KV_HEADS, HEAD_DIM)
    kc, vc = torch.zeros(shape, dtype=torch.uint8), torch.zeros(shape, dtype=torch.uint8)
    tables = np.array([[3, 6, 1, 0], [7, 0, 0, 0]], np.int32)
    attention = CPUAttention(choice, fmt)
    outs, start = [], 0
    for step, end in enumerate(splits):
        rows = slice(start, end)
        qs, ks, vs = q[rows], k[rows], v[rows]
        qsl, lens, table, slots = [0, end - start], [end], tables[:1], slots_of(tables[0], start, end)
        if neighbour:  # a decode row first (decodes lead a step), at position step
            o = other[step % 3]
            qs, ks, vs = (torch.cat([o[None, a:b], x]) for (a, b), x in
                          (((0, HEADS), qs), ((HEADS, HEADS + KV_HEADS), ks), ((HEADS + KV_HEADS, None), vs)))
            qsl, lens, table = [0, 1, 1 + end - start], [step + 1, end], tables[::-1]
            slots = np.concatenate([slots_of(tables[1], step, step + 1), slots])
        md = prepare_cpu_attention_metadata(qsl, lens, table.copy(), slot_mapping=slots)
        out = attention.kernels(qs, kc, vc).write_and_attend(qs, ks, vs, kc, vc, md, LayerCall(SCALE, **opts))
        outs.append(out[1:] if neighbour else out)
        start = end
    return torch.cat(outs)


SCHEDULE_CHOICES = {"torch": TORCH, "native": CPUKernelChoice(),
                    "native, schedule-invariant": CPUKernelChoice(schedule_invariant=True)}


def _schedule_choices():
    for name in FORMATS:
        for path in SCHEDULE_CHOICES:
            yield name, path


def _check_schedules(name, path, schedules):
    """Each schedule (step ends, whether a neighbour decodes beside) gives the whole
    prompt's bits, for every option in fp32, and in bf16 (whose rounding hides more)."""
    if path != "torch" and not native_takes(name):
        pytest.skip(f"the native kernels do not read {name} here")
    choice = SCHEDULE_CHOICES[path]
    for dtype, options in ((torch.float32, OPTIONS), (torch.bfloat16, ("plain", "sinks"))):
        for option in options:
            opts = dict(OPTIONS[option])
            if opts.pop("sinks", False):
                opts["sinks"] = torch.linspace(-1, 1, HEADS)
            whole = _prompt_outputs(name, choice, [45], dtype, opts, neighbour=False)
            for splits, neighbour in schedules:
                chunked = _prompt_outputs(name, choice, splits, dtype, opts, neighbour)
                assert torch.equal(chunked, whole), (dtype, option, splits, neighbour)


@pytest.mark.parametrize("name,path", list(_schedule_choices()))
def test_prompt_attention_does_not_depend_on_the_schedule(name, path):
    """Whole, in chunks, or beside another sequence's decode: the same bits. Attention reads
    only what the cache stores, and a token's bytes depend only on the token."""
    _check_schedules(name, path, [([17, 45], False), ([2, 16, 30, 45], False), ([20, 45], True)])


@pytest.mark.parametrize("name,path", [pytest.param(name, path, marks=pytest.mark.xfail(
    path == "native", strict=True, reason="the native decode kernel sums a row in another order than the "
    "native prefill kernel (fp32 bits differ); schedule_invariant routes decode rows to the prefill kernel"))
    for name, path in _schedule_choices()])
def test_a_one_token_chunk_gives_the_prefill_row(name, path):
    """A one-token chunk runs as a decode row (the fused write-and-decode natively; under
    ``schedule_invariant`` the prefill kernel): its output must be the bits the row gets
    inside a longer prefill."""
    _check_schedules(name, path, [([5, 6, 30, 45], False), ([44, 45], False)])


@pytest.mark.parametrize("name", FORMATS)
def test_fused_decode_writes_the_reference_bytes(name):
    """A decode-only step through write_and_attend (natively: one fused call per layer)."""
    case = Case(name, [1, 1, 1], [1, BS + 1, 40])
    md, rows = _step_metadata(case)
    want_k, want_v = case.kc.copy(), case.vc.copy()
    kc, vc = torch.from_numpy(case.kc.copy()), torch.from_numpy(case.vc.copy())
    for cache in (want_k, want_v, kc.numpy(), vc.numpy()):  # forget the step's rows
        codes, scales = kv_quant.block_views(cache, case.fmt.kv_format, BS, KV_HEADS, HEAD_DIM)
        slots = md.slot_mapping
        codes[slots // BS, slots % BS], scales[slots // BS, slots % BS] = 0, 0
    write_kv_reference(want_k, want_v, case.k[rows], case.v[rows], md.slot_mapping, case.fmt)
    cpu_md = prepare_cpu_attention_metadata(case.qsl, case.seq_lens, case.tables, slot_mapping=md.slot_mapping)
    for _, choice in _cpu_choices(name):
        out = CPUAttention(choice, case.fmt).kernels(torch.from_numpy(case.q), kc, vc).write_and_attend(
            torch.from_numpy(case.q), torch.from_numpy(case.k[rows]), torch.from_numpy(case.v[rows]), kc, vc, cpu_md,
            LayerCall(SCALE, sinks=case.sinks))
        assert np.array_equal(kc.numpy(), want_k) and np.array_equal(vc.numpy(), want_v)
        np.testing.assert_allclose(out.numpy(), case.reference(sinks=case.sinks), rtol=1e-4, atol=2e-5)


def test_padding_behind_the_window_is_never_read():
    """A sliding-window group's tables hold padding (block 0) for blocks behind the window;
    block 0 holds bytes that dequantize to NaN here. The torch path zeroes what it cannot see."""
    case = Case("fp8_e4m3", [1, 9], [60, 41])
    want = case.reference(sliding_window=7)
    kc, vc = torch.from_numpy(case.kc.copy()), torch.from_numpy(case.vc.copy())
    kc[0], vc[0] = 0xFF, 0xFF  # E4M3 0xFF is NaN
    tables = case.tables.copy()
    tables[0, :3] = 0  # positions 0..47: behind the decode row's window (53..59)
    tables[1, :1] = 0  # positions 0..15: behind the window of the prefill's first row (32)
    for label, choice in _cpu_choices("fp8_e4m3"):
        got = paged_attention_cpu(torch.from_numpy(case.q), kc, vc, case.qsl, case.seq_lens, tables, SCALE,
                                  sliding_window=7, decode_backend=choice.decode_backend,
                                  prefill_backend=choice.prefill_backend, cache_format=case.fmt)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=2e-5, err_msg=label)


# --- backends -----------------------------------------------------------------------------------------------


def _step_metadata(case: Case) -> tuple[StepMetadata, np.ndarray]:
    """The case's last step (each sequence's query rows) as a ``StepMetadata``, and the
    case's K/V rows it writes."""
    q_lens, lens = np.diff(case.qsl), case.seq_lens.astype(np.int64)
    firsts = np.cumsum(lens) - lens  # each sequence's first row of the case's K/V
    rows = np.concatenate([np.arange(f + s - n, f + s) for f, n, s in zip(firsts, q_lens, lens)])
    empty = np.zeros(0, np.int64)
    md = StepMetadata(input_ids=np.zeros(len(rows), np.int64), positions=empty, slot_mapping=case.slots[rows],
                      query_start_loc=case.qsl, seq_lens=case.seq_lens, num_computed_tokens=case.seq_lens - q_lens,
                      block_tables=case.tables, logits_indices=empty, sample_seq_indices=empty,
                      block_copies=np.zeros((0, 2), np.int64), block_size=BS,
                      num_decodes=int(np.argmax(q_lens != 1)) if (q_lens != 1).any() else len(q_lens))
    return md, rows


@pytest.mark.parametrize("name", FORMATS)
def test_backends_write_and_attend_quantized_caches(name):
    """select_backend hands the format over; the reference and CPU backends write the same
    bytes and attend alike (the reference backend on the uint8 buffers themselves)."""
    case = Case(name, *MIXED)
    md, rows = _step_metadata(case)
    k, v = torch.from_numpy(case.k[rows]), torch.from_numpy(case.v[rows])
    want_k, want_v = np.zeros_like(case.kc), np.zeros_like(case.vc)
    write_kv_reference(want_k, want_v, case.k[rows], case.v[rows], md.slot_mapping, case.fmt)
    outs = []
    for backend_name in ("reference", "cpu"):
        backend = select_backend(backend_name, torch.device("cpu"), case.fmt)
        assert backend.cache_format == case.fmt
        if isinstance(backend, RotatedBackend):  # fp8 and int4 store heads rotated: tests/test_kv_rotation.py
            backend = backend.inner
        kc, vc = torch.zeros(case.kc.shape, dtype=torch.uint8), torch.zeros(case.vc.shape, dtype=torch.uint8)
        prepared = backend.prepare(md)
        backend.write_kv(kc, vc, k, v, prepared)
        assert np.array_equal(kc.numpy(), want_k) and np.array_equal(vc.numpy(), want_v)
        # attend over the case's caches (the earlier context included)
        full_k, full_v = torch.from_numpy(case.kc.copy()), torch.from_numpy(case.vc.copy())
        outs.append(backend.attention(torch.from_numpy(case.q), full_k, full_v, prepared, SCALE, None, None, None))
    np.testing.assert_array_equal(outs[0].numpy(), case.reference())
    np.testing.assert_allclose(outs[1].numpy(), outs[0].numpy(), rtol=1e-4, atol=2e-5)


def test_select_backend_passes_the_format_only_when_quantized(monkeypatch):
    monkeypatch.setitem(attention_backends._REGISTRY, "test-device-only", lambda device: "made")
    assert select_backend("test-device-only", torch.device("cpu")) == "made"
    assert select_backend("test-device-only", torch.device("cpu"), cache_format("bfloat16")) == "made"
    with pytest.raises(ValueError, match="cannot read kv_cache_dtype int8"):
        select_backend("test-device-only", torch.device("cpu"), cache_format("int8"))
    assert isinstance(select_backend("auto", torch.device("cpu"), cache_format("int8")), CpuBackend)
    assert isinstance(select_backend("reference", torch.device("cpu"), cache_format("int8")), ReferenceBackend)
    assert isinstance(select_backend("auto", torch.device("cpu"), cache_format("int4")).inner, CpuBackend)
    assert select_backend("cpu", torch.device("cpu"), cache_format("float16")).cache_format is None


def test_bad_format_and_buffer_combinations_raise_one_line():
    fmt = cache_format("int8")
    q = torch.zeros((1, HEADS, HEAD_DIM))
    kc = torch.zeros(fmt.kv_format.buffer_shape(4, BS, KV_HEADS, HEAD_DIM), dtype=torch.uint8)
    float_kc = torch.zeros((4, BS, KV_HEADS, HEAD_DIM))
    mla_v = torch.zeros(fmt.kv_format.buffer_shape(4, BS, KV_HEADS, 32), dtype=torch.uint8)
    md = prepare_cpu_attention_metadata([0, 1], [1], [[1]])
    cases = [
        (lambda: paged_attention_cpu(q, float_kc, float_kc, metadata=md, scaling=1.0, cache_format=fmt), "uint8"),
        (lambda: paged_attention_cpu(q, kc, kc, metadata=md, scaling=1.0), "cache_format"),
        (lambda: paged_attention_cpu(q, kc, mla_v, metadata=md, scaling=1.0, cache_format=fmt), "one shape"),
        (lambda: paged_attention_reference(q.numpy(), kc.numpy(), mla_v.numpy(), [0, 1], [1], [[1]], 1.0,
                                           cache_format=fmt), "one shape"),
        (lambda: paged_attention_cpu(torch.zeros((1, HEADS, 48)), kc, kc, metadata=md, scaling=1.0,
                                     cache_format=fmt), "does not hold rows"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            call()
        assert "\n" not in str(info.value)
