"""The native CPU kernels (``kvpage.kernels.native_cpu``): decode attention and KV row
stores against the numpy reference, the fused write-and-attend path against the separate
calls, the fallbacks, and the claim that they run on torch's OpenMP pool."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numba")

from kvpage.attention import paged_attention_reference  # noqa: E402
from kvpage.kernels import native_cpu  # noqa: E402
from kvpage.attention.cpu import paged_attention_cpu, write_and_attend_cpu, write_kv_cpu  # noqa: E402
from kvpage.attention.cpu_metadata import prepare_cpu_attention_metadata  # noqa: E402

pytestmark = pytest.mark.skipif(native_cpu.library() is None,
                                reason="native kernels unavailable here (no AVX-512F or AVX2, or no C++ compiler)")

BS = 16
TOL = {torch.float32: (3e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 1.6e-2)}


def decode_case(g, seq_lens, heads, kv_heads, head_dim, dtype, spare_blocks=3, block_size=BS):
    """Caches with each sequence's blocks shuffled over the pool; block 0 (table padding)
    and every slot past a context hold NaN, so reading one shows in the output."""
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks) + spare_blocks
    kc = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = np.zeros((len(seq_lens), max(blocks) + 1), np.int32)
    for i, (n, s) in enumerate(zip(blocks, seq_lens)):
        tables[i, :n] = ids[:n]
        ids = ids[n:]
        for t in range(s):
            kc[tables[i, t // block_size], t % block_size] = torch.randn(kv_heads, head_dim, generator=g)
            vc[tables[i, t // block_size], t % block_size] = torch.randn(kv_heads, head_dim, generator=g)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=g)
    return q.to(dtype), kc.to(dtype), vc.to(dtype), np.asarray(seq_lens, np.int32), tables


def reference(q, kc, vc, lens, tables, **opts):
    qsl = np.arange(len(lens) + 1, dtype=np.int32)
    return paged_attention_reference(q.float().numpy(), kc.float().numpy(), vc.float().numpy(), qsl, lens, tables,
                                     0.125, **opts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 1, 128), (4, 4, 80), (14, 2, 32), (2, 1, 256)],
                         ids=["gqa3-64", "mqa-128", "mha-80", "group7-32", "wide-256"])
@pytest.mark.parametrize("option", ["plain", "window", "softcap", "sinks"])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_matches_reference(dtype, heads, kv_heads, head_dim, option, splits):
    """Head sizes with and without unrolled kernels (64/128 vs the rest), bf16 with head
    sizes on and off the bf16-dot path (80 is not a multiple of 32), groups larger than the
    register-held rows, partitions (contexts past 64 tokens) and context splits."""
    g = torch.Generator().manual_seed(heads * head_dim + splits)
    q, kc, vc, lens, tables = decode_case(g, [1, BS - 1, BS + 1, 70, 150], heads, kv_heads, head_dim, dtype)
    opts = {"window": {"sliding_window": 37}, "softcap": {"softcap": 3.0},
            "sinks": {"sinks": torch.randn(heads, generator=g).numpy()}}.get(option, {})
    out = torch.empty_like(q)
    sinks = opts.get("sinks")
    native_cpu.decode_attention(native_cpu.library(), str(dtype).split(".")[1], q.data_ptr(), q.stride()[:2],
                                kc.data_ptr(), vc.data_ptr(), tuple(kc.shape), heads, tables, lens, len(lens), 0.125,
                                opts.get("sliding_window", 0), opts.get("softcap", 0.0), sinks, out.data_ptr(), splits,
                                2)
    atol, rtol = TOL[dtype]
    np.testing.assert_allclose(out.float().numpy(), reference(q, kc, vc, lens, tables, **opts), atol=atol, rtol=rtol)


def test_decode_refuses_shapes_it_does_not_take():
    assert not native_cpu.decode_supported(72, 8, 2, "bfloat16")  # not a multiple of 16
    assert not native_cpu.decode_supported(512, 8, 2, "float32")  # wider than the kernel
    assert not native_cpu.decode_supported(64, 6, 4, "float32")  # heads not a multiple of KV heads
    assert not native_cpu.decode_supported(64, 8, 2, "float64")
    assert native_cpu.decode_supported(64, 9, 3, "bfloat16")
    q = torch.zeros(1, 8, 72)
    kc = torch.zeros(2, BS, 2, 72)
    with pytest.raises(ValueError, match="refused head_dim 72"):
        native_cpu.decode_attention(native_cpu.library(), "float32", q.data_ptr(), q.stride()[:2], kc.data_ptr(),
                                    kc.data_ptr(), tuple(kc.shape), 8, np.zeros((1, 1), np.int32),
                                    np.ones(1, np.int32), 1, 1.0, 0, 0.0, None, q.data_ptr(), 1, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("write", [True, False])
def test_write_and_attend_equals_the_separate_calls(dtype, write):
    """The fused decode path writes the same cache bytes and returns what write_kv_cpu then
    paged_attention_cpu on numba return; with write=False it only reads. K/V rows come as
    the strided views the HF attention hands over ([1, H, T, D] transposed)."""
    g = torch.Generator().manual_seed(11)
    lens = [5, 17, 40]
    q, kc, vc, lens_np, tables = decode_case(g, lens, 6, 2, 64, dtype)
    kc, vc = kc.nan_to_num(), vc.nan_to_num()
    slots = np.array([tables[i, (s - 1) // BS] * BS + (s - 1) % BS for i, s in enumerate(lens)], np.int64)
    k = torch.randn(1, 2, 3, 64, generator=g).to(dtype)[0].transpose(0, 1)  # [T, H_kv, D], not contiguous
    v = torch.randn(1, 2, 3, 64, generator=g).to(dtype)[0].transpose(0, 1)
    md = prepare_cpu_attention_metadata(np.arange(4), lens_np, tables, slot_mapping=slots, num_decodes=3)
    want_k, want_v = kc.clone(), vc.clone()
    if write:
        write_kv_cpu(want_k, want_v, k, v, metadata=md)
    want = paged_attention_cpu(q, want_k, want_v, scaling=0.125, metadata=md, decode_backend="numba")
    got = write_and_attend_cpu(q, k, v, kc, vc, 0.125, metadata=md, write=write)
    assert got.dtype == dtype and got.shape == q.shape
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def test_fused_slot_outside_the_cache_writes_nothing():
    g = torch.Generator().manual_seed(12)
    q, kc, vc, lens, tables = decode_case(g, [3, 4], 4, 2, 32, torch.float32)
    before_k, before_v = kc.clone(), vc.clone()
    k = torch.randn(2, 2, 32, generator=g)
    md = prepare_cpu_attention_metadata(np.arange(3), lens, tables, slot_mapping=np.array([1, kc.shape[0] * BS]),
                                        num_decodes=2)
    with pytest.raises(IndexError, match="outside the cache"):
        write_and_attend_cpu(q, k, k, kc, vc, 0.125, metadata=md)
    assert torch.equal(kc.nan_to_num(7.0), before_k.nan_to_num(7.0))
    assert torch.equal(vc.nan_to_num(7.0), before_v.nan_to_num(7.0))


def test_steps_with_prefills_fall_back_and_agree():
    """A step with a prefill row does not fit the fused call: it takes write_kv_cpu and the
    dispatcher (native decode rows, torch prefill rows) and matches the reference."""
    g = torch.Generator().manual_seed(13)
    _, kc, vc, lens, tables = decode_case(g, [9, 20], 4, 2, 32, torch.float32)
    q = torch.randn(1 + 6, 4, 32, generator=g)  # sequence 0 decodes, sequence 1 prefills its last 6 tokens
    qsl = np.array([0, 1, 7], np.int32)
    md = prepare_cpu_attention_metadata(qsl, lens, tables, slot_mapping=np.zeros(0, np.int64), num_decodes=1)
    got = write_and_attend_cpu(q, None, None, kc, vc, 0.125, metadata=md, write=False)
    want = paged_attention_reference(q.numpy(), kc.numpy(), vc.numpy(), qsl, lens, tables, 0.125)
    np.testing.assert_allclose(got.numpy(), want, atol=3e-5, rtol=1e-5)


def test_disabled_or_unbuildable_means_none(monkeypatch, tmp_path, caplog):
    native_cpu.library.cache_clear()
    try:
        monkeypatch.setenv("KVPAGE_NATIVE_KERNELS", "0")
        assert native_cpu.library() is None
        native_cpu.library.cache_clear()
        monkeypatch.delenv("KVPAGE_NATIVE_KERNELS")
        monkeypatch.setenv("KVPAGE_CACHE", str(tmp_path))
        monkeypatch.setenv("CXX", sys.executable)  # not a compiler: the build fails
        with caplog.at_level("WARNING", logger="kvpage"):
            assert native_cpu.library() is None
        assert "did not build" in caplog.text
    finally:
        monkeypatch.undo()
        native_cpu.library.cache_clear()
    assert native_cpu.library() is not None


AVX512_FLAGS = "flags : fpu avx avx2 fma f16c avx512f avx512bw"
AVX2_FLAGS = "flags : fpu avx avx2 fma f16c"


@pytest.mark.parametrize("flags,setting,want", [
    (AVX512_FLAGS, "1", "avx512"), (AVX2_FLAGS, "1", "avx2"), (AVX512_FLAGS, "avx2", "avx2"),
    (AVX2_FLAGS, "avx512", None), (AVX512_FLAGS, "0", None), ("flags : fpu avx avx2", "1", None),
    ("", "1", None)])
def test_variant_follows_the_cpu_and_the_setting(monkeypatch, flags, setting, want):
    """The best variant whose instructions the CPU has; ``KVPAGE_NATIVE_KERNELS`` names one
    (never one the CPU cannot run) or turns both off; AVX2 without FMA/F16C gets neither."""
    monkeypatch.setattr(native_cpu, "_cpu_flags", lambda: flags)
    monkeypatch.setenv("KVPAGE_NATIVE_KERNELS", setting)
    assert native_cpu.variant() == want


def test_avx2_variant_passes_the_same_cases_on_avx512_cpus():
    """Where the AVX-512 variant serves, the AVX2 one (what AVX2-only CPUs run) still passes
    this file's reference cases (a child process: the variant is chosen once per process)."""
    if native_cpu.variant() != "avx512":
        pytest.skip("the in-process cases already run the AVX2 variant here")
    env = {**os.environ, "KVPAGE_NATIVE_KERNELS": "avx2"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "matches_reference or argmax or write_and_attend or outside_the_cache or fall_back"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:]
    assert " passed" in out.stdout, out.stdout[-500:]


