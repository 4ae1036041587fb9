"""CPU paged-attention backends (numba, torch, dispatcher) against the numpy reference."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numba")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvpage.attention import paged_attention_reference, write_kv_reference  # noqa: E402
from kvpage.attention.cpu import paged_attention_cpu, write_kv_cpu  # noqa: E402
from kvpage.attention.cpu_metadata import build_work_tiles, prepare_cpu_attention_metadata  # noqa: E402
from kvpage.attention.numba_cpu import paged_attention_numba  # noqa: E402
from kvpage.attention.torch_cpu import paged_attention_torch  # noqa: E402
from kvpage.core.sched.metadata import leading_decodes  # noqa: E402

BS = 16
SCALE = 0.17
TOL = {"float32": (3e-5, 1e-5), "float16": (2e-3, 2e-3), "bfloat16": (2e-2, 1.6e-2)}
# fp32 through the torch backend: its softcap / sinks path multiplies through MKL's batched
# SGEMM, which picks its kernels at run time (CNR off). Once on CI, under CPU contention, that
# call returned scores off by up to 3e-4 relative on one thread's half of the batch, while a
# second call in the same process was exact to 4e-7 (outputs off by 7e-5). A kernel reading a
# slot it must not read is off by far more: those slots hold 1e3 (``make_case``).
TORCH_FP32_TOL = (3e-4, 1e-4)

# (query lengths, context lengths); contexts 1, bs-1, bs, bs+1 appear in the decode case.
SCENARIOS = {
    "decode": ([1, 1, 1, 1, 1], [1, BS - 1, BS, BS + 1, 70]),
    "prefill": ([1, 7, BS, 33], [1, 7, BS, 33]),
    "chunked": ([8, 16], [40, 64]),
    "prefix_hit": ([9, 1], [41, 17]),  # 32 cached tokens (two full blocks), 9 new
    "mixed": ([1, 1, 5, 0, 17, 1], [3, 33, 20, 5, 17, 9]),  # trailing q=1 prefill, empty seq
}
OPTIONS = {
    "plain": {},
    "window": {"sliding_window": 5},
    "softcap": {"softcap": 4.0},
    "sinks": {"sinks": "random"},
}
# (decode_backend, prefill_backend) of the dispatcher on torch tensors; None = defaults.
TORCH_BACKENDS = [("numba", "numba"), ("torch", "torch"), ("native", "torch"), ("native", "native"), None]


def make_case(rng, q_lens, seq_lens, heads=8, kv_heads=4, head_dim=32, garbage=1e3):
    """fp32 paged caches with shuffled, non-contiguous block tables.

    Block 0 is never assigned (block-table padding points at it) and every slot that holds
    no context token is filled with ``garbage``: reading it would show in the output.
    """
    blocks = [-(-s // BS) for s in seq_lens]
    num_blocks = 1 + sum(blocks) + 3
    kc = np.full((num_blocks, BS, kv_heads, head_dim), garbage, np.float32)
    vc = np.full_like(kc, garbage)
    ids = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(seq_lens), max(blocks) + 2), np.int32)
    used = 0
    for i, (n, s) in enumerate(zip(blocks, seq_lens)):
        tables[i, :n] = ids[used:used + n]
        used += n
        flat_k = kc[tables[i, :n]].reshape(-1, kv_heads, head_dim)
        flat_k[:s] = rng.standard_normal((s, kv_heads, head_dim))
        kc[tables[i, :n]] = flat_k.reshape(n, BS, kv_heads, head_dim)
        flat_v = vc[tables[i, :n]].reshape(-1, kv_heads, head_dim)
        flat_v[:s] = rng.standard_normal((s, kv_heads, head_dim))
        vc[tables[i, :n]] = flat_v.reshape(n, BS, kv_heads, head_dim)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(qsl[-1]), heads, head_dim)).astype(np.float32)
    return q, kc, vc, qsl, np.asarray(seq_lens, np.int32), tables


def options(rng, name, heads):
    opts = dict(OPTIONS[name])
    if opts.get("sinks") == "random":
        opts["sinks"] = rng.standard_normal(heads).astype(np.float32)
    return opts


def run_torch(q, kc, vc, qsl, lens, tables, dtype, backends, **opts):
    td = getattr(torch, dtype)
    args = [torch.from_numpy(a).to(td) for a in (q, kc, vc)]
    if backends is None:
        out = paged_attention_cpu(*args, qsl, lens, tables, SCALE, **opts)
    else:
        md = prepare_cpu_attention_metadata(torch.from_numpy(qsl), lens, torch.from_numpy(tables))
        out = paged_attention_cpu(*args, scaling=SCALE, metadata=md, decode_backend=backends[0],
                                  prefill_backend=backends[1], **opts)
    assert out.dtype == td and out.shape == args[0].shape
    return out.float().numpy()


def expected(q, kc, vc, qsl, lens, tables, dtype, **opts):
    """Reference on the inputs rounded to ``dtype`` (fp16 natively; bf16 via its fp32 values)."""
    if dtype == "float16":
        return paged_attention_reference(q.astype(np.float16), kc.astype(np.float16), vc.astype(np.float16),
                                         qsl, lens, tables, SCALE, **opts).astype(np.float32)
    if dtype == "bfloat16":
        q, kc, vc = (torch.from_numpy(a).bfloat16().float().numpy() for a in (q, kc, vc))
    return paged_attention_reference(q, kc, vc, qsl, lens, tables, SCALE, **opts)


def check(got, want, dtype, backends=None):
    """``got`` matches ``want`` within ``dtype``'s tolerance; ``backends`` that run torch get
    ``TORCH_FP32_TOL`` at fp32."""
    atol, rtol = TORCH_FP32_TOL if dtype == "float32" and backends and "torch" in backends else TOL[dtype]
    np.testing.assert_allclose(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_numba_numpy_matches_reference(scenario, option):
    rng = np.random.default_rng(0)
    case = make_case(rng, *SCENARIOS[scenario])
    opts = options(rng, option, 8)
    want = paged_attention_reference(*case, SCALE, **opts)
    check(paged_attention_numba(*case, SCALE, **opts), want, "float32")
    check(paged_attention_cpu(*case, SCALE, **opts), want, "float32")


@pytest.mark.parametrize("backends", TORCH_BACKENDS, ids=str)
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_torch_dispatch_matches_reference(scenario, option, backends):
    rng = np.random.default_rng(1)
    case = make_case(rng, *SCENARIOS[scenario])
    opts = options(rng, option, 8)
    check(run_torch(*case, "float32", backends, **opts), paged_attention_reference(*case, SCALE, **opts), "float32",
          backends)


@pytest.mark.parametrize("backends", TORCH_BACKENDS, ids=str)
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision(dtype, option, backends):
    rng = np.random.default_rng(2)
    case = make_case(rng, *SCENARIOS["mixed"])
    opts = options(rng, option, 8)
    check(run_torch(*case, dtype, backends, **opts), expected(*case, dtype, **opts), dtype)


@pytest.mark.parametrize("decode_backend", ["numba", "native"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("option", OPTIONS)
def test_decode_context_splits(option, dtype, decode_backend):
    """Few long sequences: the decode kernel splits each context and merges the parts."""
    from kvpage.kernels.numba_decode import decode_splits

    rng = np.random.default_rng(7)
    case = make_case(rng, [1, 1], [700, 1029], heads=4, kv_heads=2, head_dim=32)
    assert decode_splits(2, 1029, BS, 2) > 1
    opts = options(rng, option, 4)
    if option == "window":
        opts["sliding_window"] = 300  # spans partitions and splits
    backends = (decode_backend, "numba" if decode_backend == "numba" else "torch")
    check(run_torch(*case, dtype, backends, **opts), expected(*case, dtype, **opts), dtype)


def test_numba_float16_numpy_caches():
    rng = np.random.default_rng(3)
    q, kc, vc, *idx = make_case(rng, *SCENARIOS["mixed"])
    q16, k16, v16 = q.astype(np.float16), kc.astype(np.float16), vc.astype(np.float16)
    got = paged_attention_cpu(q16, k16, v16, *idx, SCALE)
    assert got.dtype == np.float16
    check(got.astype(np.float32), expected(q, kc, vc, *idx, "float16"), "float16")


@pytest.mark.parametrize("backends", TORCH_BACKENDS, ids=str)
@pytest.mark.parametrize("heads,kv_heads", [(8, 1), (4, 4), (6, 2)], ids=["mqa", "mha", "gqa3"])
def test_head_layouts(heads, kv_heads, backends):
    rng = np.random.default_rng(4)
    case = make_case(rng, *SCENARIOS["mixed"], heads=heads, kv_heads=kv_heads)
    opts = options(rng, "sinks", heads)
    want = paged_attention_reference(*case, SCALE, **opts)
    check(run_torch(*case, "float32", backends, **opts), want, "float32", backends)
    check(paged_attention_numba(*case, SCALE, **opts), want, "float32")


def test_direct_torch_backend_and_decode_split():
    rng = np.random.default_rng(5)
    case = make_case(rng, [1, 1, 4, 1], [20, 5, 9, 30])
    t = [torch.from_numpy(a) for a in case[:3]]
    got = paged_attention_torch(*t, *case[3:], SCALE, sliding_window=7)
    want = paged_attention_reference(*case, SCALE, sliding_window=7)
    check(got.numpy(), want, "float32")
    assert leading_decodes(np.diff(case[3])) == 2  # the q=1 sequence after the prefill is not a decode


def test_numba_never_reads_past_context():
    """NaN in every slot that is not context (stale tail of last blocks, padding block 0)."""
    rng = np.random.default_rng(6)
    case = make_case(rng, *SCENARIOS["mixed"], garbage=np.nan)
    for opt in OPTIONS:
        opts = options(rng, opt, 8)
        got = paged_attention_numba(*case, SCALE, **opts)
        check(got, paged_attention_reference(*case, SCALE, **opts), "float32")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_ragged_batches(data):
    num_seqs = data.draw(st.integers(1, 6))
    num_dec = data.draw(st.integers(0, num_seqs))
    seq_lens = data.draw(st.lists(st.integers(1, 3 * BS + 3), min_size=num_seqs, max_size=num_seqs))
    q_lens = [1 if i < num_dec else data.draw(st.integers(0, s)) for i, s in enumerate(seq_lens)]
    kv_heads = data.draw(st.sampled_from([1, 2]))
    heads = kv_heads * data.draw(st.sampled_from([1, 2, 3]))
    window = data.draw(st.sampled_from([None, 1, 4, 20]))
    softcap = data.draw(st.sampled_from([None, 3.0]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    case = make_case(rng, q_lens, seq_lens, heads=heads, kv_heads=kv_heads, head_dim=16)
    sinks = rng.standard_normal(heads).astype(np.float32) if data.draw(st.booleans()) else None
    opts = dict(sliding_window=window, softcap=softcap, sinks=sinks)
    want = paged_attention_reference(*case, SCALE, **opts)
    check(paged_attention_numba(*case, SCALE, **opts), want, "float32")
    check(run_torch(*case, "float32", ("torch", "torch"), **opts), want, "float32", ("torch", "torch"))
    check(run_torch(*case, "float32", ("native", "torch"), **opts), want, "float32", ("native", "torch"))


def test_work_tiles_cover_every_query_row_once():
    qsl = np.array([0, 1, 2, 40, 40, 57], np.int32)
    work = build_work_tiles(qsl, first_seq=2, tile=16)
    assert work.tolist() == [[2, 0, 16], [2, 16, 32], [2, 32, 38], [4, 0, 16], [4, 16, 17]]


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_write_kv_scatter(kind):
    rng = np.random.default_rng(7)
    kc = rng.standard_normal((6, BS, 2, 8)).astype(np.float32)
    vc = rng.standard_normal(kc.shape).astype(np.float32)
    slots = rng.permutation(6 * BS)[:23].astype(np.int64)
    k = rng.standard_normal((23, 2, 8)).astype(np.float32)
    v = rng.standard_normal((23, 2, 8)).astype(np.float32)
    want_k, want_v = kc.copy(), vc.copy()
    write_kv_reference(want_k, want_v, k, v, slots)
    md = prepare_cpu_attention_metadata(np.array([0, 23]), np.array([23]), np.zeros((1, 2)), slot_mapping=slots)
    if kind == "torch":
        tk, tv = torch.from_numpy(kc.copy()), torch.from_numpy(vc.copy())
        write_kv_cpu(tk, tv, torch.from_numpy(k), torch.from_numpy(v), metadata=md)
        got_k, got_v = tk.numpy(), tv.numpy()
    else:
        got_k, got_v = kc.copy(), vc.copy()
        write_kv_cpu(got_k, got_v, k, v, metadata=md)
    np.testing.assert_array_equal(got_k, want_k)
    np.testing.assert_array_equal(got_v, want_v)


def test_write_kv_bfloat16_casts():
    kc = torch.zeros(2, BS, 1, 4, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    k = torch.randn(3, 1, 4)
    write_kv_cpu(kc, vc, k, 2 * k, np.array([0, 17, 31]))
    assert torch.equal(kc.view(-1, 1, 4)[[0, 17, 31]], k.bfloat16())
    assert torch.equal(vc.view(-1, 1, 4)[[0, 17, 31]], (2 * k).bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_numba_store_equals_index_copy(dtype):
    """Contiguous torch caches take the native (else numba's) row store; it writes what ``index_copy_`` writes,
    for K and V of different head sizes too, and refuses slots outside the cache."""
    from kvpage.attention.torch_cpu import write_kv_torch

    g = torch.Generator().manual_seed(3)
    kc = torch.randn(5, BS, 2, 8, generator=g).to(dtype)
    vc = torch.randn(5, BS, 2, 4, generator=g).to(dtype)
    k, v = torch.randn(7, 2, 8, generator=g), torch.randn(7, 2, 4, generator=g)  # fp32 rows: cast on write
    slots = torch.randperm(5 * BS, generator=g)[:7].numpy().astype(np.int64)
    want_k, want_v = kc.clone(), vc.clone()
    write_kv_torch(want_k, want_v, k, v, slots)
    write_kv_cpu(kc, vc, k, v, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    with pytest.raises(IndexError, match="outside the cache"):
        write_kv_cpu(kc, vc, k[:1], v[:1], np.array([5 * BS], np.int64))
    with pytest.raises(ValueError, match="slots for"):
        write_kv_cpu(kc, vc, k, v, slots[:3])


def test_bad_inputs_raise():
    rng = np.random.default_rng(8)
    q, kc, vc, qsl, lens, tables = make_case(rng, [2], [5], heads=6, kv_heads=4)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_cpu(q, kc, vc, qsl, lens, tables, SCALE)
    with pytest.raises(ValueError, match="more queries"):
        prepare_cpu_attention_metadata(qsl, np.array([1]), tables)
    with pytest.raises(ValueError, match="metadata"):
        paged_attention_cpu(q, kc, vc, scaling=SCALE)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cpu(kc, vc, q, q)


@pytest.mark.parametrize("numpy_inputs", [False, True], ids=["torch", "numpy"])
def test_heads_wider_than_the_numba_kernel_decode_elsewhere(numpy_inputs):
    """Gemma4's global layers have 512-wide heads: past ``NUMBA_DECODE_MAX_HEAD_DIM`` the
    dispatcher decodes on torch (numpy inputs: the reference) and stays exact."""
    from kvpage.attention.cpu import NUMBA_DECODE_MAX_HEAD_DIM

    rng = np.random.default_rng(9)
    case = make_case(rng, *SCENARIOS["mixed"], heads=4, kv_heads=2, head_dim=2 * NUMBA_DECODE_MAX_HEAD_DIM)
    want = paged_attention_reference(*case, SCALE)
    if numpy_inputs:
        got = paged_attention_cpu(*case, SCALE)
    else:
        got = run_torch(*case, "float32", None)
    check(got, want, "float32")
