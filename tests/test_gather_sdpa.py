"""The gather into torch's SDPA (``kvpage.attention.gather_sdpa``) against the numpy
reference on CPU, and the CUDA backend's choice of prefill kernel (``adapters.cuda_prefill``)
with its decode/prefill split, run on CPU tensors with ``kvpage.cuda.paged_attention``
replaced by the reference (no GPU here; the GPU timing is ``benchmarks/gpu_check_report.py``).

Batches are ragged: leading decodes, whole prompts, chunks with earlier context, a sequence
with no query rows, shapes repeated so that sequences share an SDPA call (some of them not
adjacent in the batch), shuffled block tables.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpage.adapters import attention_backends
from kvpage.adapters.attention_backends import CudaBackend, CudaIndices
from kvpage.adapters.cuda_prefill import HostStep, check_prefill_kernel, choose_prefill_kernel
from kvpage.attention.gather_sdpa import gather_sdpa_prefill, plan_prefill, run_prefill_plan, sdpa_unsupported
from kvpage.attention.reference import paged_attention_reference
from kvpage.core.kv_formats import CacheFormat, KVFormat
from kvpage.core.sched.metadata import StepMetadata

BLOCK = 4
SCALE = 0.3
# (query lengths, context lengths): decodes first, as the scheduler orders them.
BATCH = ([1, 1, 1, 6, 3, 6, 0, 9, 3, 6, 1],
         [7, 12, 3, 6, 11, 6, 5, 30, 11, 6, 9])
NUM_DECODES = 3


def make_batch(rng, q_lens, ctx, heads, kv_heads, dim=16, spare_blocks=5):
    """Host float32 inputs: q ``[T, H, D]``, caches, metadata, and shuffled block tables
    (``spare_blocks`` more blocks than the contexts use, never referenced)."""
    per_seq = [-(-c // BLOCK) for c in ctx]
    width = max(per_seq) + 1  # padded column past every context
    num_blocks = sum(per_seq) + spare_blocks
    ids = rng.permutation(num_blocks)
    tables, at = np.zeros((len(ctx), width), np.int32), 0
    for i, n in enumerate(per_seq):
        tables[i, :n], at = ids[at:at + n], at + n
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    shape = (num_blocks, BLOCK, kv_heads, dim)
    q = rng.standard_normal((int(qsl[-1]), heads, dim)).astype(np.float32)
    kc, vc = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    return q, kc, vc, qsl, np.asarray(ctx, np.int32), tables


def _torch(*arrays, dtype=torch.float32):
    return [torch.from_numpy(a).to(dtype) for a in arrays]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 1, 3, 5, 64])
def test_matches_reference_fp32(heads, kv_heads, window):
    q, kc, vc, qsl, lens, tables = make_batch(np.random.default_rng(heads + (window or 0)), *BATCH, heads, kv_heads)
    want = paged_attention_reference(q, kc, vc, qsl, lens, tables, SCALE, window)
    got = gather_sdpa_prefill(*_torch(q, kc, vc), qsl, lens, tables, SCALE, window, first_seq=NUM_DECODES)
    assert got.dtype == torch.float32 and tuple(got.shape) == (q.shape[0] - NUM_DECODES, heads, q.shape[2])
    np.testing.assert_allclose(got.numpy(), want[qsl[NUM_DECODES]:], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 4])
def test_matches_reference_bf16(window):
    q, kc, vc, qsl, lens, tables = make_batch(np.random.default_rng(7), *BATCH, 8, 2, dim=32)
    tq, tk, tv = _torch(q, kc, vc, dtype=torch.bfloat16)
    # The reference sees exactly the bf16 values; what differs is SDPA's bf16 arithmetic.
    want = paged_attention_reference(*(t.float().numpy() for t in (tq, tk, tv)), qsl, lens, tables, SCALE, window)
    got = gather_sdpa_prefill(tq, tk, tv, qsl, lens, tables, SCALE, window, first_seq=NUM_DECODES)
    assert got.dtype == torch.bfloat16
    np.testing.assert_allclose(got.float().numpy(), want[qsl[NUM_DECODES]:], atol=3e-2, rtol=3e-2)


def test_whole_batch_from_the_first_sequence():
    q, kc, vc, qsl, lens, tables = make_batch(np.random.default_rng(3), *BATCH, 8, 2)
    want = paged_attention_reference(q, kc, vc, qsl, lens, tables, SCALE)
    got = gather_sdpa_prefill(*_torch(q, kc, vc), qsl, lens, tables, SCALE)
    np.testing.assert_allclose(got.numpy(), want, atol=2e-5, rtol=1e-5)


def test_equal_shapes_share_one_call_and_index_their_rows():
    q_lens, ctx = BATCH
    q, kc, vc, qsl, lens, tables = make_batch(np.random.default_rng(4), q_lens, ctx, 4, 2)
    plan = plan_prefill(qsl, lens, tables, BLOCK, NUM_DECODES, "cpu")
    shapes = {(g.q_len, g.seq_len): g for g in plan.groups}
    # Every sequence after the decodes with query rows, by shape; (0, 5) has no rows, no group.
    assert sorted(shapes) == sorted({(n, c) for n, c in zip(q_lens[NUM_DECODES:], ctx[NUM_DECODES:]) if n})
    assert shapes[(6, 6)].num_seqs == 3 and shapes[(3, 11)].num_seqs == 2 and shapes[(9, 30)].num_seqs == 1
    assert isinstance(shapes[(6, 6)].rows, torch.Tensor)  # seqs 3, 5, 9: not adjacent
    assert isinstance(shapes[(9, 30)].rows, slice)
    assert plan.first_row == NUM_DECODES and plan.num_rows == q.shape[0] - NUM_DECODES
    assert tuple(shapes[(9, 30)].block_ids.shape) == (1, 8)
    covered = np.concatenate([np.arange(plan.num_rows)[g.rows] for g in plan.groups])
    assert sorted(covered.tolist()) == list(range(plan.num_rows))  # each row exactly once
    # One plan serves every layer: a second call over other caches reuses it.
    _, kc2, vc2, *_ = make_batch(np.random.default_rng(5), q_lens, ctx, 4, 2)
    got = run_prefill_plan(plan, *_torch(q, kc2, vc2), SCALE)
    want = paged_attention_reference(q, kc2, vc2, qsl, lens, tables, SCALE)[NUM_DECODES:]
    np.testing.assert_allclose(got.numpy(), want, atol=2e-5, rtol=1e-5)


def test_blocks_behind_the_window_are_never_read():
    """A sliding-window group's block tables hold padding behind the window: point those
    entries at a block of NaNs, and the output must still be the reference's."""
    q, kc, vc, qsl, lens, tables = make_batch(np.random.default_rng(6), [1, 5, 8], [20, 21, 26], 4, 2)
    window = 6
    want = paged_attention_reference(q, kc, vc, qsl, lens, tables, SCALE, window)
    poison = kc.shape[0] - 1  # a spare block no table uses
    kc[poison], vc[poison] = np.nan, np.nan
    padded = tables.copy()
    for i, (n, c) in enumerate(zip(np.diff(qsl), lens)):
        first_visible = max(0, int(c) - int(n) + 1 - window)
        padded[i, :first_visible // BLOCK] = poison
    got = gather_sdpa_prefill(*_torch(q, kc, vc), qsl, lens, padded, SCALE, window, first_seq=1)
    assert torch.isfinite(got).all()
    np.testing.assert_allclose(got.numpy(), want[1:], atol=2e-5, rtol=1e-5)


def test_no_prefill_rows_gives_an_empty_result():
    q, kc, vc, qsl, lens, tables = make_batch(np.random.default_rng(2), [1, 1, 0], [5, 6, 3], 4, 2)
    got = gather_sdpa_prefill(*_torch(q, kc, vc), qsl, lens, tables, SCALE, first_seq=2)
    assert tuple(got.shape) == (0, 4, q.shape[2])
    assert plan_prefill(qsl, lens, tables, BLOCK, 3, "cpu").groups == ()


def test_refusals():
    q, kc, vc, qsl, lens, tables = make_batch(np.random.default_rng(8), [4], [9], 4, 2)
    tq, tk, tv = _torch(q, kc, vc)
    with pytest.raises(ValueError, match="softcap"):
        gather_sdpa_prefill(tq, tk, tv, qsl, lens, tables, SCALE, softcap=30.0)
    with pytest.raises(ValueError, match="sinks"):
        gather_sdpa_prefill(tq, tk, tv, qsl, lens, tables, SCALE, sinks=torch.zeros(4))
    with pytest.raises(ValueError, match="columns"):
        gather_sdpa_prefill(tq, tk, tv, qsl, lens, tables[:, :2], SCALE)
    with pytest.raises(ValueError, match="num_kv_heads"):
        gather_sdpa_prefill(tq[:, :3], tk, tv, qsl, lens, tables, SCALE)
    plan = plan_prefill(qsl, lens, tables, BLOCK, 0, "cpu")
    with pytest.raises(ValueError, match="rows"):
        run_prefill_plan(plan, tq[:3], tk, tv, SCALE)
    int8 = CacheFormat(KVFormat("int8"), BLOCK)
    assert "int8" in sdpa_unsupported(cache_format=int8)
    assert sdpa_unsupported() is None
    assert sdpa_unsupported(cache_format=CacheFormat(KVFormat("bfloat16"), BLOCK)) is None  # values, not codes


# ---- the CUDA backend's routing -----------------------------------------------------------

INT8 = CacheFormat(KVFormat("int8"), BLOCK)


@pytest.mark.parametrize("setting,dtype,kwargs,want", [
    ("auto", torch.bfloat16, {}, "sdpa"),  # the Numba prefill kernel has no bf16
    ("auto", torch.float16, {}, "numba"),
    ("auto", torch.float32, {}, "numba"),
    ("auto", torch.bfloat16, {"softcap": 50.0}, "numba"),  # SDPA cannot: Numba raises its bf16 error
    ("auto", torch.bfloat16, {"sinks": torch.zeros(4)}, "numba"),
    ("auto", torch.float16, {"cache_format": INT8}, "numba"),
    ("numba", torch.bfloat16, {}, "numba"),
    ("sdpa", torch.float16, {}, "sdpa"),
    ("sdpa", torch.float32, {"softcap": 0.0}, "sdpa"),  # 0: no softcap
])
def test_choose_prefill_kernel(setting, dtype, kwargs, want):
    assert choose_prefill_kernel(setting, dtype, **kwargs) == want


def test_prefill_kernel_refusals():
    with pytest.raises(ValueError, match="softcap"):
        choose_prefill_kernel("sdpa", torch.bfloat16, softcap=30.0)
    with pytest.raises(ValueError, match="prefill_kernel must be one of"):
        choose_prefill_kernel("flash", torch.float16)
    with pytest.raises(ValueError, match="int8"):
        check_prefill_kernel("sdpa", INT8)
    with pytest.raises(ValueError, match="int8"):
        CudaBackend(torch.device("cuda"), INT8, prefill_kernel="sdpa")
    check_prefill_kernel("auto", INT8)


def _step(qsl, lens, tables, num_decodes) -> StepMetadata:
    """Host metadata with the fields the CUDA backend's attention reads (the rest empty)."""
    empty = np.zeros(0, np.int64)
    num_tokens = int(qsl[-1])
    return StepMetadata(input_ids=np.zeros(num_tokens, np.int64), positions=np.zeros(num_tokens, np.int64),
                        slot_mapping=np.zeros(num_tokens, np.int64), query_start_loc=qsl, seq_lens=lens,
                        num_computed_tokens=lens - np.diff(qsl), block_tables=tables, logits_indices=empty,
                        sample_seq_indices=empty, block_copies=np.zeros((0, 2), np.int64), block_size=BLOCK,
                        num_decodes=num_decodes)


class _ReferenceKernel:
    """``kvpage.cuda.paged_attention`` on CPU tensors by the numpy reference; records its calls."""

    def __init__(self) -> None:
        self.calls = []

    def __call__(self, q, key_cache, value_cache, qsl, seq_lens, tables, scaling, sliding_window=None, softcap=None,
                 sinks=None, **sizes):
        self.calls.append(dict(rows=q.shape[0], num_seqs=seq_lens.shape[0], **sizes))
        out = paged_attention_reference(*(t.float().numpy() for t in (q, key_cache, value_cache)), qsl.numpy(),
                                        seq_lens.numpy(), tables.numpy(), scaling, sliding_window, softcap)
        return torch.from_numpy(out).to(q.dtype)


def _backend_case(monkeypatch, prefill_kernel, dtype, window=None):
    """(backend output, reference output, recorded kernel calls) for ``BATCH`` on CPU tensors."""
    import kvpage.cuda.ops

    kernel = _ReferenceKernel()
    monkeypatch.setattr(kvpage.cuda.ops, "paged_attention", kernel)
    q, kc, vc, qsl, lens, tables = make_batch(np.random.default_rng(9), *BATCH, 8, 2)
    tq, tk, tv = _torch(q, kc, vc, dtype=dtype)
    md = _step(qsl, lens, tables, NUM_DECODES)
    prepared = CudaIndices(torch.zeros(0), torch.from_numpy(qsl), torch.from_numpy(lens), torch.from_numpy(tables),
                           md.num_decodes, md.max_prefill_query_len, md.max_seq_len, HostStep(md))
    backend = CudaBackend(torch.device("cuda"), prefill_kernel=prefill_kernel)
    got = backend.attention(tq, tk, tv, prepared, SCALE, window, None, None)
    want = paged_attention_reference(*(t.float().numpy() for t in (tq, tk, tv)), qsl, lens, tables, SCALE, window)
    return got, want, kernel.calls, prepared


@pytest.mark.parametrize("window", [None, 5])
def test_backend_splits_bf16_decodes_from_sdpa_prefill(monkeypatch, window):
    got, want, calls, prepared = _backend_case(monkeypatch, "auto", torch.bfloat16, window)
    assert calls == [dict(rows=NUM_DECODES, num_seqs=NUM_DECODES, num_decodes=NUM_DECODES, max_prefill_query_len=0,
                          max_seq_len=max(BATCH[1][:NUM_DECODES]))]
    assert got.dtype == torch.bfloat16 and got.shape == (sum(BATCH[0]), 8, 16)
    np.testing.assert_allclose(got.float().numpy(), want, atol=3e-2, rtol=3e-2)
    assert prepared.host.plan is not None  # built once, kept for the step's other layers


def test_backend_sends_fp16_everything_to_numba_under_auto(monkeypatch):
    got, want, calls, prepared = _backend_case(monkeypatch, "auto", torch.float16)
    assert len(calls) == 1 and calls[0]["rows"] == sum(BATCH[0]) and calls[0]["num_decodes"] == NUM_DECODES
    assert prepared.host.plan is None
    np.testing.assert_allclose(got.float().numpy(), want, atol=1e-2, rtol=1e-2)


def test_backend_sdpa_setting_serves_fp32_prefill(monkeypatch):
    got, want, calls, _ = _backend_case(monkeypatch, "sdpa", torch.float32)
    assert [c["rows"] for c in calls] == [NUM_DECODES]
    np.testing.assert_allclose(got.numpy(), want, atol=2e-5, rtol=1e-5)


def test_cuda_backend_is_registered_with_the_default_setting():
    assert attention_backends.select_backend("cuda", torch.device("cuda")).prefill_kernel == "auto"
