"""CPU paged attention: paged backends vs the no-paging bound (SDPA on contiguous K/V).

Run: ``pytest benchmarks/bench_attention_cpu.py --benchmark-only`` (about 2 minutes on
2 cores; ``KVPAGE_BENCH_THREADS`` sets the thread count of torch and numba alike).
Every benchmark reports ``extra_info``: ``gbps`` (bytes of K/V read / median time),
the thread count and, for the decode target, the paged/contiguous ratio measured with
interleaved calls (the fairest number on a noisy shared machine).
"""
from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from conftest import bench_threads  # noqa: E402
from kvpage.attention import paged_attention_reference  # noqa: E402
from kvpage.attention.cpu import AttentionLayout, CPUKernelChoice, CPUKernels  # noqa: E402
from kvpage.attention.cpu_metadata import LayerCall, prepare_cpu_attention_metadata  # noqa: E402

SCALE = 0.125
HEAD_DIM = 64


def build(q_lens, seq_lens, heads, kv_heads, block_size, dtype=torch.float32, seed=0):
    """Paged caches with shuffled block tables plus the same K/V laid out contiguously."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 1
    kc = torch.randn(num_blocks, block_size, kv_heads, HEAD_DIM, generator=g).to(dtype)
    vc = torch.randn(num_blocks, block_size, kv_heads, HEAD_DIM, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[used:used + n]
        used += n
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = torch.randn(int(qsl[-1]), heads, HEAD_DIM, generator=g).to(dtype)
    md = prepare_cpu_attention_metadata(qsl, np.asarray(seq_lens, np.int32), tables.numpy())
    contiguous = [_contiguous(c, tables, seq_lens) for c in (kc, vc)]
    kv_bytes = 2 * sum(seq_lens) * kv_heads * HEAD_DIM * kc.element_size()
    return q, kc, vc, md, contiguous, kv_bytes


def _contiguous(cache, tables, seq_lens):
    """Per sequence ``[1, H_kv, L, D]`` contiguous copies (what SDPA would read without paging)."""
    out = []
    for i, s in enumerate(seq_lens):
        rows = cache[tables[i, : -(-s // cache.shape[1])].long()].reshape(-1, *cache.shape[2:])[:s]
        out.append(rows.transpose(0, 1).contiguous()[None])
    return out


def contiguous_decode_fn(q, contiguous):
    """Equal-length decode batch as one SDPA call on [B, H_kv, L, D] (the no-paging bound)."""
    k = torch.cat(contiguous[0]); v = torch.cat(contiguous[1])  # noqa: E702
    q4 = q[:, :, None, :]
    return lambda: F.scaled_dot_product_attention(q4, k, v, scale=SCALE, enable_gqa=True)


def contiguous_prefill_fn(q, md, contiguous):
    bounds = md.query_start_loc.tolist()

    def run():
        for i, (k, v) in enumerate(zip(*contiguous)):
            qi = q[bounds[i]:bounds[i + 1]].transpose(0, 1)[None]
            q_len, seq_len = qi.shape[2], k.shape[2]
            mask = None
            if q_len != seq_len:
                allowed = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
                mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
            F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, is_causal=mask is None, scale=SCALE,
                                           enable_gqa=True)
    return run


def paged_fn(impl, q, kc, vc, md):
    if impl == "reference":
        args = [t.numpy() for t in (q, kc, vc)] + [md.query_start_loc, md.seq_lens, md.block_tables]
        return lambda: paged_attention_reference(*args, SCALE)
    kernels = CPUKernels(AttentionLayout.of(q, kc, vc), CPUKernelChoice(impl, impl))  # bound once, as a model's
    call = LayerCall(SCALE)
    return lambda: kernels.attend(q, kc, vc, md, call)


def record(benchmark, kv_bytes, **info):
    benchmark.extra_info.update(info, threads=bench_threads())
    median = benchmark.stats.stats.median if benchmark.stats else None
    if median:
        benchmark.extra_info["gbps"] = round(kv_bytes / median / 1e9, 2)


# (batch, context, heads, kv_heads, block_size)
DECODE_SWEEP = [
    (32, 512, 8, 4, 16),  # the target shape
    (8, 2048, 8, 4, 16),
    (32, 512, 32, 8, 16),
    (32, 512, 8, 4, 64),
    (2, 4096, 8, 4, 16),
]


@pytest.mark.parametrize("impl", ["contiguous_sdpa", "native", "numba", "torch"])
@pytest.mark.parametrize("shape", DECODE_SWEEP, ids=lambda s: "b{}_ctx{}_h{}kv{}_bs{}".format(*s))
def test_bench_decode(benchmark, shape, impl):
    batch, ctx, heads, kv_heads, bs = shape
    q, kc, vc, md, contiguous, kv_bytes = build([1] * batch, [ctx] * batch, heads, kv_heads, bs)
    fn = contiguous_decode_fn(q, contiguous) if impl == "contiguous_sdpa" else paged_fn(impl, q, kc, vc, md)
    benchmark(fn)
    record(benchmark, kv_bytes, impl=impl, phase="decode")


@pytest.mark.parametrize("impl", ["native", "numba"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bench_decode_at_the_vs_vllm_shape(benchmark, dtype, impl):
    """One decode layer of bench_vs_vllm's workload on SmolLM2-135M: 64 sequences of 200-420
    tokens, 9 query and 3 KV heads of 64, blocks of 16."""
    lens = np.random.default_rng(0).integers(200, 420, 64).tolist()
    q, kc, vc, md, _, kv_bytes = build([1] * len(lens), lens, 9, 3, 16, dtype=dtype)
    benchmark(paged_fn(impl, q, kc, vc, md))
    record(benchmark, kv_bytes, impl=impl, phase="decode")


def test_bench_decode_reference(benchmark):
    q, kc, vc, md, _, kv_bytes = build([1] * 8, [512] * 8, 8, 4, 16)
    benchmark.pedantic(paged_fn("reference", q, kc, vc, md), rounds=3, iterations=1)
    record(benchmark, kv_bytes, impl="reference", phase="decode")


def interleaved_medians(fns: dict, rounds: int = 40) -> dict:
    """Median seconds of each callable, calls interleaved so drift hits all alike."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def test_bench_decode_target_ratio(benchmark):
    """Target: numba paged decode within 1.5x of contiguous SDPA (b32, ctx512, 8/4 heads, fp32, bs16)."""
    q, kc, vc, md, contiguous, kv_bytes = build([1] * 32, [512] * 32, 8, 4, 16)
    fns = {"contiguous_sdpa": contiguous_decode_fn(q, contiguous), "numba": paged_fn("numba", q, kc, vc, md),
           "torch": paged_fn("torch", q, kc, vc, md)}
    medians = interleaved_medians(fns)
    benchmark(fns["numba"])
    record(benchmark, kv_bytes, impl="numba", phase="decode",
           ms={k: round(v * 1e3, 3) for k, v in medians.items()},
           numba_over_contiguous=round(medians["numba"] / medians["contiguous_sdpa"], 2),
           torch_over_contiguous=round(medians["torch"] / medians["contiguous_sdpa"], 2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_bench_decode_from_a_large_pool(benchmark, dtype):
    """SmolLM2's decode shape (batch 34 x context 220, 9 query / 3 KV heads), each call on
    another of 30 layers' worth of scattered blocks, so K/V come from DRAM as in a served
    model (a single layer's KV stays in the caches and flatters the kernel)."""
    layers, batch, ctx, bs = 30, 34, 220, 16
    g = torch.Generator().manual_seed(0)
    per_seq = -(-ctx // bs)
    num_blocks = layers * batch * per_seq
    kc = torch.randn(num_blocks, bs, 3, HEAD_DIM, generator=g).to(dtype)
    vc = torch.randn(num_blocks, bs, 3, HEAD_DIM, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32).view(layers, batch, per_seq)
    qsl, lens = np.arange(batch + 1, dtype=np.int32), np.full(batch, ctx, np.int32)
    metas = [prepare_cpu_attention_metadata(qsl, lens, perm[i].numpy(), num_decodes=batch) for i in range(layers)]
    q = torch.randn(batch, 9, HEAD_DIM, generator=g).to(dtype)
    calls = iter(range(1 << 62))
    kernels = CPUKernels(AttentionLayout.of(q, kc, vc))
    call = LayerCall(SCALE)

    def one_layer():
        return kernels.attend(q, kc, vc, metas[next(calls) % layers], call)

    benchmark(one_layer)
    record(benchmark, batch * ctx * 3 * HEAD_DIM * 2 * kc.element_size(), impl=kernels.decode_backend, phase="decode",
           dtype=str(dtype).removeprefix("torch."))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_bench_prefill_smollm2_native_vs_torch(benchmark, dtype):
    """One prefill step's attention for one layer of SmolLM2 (9 query / 3 KV heads): ten
    prompts of 150-260 tokens, native kernel vs gather + SDPA, calls interleaved."""
    lens = [205, 180, 240, 150, 260, 210, 199, 230, 190, 184]
    q, kc, vc, md, _, kv_bytes = build(lens, lens, 9, 3, 16, dtype=getattr(torch, dtype))
    fns = {"native": paged_fn("native", q, kc, vc, md), "torch": paged_fn("torch", q, kc, vc, md)}
    medians = interleaved_medians(fns, rounds=20)
    benchmark(fns["native"])
    record(benchmark, kv_bytes, impl="native", phase="prefill", dtype=dtype,
           ms={k: round(v * 1e3, 3) for k, v in medians.items()},
           torch_over_native=round(medians["torch"] / medians["native"], 2))


# (query lengths, context lengths)
PREFILL_SWEEP = {
    "full_1x512": ([512], [512]),
    "chunk_128_of_1024": ([128], [1024]),
    "mixed_16dec_1x256": ([1] * 16 + [256], [512] * 16 + [256]),
}


@pytest.mark.parametrize("impl", ["contiguous_sdpa", "native", "numba", "torch"])
@pytest.mark.parametrize("case", PREFILL_SWEEP)
def test_bench_prefill(benchmark, case, impl):
    q_lens, seq_lens = PREFILL_SWEEP[case]
    q, kc, vc, md, contiguous, kv_bytes = build(q_lens, seq_lens, 8, 4, 16)
    if impl == "contiguous_sdpa":
        fn = contiguous_prefill_fn(q, md, contiguous)
    else:
        fn = paged_fn(impl, q, kc, vc, md)
    benchmark(fn)
    record(benchmark, kv_bytes, impl=impl, phase="prefill")
