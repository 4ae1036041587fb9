"""Paged attention when K and V differ in shape (MLA: V's head smaller than K's; or head counts).

The oracle needs no new trust: attention with V zero-padded up to K's shape gives the same
output followed by zeros, and that case runs through the existing, tested paths (numba
included). The dispatcher must route the unequal layouts to torch (or the reference for
numpy inputs) and return ``[T, H, D_v]``.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvpage.attention import paged_attention_reference  # noqa: E402
from kvpage.attention.cpu import kv_layouts_differ, paged_attention_cpu  # noqa: E402
from kvpage.attention.cpu_metadata import prepare_cpu_attention_metadata  # noqa: E402
from kvpage.attention.torch_cpu import paged_attention_torch, write_kv_torch  # noqa: E402

BS = 4
SCALE = 0.2
Q_LENS, SEQ_LENS = [1, 1, 6, 3], [9, 2, 6, 11]  # two decodes, a prompt, a chunk over cached context


def _case(rng, heads=4, k_heads=2, k_dim=24, v_heads=2, v_dim=16):
    blocks = [-(-s // BS) for s in SEQ_LENS]
    num_blocks = 1 + sum(blocks)
    kc = rng.standard_normal((num_blocks, BS, k_heads, k_dim)).astype(np.float32)
    vc = rng.standard_normal((num_blocks, BS, v_heads, v_dim)).astype(np.float32)
    ids = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(SEQ_LENS), max(blocks)), np.int32)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = ids[start:start + n]
        start += n
    qsl = np.concatenate([[0], np.cumsum(Q_LENS)]).astype(np.int32)
    q = rng.standard_normal((int(qsl[-1]), heads, k_dim)).astype(np.float32)
    return q, kc, vc, qsl, np.asarray(SEQ_LENS, np.int32), tables


def _padded_oracle(q, kc, vc, qsl, lens, tables, **opts):
    """V zero-padded (heads repeated, head size padded) to K's shape, through the numba path."""
    heads = q.shape[1]
    k_heads, k_dim = kc.shape[2:]
    v = np.repeat(vc, heads // vc.shape[2], axis=2)
    k = np.repeat(kc, heads // k_heads, axis=2) if v.shape[2] != k_heads else kc
    v = np.concatenate([v, np.zeros((*v.shape[:3], k_dim - v.shape[3]), np.float32)], axis=3)
    out = paged_attention_cpu(q, k, v, qsl, lens, tables, SCALE, **opts)  # equal shapes: numba
    return out[..., : vc.shape[3]]


@pytest.mark.parametrize("layout", [dict(), dict(v_heads=1), dict(k_heads=1, v_heads=4, v_dim=8)],
                         ids=["mla", "v-fewer-heads", "k-fewer-heads"])
@pytest.mark.parametrize("opts", [{}, {"sliding_window": 3}, {"softcap": 2.0}], ids=["plain", "window", "softcap"])
def test_unequal_kv_layouts_match_padded_oracle(layout, opts):
    case = _case(np.random.default_rng(0), **layout)
    want = _padded_oracle(*case, **opts)
    q, kc, vc, qsl, lens, tables = case
    assert kv_layouts_differ(kc, vc)
    np.testing.assert_allclose(paged_attention_reference(*case, SCALE, **opts), want, atol=3e-5, rtol=1e-5)
    np.testing.assert_allclose(paged_attention_cpu(*case, SCALE, **opts), want, atol=3e-5, rtol=1e-5)
    tq, tk, tv = (torch.from_numpy(a) for a in (q, kc, vc))
    md = prepare_cpu_attention_metadata(qsl, lens, tables)
    for backends in [("numba", "numba"), ("numba", "torch"), (None, None)]:  # numba is overridden: unfit
        got = paged_attention_cpu(tq, tk, tv, scaling=SCALE, metadata=md, decode_backend=backends[0],
                                  prefill_backend=backends[1], **opts)
        assert got.shape == (q.shape[0], q.shape[1], vc.shape[3])
        np.testing.assert_allclose(got.numpy(), want, atol=3e-5, rtol=1e-5)
    got = paged_attention_torch(tq, tk, tv, qsl, lens, tables, SCALE, **opts)
    np.testing.assert_allclose(got.numpy(), want, atol=3e-5, rtol=1e-5)


def test_write_kv_with_unequal_layouts():
    kc, vc = torch.zeros(3, BS, 2, 24), torch.zeros(3, BS, 2, 16)
    k, v = torch.randn(5, 2, 24), torch.randn(5, 2, 16)
    slots = torch.tensor([0, 5, 6, 7, 11])
    write_kv_torch(kc, vc, k, v, slots)
    assert torch.equal(kc.view(-1, 2, 24)[slots], k) and torch.equal(vc.view(-1, 2, 16)[slots], v)