def test_numba_paths_serve_when_the_library_is_missing(monkeypatch):
    """Without the native library the same calls run on numba and agree with the reference."""
    monkeypatch.setattr(native_cpu, "library", lambda: None)
    g = torch.Generator().manual_seed(14)
    q, kc, vc, lens, tables = decode_case(g, [7, 33], 4, 2, 32, torch.float32)
    kc, vc = kc.nan_to_num(), vc.nan_to_num()
    slots = np.array([tables[0, 0] * BS + 6, tables[1, 2] * BS], np.int64)
    k = torch.randn(2, 2, 32, generator=g)
    md = prepare_cpu_attention_metadata(np.arange(3), lens, tables, slot_mapping=slots, num_decodes=2)
    got = write_and_attend_cpu(q, k, k, kc, vc, 0.125, metadata=md)
    assert torch.equal(kc.view(-1, 2, 32)[slots], k) and torch.equal(vc.view(-1, 2, 32)[slots], k)
    np.testing.assert_allclose(got.numpy(), reference(q, kc, vc, lens, tables), atol=3e-5, rtol=1e-5)


def test_kernels_share_torchs_openmp_runtime():
    """Loading the library and running it after torch adds no OpenMP runtime: it binds the
    libgomp torch loaded (numba's parallel loops bring a second copy)."""
    script = """
import numpy as np, torch
from kvpage.platform.threads import loaded_openmp_runtimes
torch.ones(64, 64) @ torch.ones(64, 64)
before = loaded_openmp_runtimes()
from kvpage.kernels import native_cpu
lib = native_cpu.library()
q = torch.zeros(1, 2, 32); kc = torch.zeros(1, 16, 1, 32)
native_cpu.decode_attention(lib, "float32", q.data_ptr(), q.stride()[:2], kc.data_ptr(), kc.data_ptr(),
                            tuple(kc.shape), 2, np.zeros((1, 1), np.int32), np.ones(1, np.int32), 1, 1.0, 0, 0.0,
                            None, q.data_ptr(), 1, 2)
print(before == loaded_openmp_runtimes(), len(before))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "1"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 1, 128), (4, 4, 80), (14, 2, 32),
                                                     (2, 1, 256)],
                         ids=["gqa3-64", "mqa-128", "mha-80", "group7-32", "wide-256"])
@pytest.mark.parametrize("option", ["plain", "window", "softcap", "sinks"])
@pytest.mark.parametrize("block_size", [16, 8, 32])
def test_prefill_matches_reference(dtype, heads, kv_heads, head_dim, option, block_size):
    """Whole prompts, chunks over a cached prefix, a prefix hit with one new token, an empty
    query and decode rows before them (left to the decode kernel: the prefill call must not
    touch their output rows); contexts past one 64-key softmax chunk, block sizes that
    split or span its 16-key groups; every slot outside a context is NaN."""
    g = torch.Generator().manual_seed(heads + head_dim)
    seq_lens = [9, 30, 7, 16, 33, 41, 150, 5]
    q_lens = [1, 1, 7, 16, 33, 9, 117, 0]  # two decodes, then prefills of every kind
    _, kc, vc, lens, tables = decode_case(g, seq_lens, heads, kv_heads, head_dim, dtype, block_size=block_size)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = torch.randn(int(qsl[-1]), heads, head_dim, generator=g).to(dtype)
    opts = {"window": {"sliding_window": 11}, "softcap": {"softcap": 3.0},
            "sinks": {"sinks": torch.randn(heads, generator=g).numpy()}}.get(option, {})
    out = torch.full_like(q, 5.0)
    native_cpu.prefill_attention(native_cpu.library(), str(dtype).split(".")[1], q.data_ptr(), q.stride()[:2],
                                 kc.data_ptr(), vc.data_ptr(), tuple(kc.shape), heads, tables, qsl, lens, 2, 0.125,
                                 opts.get("sliding_window", 0), opts.get("softcap", 0.0), opts.get("sinks"),
                                 out.data_ptr(), 2)
    assert bool((out[:2] == 5.0).all())
    want = paged_attention_reference(q.float().numpy(), kc.float().numpy(), vc.float().numpy(), qsl, lens, tables,
                                      0.125, **opts)
    atol, rtol = TOL[dtype]
    np.testing.assert_allclose(out[2:].float().numpy(), want[2:], atol=atol, rtol=rtol)


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def test_bf16_prefill_takes_amx_where_the_cpu_has_it():
    """bf16 prefill of head size 64/128/256 runs on the AMX tiles exactly when the CPU has
    AMX-BF16 (Linux grants the tile state to any process that asks); other element types
    and head sizes never do."""
    lib = native_cpu.library()
    has_amx = {"amx_bf16", "amx_tile", "avx512_bf16"} <= _cpu_flags()
    for head_dim in (64, 128, 256):
        assert native_cpu.prefill_uses_amx(lib, "bfloat16", head_dim) == has_amx
    for dtype, head_dim in (("float32", 64), ("float16", 128), ("bfloat16", 80), ("bfloat16", 32)):
        assert not native_cpu.prefill_uses_amx(lib, dtype, head_dim)


def test_bf16_prefill_without_amx_matches_reference():
    """``KVPAGE_AMX=0`` puts bf16 prefill back on the AVX-512 path (a process-wide choice,
    hence a child process), and that path passes the same reference cases as the AMX one."""
    if not native_cpu.prefill_uses_amx(native_cpu.library(), "bfloat16", 64):
        pytest.skip("no AMX here: the in-process cases already run the vector path")
    check = "from kvpage.kernels import native_cpu as n; assert not n.prefill_uses_amx(n.library(), 'bfloat16', 64)"
    env = {**os.environ, "KVPAGE_AMX": "0"}
    out = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "test_prefill_matches_reference and bfloat16 and (64 or 128 or 256)"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout.splitlines()[-1], out.stdout[-500:]


@pytest.mark.parametrize("cols", [1, 15, 16, 17, 49152])
@pytest.mark.parametrize("strided", [False, True])
def test_row_argmax_is_torch_max(cols, strided):
    """Value and first index of each row's maximum, as ``torch.max(dim=-1)``: ties, rows of
    -inf, NaN (first NaN wins) and +inf, contiguous and row-strided."""
    from kvpage.engine.sampler import _row_max_argmax
    g = torch.Generator().manual_seed(cols)
    full = torch.randint(-3, 4, (9, cols + 5 * strided), generator=g).float()  # small ints: many ties
    x = full[:, :cols]
    x[0] = float("-inf")
    x[1, cols // 2] = float("inf")
    x[2, cols - 1] = float("nan")
    x[3, cols // 3] = float("nan")
    x[3, -1] = float("nan")
    x[4, :] = 2.0
    row_max, index = _row_max_argmax(x)
    want_max, want_index = x.max(dim=-1)
    assert torch.equal(index, want_index)
    assert torch.allclose(row_max, want_max, equal_nan=True)


def test_sampler_greedy_tokens_without_the_library(monkeypatch):
    """The sampler's argmax falls back to torch (and agrees) without the native library,
    and for logits the kernel does not take (float64, column-strided)."""
    from kvpage.engine.sampler import _row_max_argmax
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    native = _row_max_argmax(x)[1]
    assert torch.equal(_row_max_argmax(x.double())[1], native)
    assert torch.equal(_row_max_argmax(x.t().contiguous().t())[1], native)
    monkeypatch.setattr(native_cpu, "library", lambda: None)
    assert torch.equal(_row_max_argmax(x)[1], native)


def test_a_cpu_engine_loads_the_kernels_at_start_up():
    """The library is built (or loaded) while the engine starts, not inside the first request:
    a cold build is about 15 s of g++ on two cores."""
    from kvpage import LLM
    from tiny_models import char_tokenizer, tiny_model

    native_cpu.library.cache_clear()
    llm = LLM(tiny_model("llama"), tokenizer=char_tokenizer(), block_size=4, num_kv_blocks=16, max_model_len=32,
              exact=True)
    try:
        assert native_cpu.library.cache_info().currsize == 1  # before any generate
    finally:
        llm.restore()


def test_the_build_key_covers_every_header():
    """A header left out of ``_HEADERS`` would not change the build's cache key, so an edit to
    it would keep serving the library built before the edit."""
    here = Path(native_cpu.__file__).parent
    assert set(native_cpu._HEADERS) == set(here.glob("*.h"))
