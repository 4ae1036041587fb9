"""fp8 and int4 KV store heads rotated by an orthonormal Hadamard matrix (``kvpage.attention.kv_rotation``),
behind ``adapters.rotated_backend.RotatedBackend``: what it stores, what it returns, and why."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvpage.adapters.attention_backends import select_backend  # noqa: E402
from kvpage.adapters.rotated_backend import RotatedBackend  # noqa: E402
from kvpage.attention.kv_rotation import hadamard_rotation  # noqa: E402
from kvpage.core.kv_formats import CacheFormat, KVFormat  # noqa: E402
from kvpage.core.sched.metadata import StepMetadata  # noqa: E402
from kvpage.kernels.kv_quant import block_views, dequantize_rows, quantize_rows  # noqa: E402

BS, HKV, H, D = 4, 2, 4, 64


@pytest.mark.parametrize("head_dim, block", [(64, 64), (128, 128), (256, 128), (96, 32), (80, 16), (48, 16)])
def test_rotation_is_symmetric_orthonormal_and_block_diagonal(head_dim, block):
    r = hadamard_rotation(head_dim).astype(np.float64)
    np.testing.assert_allclose(r @ r.T, np.eye(head_dim), atol=1e-6)
    np.testing.assert_array_equal(r, r.T)
    nonzero = np.abs(r) > 0
    assert nonzero[:block, :block].all() and not nonzero[:block, block:].any()


def test_fp8_and_int4_rotate():
    assert [n for n in ("fp8_e4m3", "fp8_e5m2", "int8", "int4", "bfloat16") if KVFormat(n).rotated] == [
        "fp8_e4m3", "fp8_e5m2", "int4"]


def _decode_step(seq_len: int) -> StepMetadata:
    empty = np.zeros(0, np.int64)
    blocks = -(-seq_len // BS)
    return StepMetadata(input_ids=np.zeros(seq_len, np.int64), positions=empty, slot_mapping=np.arange(seq_len),
                        query_start_loc=np.array([0, seq_len], np.int32), seq_lens=np.array([seq_len], np.int32),
                        num_computed_tokens=np.zeros(1, np.int64), block_tables=np.arange(blocks, dtype=np.int32)[None],
                        logits_indices=empty, sample_seq_indices=empty, block_copies=np.zeros((0, 2), np.int64),
                        block_size=BS, num_decodes=0)


def _keys_with_an_outlier_channel(rng, n: int) -> np.ndarray:
    k = rng.standard_normal((n, HKV, D)).astype(np.float32)
    k[..., 5] *= 30.0  # keys have a few channels far larger than the rest
    return k


@pytest.mark.parametrize("backend_name", ["cpu", "reference"])
def test_the_backend_stores_rotated_rows_and_answers_in_the_original_basis(backend_name):
    rng = np.random.default_rng(0)
    n = 12
    fmt = CacheFormat(KVFormat("int4"), BS)
    backend = select_backend(backend_name, torch.device("cpu"), fmt)
    assert isinstance(backend, RotatedBackend) and backend.name == backend_name
    k, v = _keys_with_an_outlier_channel(rng, n), rng.standard_normal((n, HKV, D)).astype(np.float32)
    q = rng.standard_normal((n, H, D)).astype(np.float32)
    shape = fmt.kv_format.buffer_shape(4, BS, HKV, D)
    kc, vc = torch.zeros(shape, dtype=torch.uint8), torch.zeros(shape, dtype=torch.uint8)
    md = _decode_step(n)
    prepared = backend.prepare(md)
    backend.write_kv(kc, vc, torch.from_numpy(k), torch.from_numpy(v), prepared)
    codes, scales = block_views(kc.numpy(), fmt.kv_format, BS, HKV, D)
    want_codes, want_scales = quantize_rows(k @ hadamard_rotation(D), fmt.kv_format)
    np.testing.assert_array_equal(codes.reshape(-1, HKV, codes.shape[-1])[:n], want_codes)
    np.testing.assert_array_equal(scales.reshape(-1, HKV, scales.shape[-1])[:n], want_scales)

    out = backend.attention(torch.from_numpy(q), kc, vc, prepared, D ** -0.5, None, None, None).numpy()
    inner = backend.inner.attention(torch.from_numpy(q @ hadamard_rotation(D)), kc, vc, prepared, D ** -0.5,
                                    None, None, None).numpy()
    np.testing.assert_allclose(out, inner @ hadamard_rotation(D), rtol=1e-5, atol=1e-5)


def test_rotation_shrinks_int4_error_on_keys_with_outlier_channels():
    rng = np.random.default_rng(1)
    k = _keys_with_an_outlier_channel(rng, 256)
    fmt, r = KVFormat("int4"), hadamard_rotation(D)
    plain = dequantize_rows(*quantize_rows(k, fmt), fmt)
    rotated = dequantize_rows(*quantize_rows(k @ r, fmt), fmt) @ r.T
    # the error that matters is the scores': q . k over the head
    q = rng.standard_normal((256, D)).astype(np.float32)
    err = lambda approx: np.abs(np.einsum("td,thd->th", q, approx - k)).mean()  # noqa: E731
    assert err(rotated) < 0.5 * err(plain)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_rotation_shrinks_fp8_score_error_where_queries_share_the_outlier_channel(name):
    """fp8 keeps an exponent per value, yet its 2-3 mantissa bits round an outlier channel by
    an amount as large as the outlier; where the queries carry the same channel (as LLMs'
    do), that error dominates q . k, and rotation spreads it over the row."""
    rng = np.random.default_rng(2)
    k = _keys_with_an_outlier_channel(rng, 256)
    q = rng.standard_normal((256, D)).astype(np.float32)
    q[:, 5] *= 10.0
    fmt, r = KVFormat(name), hadamard_rotation(D)
    plain = dequantize_rows(*quantize_rows(k, fmt), fmt)
    rotated = dequantize_rows(*quantize_rows(k @ r, fmt), fmt) @ r.T
    err = lambda approx: np.abs(np.einsum("td,thd->th", q, approx - k)).mean()  # noqa: E731
    assert err(rotated) < 0.5 * err(plain)
