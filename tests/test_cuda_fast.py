"""The fast decode kernel (``kvpage.cuda.decode_fast``): static checks, simulator runs, real GPU.

* Split sizing (``fast_launch.fast_decode_splits``): pure arithmetic, checked here.
* Dispatch (``fast_dispatch.use_fast_decode``): which kernel a call gets, and why not the fast one.
* Simulator (this file run as a script with ``NUMBA_ENABLE_CUDASIM=1``): the kernel itself, its
  16-byte loads, bit casts and shuffles swapped for numpy stand-ins, on tiny batches against
  ``paged_attention_reference`` (ragged lengths, split-K with the folded merge, windows,
  softcap, sinks, fp16 and bf16, block sizes that do and do not divide a warp's keys); and
  ``kvpage.cuda.paged_attention(..., decode_kernel="fast")`` end to end on mixed batches
  (decodes + prefills: bit views, splits, the reused scratch and counters, the merge).
* PTX/ptxas: ``tests/test_cuda_ptx.py`` (the variants that decide each rule); the variants over
  int8/fp8 caches (``fast_rows``): ``tests/test_cuda_quant.py`` and ``cuda_quant_cases.py``.
* Real GPU (``gpu`` marker, skipped without CuPy and a device): realistic shapes.
"""
from __future__ import annotations

import json
import sys
import time
import traceback

import numpy as np
import pytest

from kvpage.attention.reference import paged_attention_reference
from kvpage.cuda.fast_launch import (FAST_BLOCKS_PER_SM, FAST_MAX_SPLITS, FAST_MIN_PARTITION, MIN_WAVES, FastScratch,
                                     FastSplits, fast_decode_splits, launch_fast_decode, register_budget,
                                     scratch_shapes, split_ranges)

H200_SMS = 132
TOL = {"fp16": dict(rtol=3e-3, atol=2e-3), "bf16": dict(rtol=2e-2, atol=2e-2)}


# --- Split sizing ---

@pytest.mark.parametrize("num_seqs,num_kv_heads,context,block_size",
                         [(32, 8, 4096, 16), (32, 8, 16384, 16), (32, 1, 4096, 16), (1, 8, 131072, 16),
                          (4, 2, 1000, 4), (64, 8, 300, 16), (1, 1, 1, 16), (8, 4, 5000, 1)])
