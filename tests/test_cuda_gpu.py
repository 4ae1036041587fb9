"""Numba CUDA kernels on a real GPU with CuPy (and torch, when it has CUDA) arrays.

Marked ``gpu``; skipped cleanly where CuPy or a device is missing. Realistic shapes
(head_dim 128, block_size 16, GQA 4, contexts up to ~3k) against the numpy reference.
"""
from __future__ import annotations


import numpy as np
import pytest

from kvpage.attention import paged_attention_reference, write_kv_reference
from kvpage.cuda.interop import gpu_unavailable_reason


_REASON = gpu_unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

BLOCK_SIZE = 16
TOL = {np.float32: dict(rtol=1e-4, atol=1e-4), np.float16: dict(rtol=3e-3, atol=2e-3)}


def _batch(shapes, h, hkv, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q_lens = np.array([s[0] for s in shapes], np.int32)
    seq_lens = np.array([s[1] for s in shapes], np.int32)
    per_seq = -(-seq_lens // BLOCK_SIZE)
    num_blocks = int(per_seq.sum()) + 8
    perm = rng.permutation(num_blocks)
    tables = np.zeros((len(shapes), int(per_seq.max())), np.int32)
    used = 0
    for i, n in enumerate(per_seq.tolist()):
        tables[i, :n] = perm[used:used + n]
        used += n
    shape = (num_blocks, BLOCK_SIZE, hkv, d)
    return dict(q=rng.standard_normal((int(q_lens.sum()), h, d)).astype(dtype),
                key_cache=rng.standard_normal(shape).astype(dtype),
                value_cache=rng.standard_normal(shape).astype(dtype),
                query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
                seq_lens=seq_lens, block_tables=tables)


def _on_device(host: dict) -> dict:
    import cupy

    return {k: cupy.asarray(v) if k in ("q", "key_cache", "value_cache") else v for k, v in host.items()}


def _check(host, dtype, num_splits=None, **kw):
    from kvpage.cuda import paged_attention

    out = paged_attention(**_on_device(host), scaling=0.088, num_splits=num_splits, **kw)
    ref = paged_attention_reference(**host, scaling=0.088, **kw)
    np.testing.assert_allclose(out.get().astype(np.float32), ref.astype(np.float32), **TOL[dtype])


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_decode_long_context_gqa(dtype, num_splits) -> None:
    lens = [1, 15, 16, 17, 700, 2049, 3000, 129]
    _check(_batch([(1, n) for n in lens], 32, 8, 128, dtype), dtype, num_splits=num_splits)


def test_decode_window_softcap_sinks_fp16() -> None:
    host = _batch([(1, n) for n in (5, 600, 2500)], 16, 4, 128, np.float16, seed=1)
    sinks = np.random.default_rng(2).standard_normal(16).astype(np.float32)
    _check(host, np.float16, sliding_window=512, softcap=30.0, sinks=sinks)


def test_mixed_prefill_with_prefix_hits_fp16() -> None:
    host = _batch([(1, 300), (1, 17), (37, 37), (100, 612), (16, 48)], 8, 2, 128, np.float16, seed=3)
    sinks = np.random.default_rng(4).standard_normal(8).astype(np.float32)
    _check(host, np.float16, sliding_window=128, softcap=20.0, sinks=sinks)


def test_head_dim_64_mha_fp32() -> None:
    _check(_batch([(1, 1000), (20, 20), (5, 70)], 4, 4, 64, np.float32, seed=5), np.float32)


def test_store_kv_cupy_fp16() -> None:
    import cupy

    from kvpage.cuda import store_kv

    rng = np.random.default_rng(6)
    shape = (32, BLOCK_SIZE, 8, 128)
    kc = rng.standard_normal(shape).astype(np.float16)
    vc = rng.standard_normal(shape).astype(np.float16)
    slots = rng.permutation(32 * BLOCK_SIZE)[:300].astype(np.int64)
    k = rng.standard_normal((300, 8, 128)).astype(np.float16)
    v = rng.standard_normal((300, 8, 128)).astype(np.float16)
    kd, vd = cupy.asarray(kc), cupy.asarray(vc)
    store_kv(kd, vd, cupy.asarray(k), cupy.asarray(v), cupy.asarray(slots))
    write_kv_reference(kc, vc, k, v, slots)
    np.testing.assert_array_equal(kd.get(), kc)
    np.testing.assert_array_equal(vd.get(), vc)


def test_runs_on_callers_cupy_stream() -> None:
    """Launch inside a non-default CuPy stream; results are ready once that stream syncs."""
    import cupy

    from kvpage.cuda import paged_attention

    host = _batch([(1, 2000)] * 4, 16, 4, 128, np.float16, seed=7)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        dev = _on_device(host)
        out = paged_attention(**dev, scaling=0.088)
        result = cupy.empty_like(out)
        # A memcpy on `stream`: it sees the finished output only if the kernels ran on `stream`.
        result.data.copy_from_device_async(out.data, out.nbytes, stream)
    stream.synchronize()
    ref = paged_attention_reference(**host, scaling=0.088)
    np.testing.assert_allclose(result.get().astype(np.float32), ref.astype(np.float32), **TOL[np.float16])


def test_torch_cuda_tensors() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA (CPU build)")
    from kvpage.cuda import paged_attention

    host = _batch([(1, 900), (7, 40)], 8, 2, 128, np.float16, seed=8)
    dev = {k: torch.from_numpy(v).cuda() if k in ("q", "key_cache", "value_cache") else v for k, v in host.items()}
    out = paged_attention(**dev, scaling=0.088)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16
    ref = paged_attention_reference(**host, scaling=0.088)
    np.testing.assert_allclose(out.float().cpu().numpy(), ref.astype(np.float32), **TOL[np.float16])