@pytest.mark.parametrize("group", sorted(FAST_BLOCKS_PER_SM))
def test_split_sizing_covers_every_key_once(num_seqs, num_kv_heads, context, block_size, group) -> None:
    blocks_per_sm = FAST_BLOCKS_PER_SM[group]
    splits = fast_decode_splits(num_seqs, num_kv_heads, context, H200_SMS, block_size, blocks_per_sm)
    assert splits.partition % block_size == 0
    assert 1 <= splits.num_splits <= FAST_MAX_SPLITS
    assert splits.num_splits * splits.partition >= context > (splits.num_splits - 1) * splits.partition
    if splits.num_splits > 1:
        assert splits.partition >= FAST_MIN_PARTITION - block_size
    wave = H200_SMS * blocks_per_sm
    blocks = num_seqs * num_kv_heads * splits.num_splits
    room = min(FAST_MAX_SPLITS, context // FAST_MIN_PARTITION)  # splits the context allows
    if num_seqs * num_kv_heads * room >= MIN_WAVES * wave:
        assert blocks >= MIN_WAVES * wave, "the context allows two full waves but the grid is smaller"
    for window in (0, 700):
        covered = [k for lo, hi in split_ranges(context, window, splits) for k in range(lo, hi)]
        lo = max(0, context - window) if window else 0
        assert covered == list(range(lo, context))


def test_split_sizing_target_shape() -> None:
    """Batch 32 x 8 kv heads, 4k context, group 4 on an H200: several waves, long partitions."""
    splits = fast_decode_splits(32, 8, 4096, H200_SMS, 16, FAST_BLOCKS_PER_SM[4])
    blocks = 32 * 8 * splits.num_splits
    wave = H200_SMS * FAST_BLOCKS_PER_SM[4]
    assert blocks >= 2 * wave and blocks / (-(-blocks // wave) * wave) > 0.9
    assert splits.partition >= 512


def test_register_budgets() -> None:
    assert [register_budget(g) for g in (1, 4, 8)] == [128, 168, 255]


@pytest.mark.parametrize("group", sorted(FAST_BLOCKS_PER_SM))
def test_8bit_steps_keep_loads_in_flight(group: int) -> None:
    """An 8-bit row slice is half a 16-bit one (8 bytes, plus its scale), an int4 one a quarter:
    their variants take at least as many steps per iteration, so no fewer rows (at most as
    many bytes) are in flight."""
    from kvpage.cuda.fast_launch import FAST_QUANT_DTYPES, fast_supported, fast_unroll

    for dt in FAST_QUANT_DTYPES:
        assert fast_supported(128, group, dt) and fast_supported(64, group, dt)
        assert fast_unroll(group, "fp16") <= fast_unroll(group, dt) <= 2 * fast_unroll(group, "fp16")
    assert "int4" in FAST_QUANT_DTYPES and not fast_supported(128, group, "int2")


# --- Simulator: the kernel itself on tiny batches (this file as a script) ---

def _to_bits(x: np.ndarray, kv_dtype: str) -> np.ndarray:
    """Float values as 16-bit words (bf16: values already exact in bf16)."""
    if kv_dtype == "fp16":
        return x.astype(np.float16).view(np.uint16)
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _from_bits(bits: np.ndarray, kv_dtype: str) -> np.ndarray:
    if kv_dtype == "fp16":
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def make_batch(lens, num_heads, num_kv_heads, head_dim, kv_dtype, block_size, seed=0) -> dict:
    """A decode batch (one query token per sequence) of values exact in ``kv_dtype``."""
    rng = np.random.default_rng(seed)
    seq_lens = np.array(lens, np.int32)
    per_seq = -(-seq_lens // block_size)
    num_blocks = int(per_seq.sum()) + 3
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = np.zeros((len(lens), int(per_seq.max())), np.int32)
    used = 0
    for i, n in enumerate(per_seq.tolist()):
        tables[i, :n] = perm[used:used + n]
        used += n

    def values(shape):
        return _from_bits(_to_bits(rng.standard_normal(shape).astype(np.float32), kv_dtype), kv_dtype)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return dict(q=values((len(lens), num_heads, head_dim)), key_cache=values(shape), value_cache=values(shape),
                query_start_loc=np.arange(len(lens) + 1, dtype=np.int32), seq_lens=seq_lens, block_tables=tables)


def run_fast(batch: dict, kv_dtype: str, splits: FastSplits, window=0, softcap=0.0, sinks=None, simulate=True,
             scaling=0.125) -> np.ndarray:
    """The fast kernel on host arrays (simulator) or CuPy arrays (GPU); returns fp32 host output."""
    from kvpage.cuda.decode_fast import fast_decode_kernel

    xp = np
    if not simulate:
        import cupy as xp
    num_tokens, num_heads, head_dim = batch["q"].shape
    num_kv_heads = batch["key_cache"].shape[2]
    bits = tuple(xp.asarray(_to_bits(batch[k], kv_dtype)).view(xp.uint32) for k in ("q", "key_cache", "value_cache"))
    meta = tuple(xp.asarray(batch[k]) for k in ("query_start_loc", "seq_lens", "block_tables"))
    shapes = scratch_shapes(num_tokens, num_heads, head_dim, len(batch["seq_lens"]), num_kv_heads, splits)
    scratch = FastScratch(xp.full(shapes["part_max"], np.nan, np.float32), xp.zeros(shapes["part_sum"], np.float32),
                          xp.zeros(shapes["part_acc"], np.float32), xp.zeros(shapes["counters"], np.int32),
                          xp.asarray(sinks if sinks is not None else np.zeros(1), dtype=np.float32))
    out = xp.zeros((num_tokens, num_heads, head_dim), np.uint16)
    kernel = fast_decode_kernel(head_dim, num_heads // num_kv_heads, kv_dtype, simulate)
    launch_fast_decode(kernel, bits, meta, scaling, window, softcap, sinks is not None, splits, out, scratch)
    counters = scratch.counters if simulate else scratch.counters.get()
    assert not np.any(counters), "the kernel must leave its counters at zero"
    return _from_bits(out if simulate else out.get(), kv_dtype)


def check_against_reference(batch: dict, kv_dtype: str, splits: FastSplits, window=0, softcap=0.0, sinks=None,
                            simulate=True) -> float:
    out = run_fast(batch, kv_dtype, splits, window, softcap, sinks, simulate)
    ref = paged_attention_reference(**batch, scaling=0.125, sliding_window=window or None, softcap=softcap or None,
                                    sinks=sinks).astype(np.float32)
    np.testing.assert_allclose(out, ref, **TOL[kv_dtype])
    return float(np.abs(out - ref).max())


SIM_CASES = {
    # name: (lens, heads, kv heads, head_dim, kv dtype, block size, splits, window, softcap, sinks).
    # A block covers 64 (head_dim 64) or 32 (128) keys per round of its 4 warps: contexts are
    # long enough for several rounds, so the online rescaling between rounds is exercised.
    "g4_d64_fp16_one_split": ([90, 5], 4, 1, 64, "fp16", 16, FastSplits(1, 96), 0, 0.0, False),
    "g4_d64_fp16_splitk": ([150, 3], 4, 1, 64, "fp16", 16, FastSplits(2, 80), 0, 0.0, False),
    "g1_d64_bf16_window_cap_sinks_bs4": ([150, 9], 2, 2, 64, "bf16", 4, FastSplits(2, 52), 100, 5.0, True),
    "g1_d128_fp16_sinks_one_split_bs4": ([100], 1, 1, 128, "fp16", 4, FastSplits(1, 100), 0, 0.0, True),
    "g1_d64_fp16_bs1_two_page_passes": ([530], 1, 1, 64, "fp16", 1, FastSplits(1, 530), 0, 0.0, False),
}


def _run_sim_case(name: str) -> float:
    lens, h, hkv, d, dt, bs, splits, window, cap, with_sinks = SIM_CASES[name]
    batch = make_batch(lens, h, hkv, d, dt, bs, seed=len(name))
    sinks = np.random.default_rng(7).standard_normal(h).astype(np.float32) if with_sinks else None
    return check_against_reference(batch, dt, splits, window, cap, sinks, simulate=True)


def make_mixed_batch(shapes, num_heads, num_kv_heads, head_dim, block_size, seed=0) -> dict:
    """A ragged fp16 batch: per sequence (query length, context length), decodes first."""
    rng = np.random.default_rng(seed)
    q_lens = np.array([s[0] for s in shapes], np.int32)
    batch = make_batch([s[1] for s in shapes], num_heads, num_kv_heads, head_dim, "fp16", block_size, seed)
    batch = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in batch.items()}
    batch["q"] = rng.standard_normal((int(q_lens.sum()), num_heads, head_dim)).astype(np.float16)
    batch["query_start_loc"] = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return batch


DISPATCH_CASES = {
    # name: ((query len, context) per sequence, heads, kv heads, head_dim, block size, num_splits,
    # window, softcap, sinks, sizes passed by the caller: the no-host-read path).
    "paged_g4_d64_mixed_auto_splits": ([(1, 66), (5, 12)], 4, 1, 64, 16, None, 0, 0.0, False, False),
    "paged_g1_d64_mixed_splitk_window_cap_sinks": ([(1, 120), (1, 33), (4, 20)], 2, 2, 64, 4, 3, 100, 5.0, True,
                                                   True),
    "paged_g4_d128_decodes_only_splitk": ([(1, 72), (1, 9)], 4, 1, 128, 8, 2, 0, 0.0, False, True),
}


def _run_dispatch_case(name: str) -> float:
    """``paged_attention(decode_kernel="fast")`` under the simulator against the reference."""
    from kvpage.cuda import paged_attention
    from kvpage.cuda.workspace import workspace

    shapes, h, hkv, d, bs, num_splits, window, cap, with_sinks, pass_sizes = DISPATCH_CASES[name]
    batch = make_mixed_batch(shapes, h, hkv, d, bs, seed=len(name))
    sinks = np.random.default_rng(5).standard_normal(h).astype(np.float32) if with_sinks else None
    num_decodes = sum(1 for q_len, _ in shapes if q_len == 1)
    sizes = {}
    if pass_sizes:
        sizes = dict(num_decodes=num_decodes, max_seq_len=max(c for _, c in shapes),
                     max_prefill_query_len=max([q for q, _ in shapes[num_decodes:]], default=0))
    flags = dict(scaling=0.125, sliding_window=window or None, softcap=cap or None, sinks=sinks)
    out = paged_attention(**batch, **flags, **sizes, num_splits=num_splits, decode_kernel="fast",
                          threads_per_block=16, kv_tile=4)
    assert out.dtype == np.float16 and out.shape == batch["q"].shape
    assert not np.any(workspace(None, 0).counters((num_decodes, hkv))), "counters must be left at zero"
    ref = paged_attention_reference(**batch, **flags).astype(np.float32)
    np.testing.assert_allclose(out.astype(np.float32), ref, **TOL["fp16"])
    return float(np.abs(out.astype(np.float32) - ref).max())


def _sim_case(case: tuple) -> dict:
    name, run = case
    t0 = time.time()
    try:
        err = run(name)
        row = {"name": name, "ok": True, "detail": f"max |err| {err:.2e}"}
    except Exception:  # reported to the parent test, which fails with the traceback
        row = {"name": name, "ok": False, "detail": traceback.format_exc()[-3000:]}
    row["seconds"] = round(time.time() - t0, 1)
    return row


def _sim_main() -> int:
    """Every simulator case, one JSON line each. The simulator runs a block's threads under one
    GIL, so the cases are spread over this machine's cores (at most 2: CI's share)."""
    import multiprocessing
    import os

    cases = [(name, _run_sim_case) for name in SIM_CASES] + [(name, _run_dispatch_case) for name in DISPATCH_CASES]
    workers = max(1, min(2, len(os.sched_getaffinity(0))))
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        for row in pool.imap_unordered(_sim_case, cases):
            print(json.dumps(row), flush=True)
    return 0


@pytest.fixture(scope="module")
def sim_rows() -> dict:
    pytest.importorskip("numba")
    from _cuda_subprocess import TESTS_DIR, run_json_lines

    rows = run_json_lines([str(TESTS_DIR / "test_cuda_fast.py"), "--sim"], {"NUMBA_ENABLE_CUDASIM": "1"},
                          timeout=900)
    return {row["name"]: row for row in rows}


@pytest.mark.parametrize("name", sorted(SIM_CASES) + sorted(DISPATCH_CASES))
def test_fast_kernel_in_simulator(sim_rows: dict, name: str) -> None:
    row = sim_rows[name]
    assert row["ok"], row["detail"]


# --- Dispatch decisions (no kernel runs) ---

def _decode_inputs(dtype=np.float16, head_dim=64, heads=4, kv_heads=1) -> dict:
    batch = make_mixed_batch([(1, 5), (1, 3)], heads, kv_heads, head_dim, 4)
    return {k: v.astype(dtype) if k in ("q", "key_cache", "value_cache") else v for k, v in batch.items()}


@pytest.mark.parametrize("over,match", [
    (dict(dtype=np.float32), "16-bit dtype"),
    (dict(head_dim=32), "no fast variant for head_dim 32"),
    (dict(heads=6, kv_heads=3), "group 2"),
])
def test_fast_mode_says_why_it_cannot_serve(over: dict, match: str) -> None:
    from kvpage.cuda import paged_attention

    with pytest.raises(ValueError, match=match):
        paged_attention(**_decode_inputs(**over), scaling=0.1, decode_kernel="fast")


def test_decode_kernel_modes() -> None:
    from kvpage.cuda import paged_attention
    from kvpage.cuda.fast_dispatch import fast_unsupported, use_fast_decode

    x = _decode_inputs()
    arrays = (x["q"], x["key_cache"], x["value_cache"])
    assert fast_unsupported(*arrays, 64, 4) is None
    assert use_fast_decode("reference", *arrays, 64, 4, False) is False
    with pytest.raises(ValueError, match="decode_kernel must be one of"):
        paged_attention(**x, scaling=0.1, decode_kernel="fastest")


# --- Real GPU ---

def _gpu_reason():
    from kvpage.cuda.interop import gpu_unavailable_reason

    return gpu_unavailable_reason()


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("group,head_dim", [(4, 128), (8, 128), (1, 64)])
def test_fast_kernel_on_gpu(kv_dtype: str, group: int, head_dim: int) -> None:
    reason = _gpu_reason()
    if reason is not None:
        pytest.skip(reason)
    from numba import cuda

    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    lens = [1, 15, 16, 17, 700, 2049, 4100, 129]
    batch = make_batch(lens, 4 * group, 4, head_dim, kv_dtype, 16, seed=group)
    sinks = np.random.default_rng(3).standard_normal(4 * group).astype(np.float32)
    for window, cap, with_sinks in ((0, 0.0, False), (512, 30.0, True)):
        context = min(max(lens), window) if window else max(lens)
        for splits in (fast_decode_splits(len(lens), 4, context, sms, 16, FAST_BLOCKS_PER_SM[group]),
                       FastSplits(1, -(-context // 16) * 16)):
            check_against_reference(batch, kv_dtype, splits, window, cap, sinks if with_sinks else None,
                                    simulate=False)



@pytest.mark.gpu
@pytest.mark.parametrize("library,kv_dtype,shapes", [
    ("cupy", "fp16", [(1, 3000), (1, 17), (1, 700), (1, 1), (40, 900)]),  # fast decodes + reference prefill
    ("torch", "fp16", [(1, 2049), (1, 16), (7, 300)]),
    ("torch", "bf16", [(1, 4100), (1, 15), (1, 129)]),  # bf16: decodes only
])
def test_paged_attention_picks_fast_on_gpu(library: str, kv_dtype: str, shapes: list) -> None:
    """``decode_kernel="auto"`` through the public wrapper, on the caller's arrays and stream."""
    reason = _gpu_reason()
    if reason is not None:
        pytest.skip(reason)
    xp = pytest.importorskip(library)
    if library == "torch" and not xp.cuda.is_available():
        pytest.skip("torch has no CUDA")
    from kvpage.cuda import paged_attention

    batch = make_mixed_batch(shapes, 16, 4, 128, 16, seed=9)
    if kv_dtype == "bf16":
        batch.update({k: v for k, v in make_batch([c for _, c in shapes], 16, 4, 128, "bf16", 16, 9).items()
                      if k in ("q", "key_cache", "value_cache")})
    if library == "cupy":
        dev = {k: xp.asarray(v) for k, v in batch.items()}
    else:
        dt = {"fp16": xp.float16, "bf16": xp.bfloat16}[kv_dtype]
        dev = {k: xp.as_tensor(v, device="cuda") for k, v in batch.items()}
        dev.update({k: dev[k].to(dt) for k in ("q", "key_cache", "value_cache")})
    out = paged_attention(**dev, scaling=0.088)
    host = out.get() if library == "cupy" else out.float().cpu().numpy()
    ref = paged_attention_reference(**batch, scaling=0.088).astype(np.float32)
    np.testing.assert_allclose(host.astype(np.float32), ref, **TOL[kv_dtype])

if __name__ == "__main__" and "--sim" in sys.argv:
    sys.exit(_sim_main())
