"""KV cache sizing rules and the paged K/V buffers."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvpage.storage.paged_cache import PagedKVCache
from kvpage.storage.sizing import (CPU_EXPECTED_SEQ_TOKENS, CPU_MAX_FREE_RAM_FRACTION, CPU_MAX_KV_BYTES,
                                   determine_num_blocks, free_ram_bytes)
from kvpage.storage.spec import KVCacheSpec, LayerKVSpec

SPEC = KVCacheSpec.uniform(num_layers=2, num_kv_heads=4, head_dim=8, block_size=16, dtype="float16")
BPB = 2 * 2 * 4 * 8 * 2 * 16  # K+V x layers x heads x head_dim x bytes x tokens


def test_spec_bytes():
    assert SPEC.bytes_per_block == BPB
    assert KVCacheSpec.uniform(1, 1, 1, 1, "float32").bytes_per_block == 8
    assert SPEC.blocks_for_tokens(17) == 2


@pytest.mark.parametrize("bad", [dict(num_layers=0), dict(head_dim=2.0), dict(dtype="int8"), dict(block_size=True)])
def test_spec_rejects_bad_fields(bad):
    fields = dict(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16, dtype="float32") | bad
    with pytest.raises(ValueError):
        KVCacheSpec.uniform(**fields)


# Per layer: an MLA-style layer (K head 24, V head 16), a GQA layer, and a layer reusing layer 1's KV.
MIXED = KVCacheSpec((LayerKVSpec(4, 24, 4, 16), LayerKVSpec.symmetric(2, 8), LayerKVSpec.symmetric(2, 8, reuses=1)),
                    block_size=4, dtype="float32")


def test_per_layer_spec_bytes_follow_each_layer():
    # Layer 0: 4*24 + 4*16 = 160 elements; layer 1: 2*8 * 2 = 32; layer 2 allocates nothing.
    assert MIXED.bytes_per_token == (160 + 32) * 4
    assert MIXED.bytes_per_block == 4 * MIXED.bytes_per_token
    assert MIXED.owner_layers == (0, 1) and [MIXED.owner_of(i) for i in range(3)] == [0, 1, 1]
    assert MIXED.layers_by_layout() == {LayerKVSpec(4, 24, 4, 16): (0,), LayerKVSpec(2, 8, 2, 8): (1,)}
    uniform = KVCacheSpec.uniform(3, 2, 8, block_size=4)
    assert uniform.layers_by_layout() == {LayerKVSpec(2, 8, 2, 8): (0, 1, 2)}
    assert determine_num_blocks(MIXED, kv_cache_memory=10 * MIXED.bytes_per_block, max_model_len=8) == 10


def test_a_spec_without_attention_layers_counts_tokens_only():
    # A model of recurrent layers only: blocks cost nothing, the pool still counts tokens.
    empty = KVCacheSpec((), block_size=4)
    assert empty.bytes_per_block == 0
    assert determine_num_blocks(empty, max_num_seqs=3, max_model_len=10) == 3 * 3
    assert determine_num_blocks(empty, num_kv_blocks=5, max_model_len=10) == 5
    with pytest.raises(ValueError, match="num_kv_blocks"):
        determine_num_blocks(empty, num_kv_blocks=0, max_model_len=10)


@pytest.mark.parametrize("layers, match", [
    (("not a spec",), "sequence of LayerKVSpec"),
    ((LayerKVSpec.symmetric(2, 8, reuses=0),), "earlier layer"),
    ((LayerKVSpec.symmetric(2, 8), LayerKVSpec.symmetric(2, 4, reuses=0)), "layout differs"),
    ((LayerKVSpec.symmetric(2, 8), LayerKVSpec.symmetric(2, 8, reuses=0), LayerKVSpec.symmetric(2, 8, reuses=1)),
     "earlier layer"),
])
def test_per_layer_spec_rejects_bad_layouts(layers, match):
    with pytest.raises(ValueError, match=match):
        KVCacheSpec(layers, block_size=4)
    with pytest.raises(ValueError, match="v_head_dim"):
        LayerKVSpec(2, 8, 2, -1)


def test_a_keys_only_site_holds_no_values():
    """v_head_dim 0: a site that stores keys only (a DSA indexer's), priced by its keys."""
    spec = KVCacheSpec((LayerKVSpec(1, 16, 1, 0), LayerKVSpec.symmetric(2, 8)), block_size=4, dtype="float32")
    assert spec.bytes_per_block == 4 * 4 * (16 + 2 * 8 * 2)
    cache = PagedKVCache(spec, 3, backend="numpy")
    assert tuple(cache.key_cache(0).shape) == (3, 4, 1, 16) and cache.value_cache(0).size == 0


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_per_layer_buffers(backend):
    if backend == "torch":
        pytest.importorskip("torch")
    cache = PagedKVCache(MIXED, 5, backend=backend)
    assert tuple(cache.key_cache(0).shape) == (5, 4, 4, 24) and tuple(cache.value_cache(0).shape) == (5, 4, 4, 16)
    assert cache.key_cache(2) is cache.key_cache(1) and cache.value_cache(2) is cache.value_cache(1)
    owned = [cache.key_cache(0), cache.value_cache(0), cache.key_cache(1), cache.value_cache(1)]
    assert sum(int(b.nbytes) for b in owned) == cache.nbytes == 5 * MIXED.bytes_per_block
    cache.key_cache(1)[3] = 2
    cache.copy_blocks([[3, 4]])  # the shared buffer is copied once, and seen through both layers
    assert float(cache.key_cache(2)[4].sum()) == 2 * 4 * 2 * 8


def test_explicit_num_blocks_wins():
    assert determine_num_blocks(SPEC, num_kv_blocks=10, kv_cache_memory=1, max_model_len=100) == 10


def test_byte_budget():
    assert determine_num_blocks(SPEC, kv_cache_memory=10 * BPB + BPB - 1, max_model_len=64) == 10


def test_gpu_rule():
    total, used, peak = 100 * BPB, 20 * BPB, 10 * BPB
    n = determine_num_blocks(SPEC, device="cuda", gpu_memory_utilization=0.9, total_device_bytes=total,
                             used_device_bytes=used, peak_activation_bytes=peak, max_model_len=16)
    assert n == (int(0.9 * total) - used - peak) // BPB == 60


def test_gpu_rule_needs_measurements():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        determine_num_blocks(SPEC, device="cuda", gpu_memory_utilization=1.5, total_device_bytes=1,
                             used_device_bytes=0, peak_activation_bytes=0)
    with pytest.raises(ValueError, match="peak_activation_bytes"):
        determine_num_blocks(SPEC, device="cuda", gpu_memory_utilization=0.9, total_device_bytes=1)


def test_cpu_default_sized_by_sequences():
    n = determine_num_blocks(SPEC, max_num_seqs=4, max_model_len=4096, free_ram_bytes=1 << 40)
    assert n == 4 * (CPU_EXPECTED_SEQ_TOKENS // 16)
    n = determine_num_blocks(SPEC, max_num_seqs=4, max_model_len=100, free_ram_bytes=1 << 40)
    assert n == 4 * 7  # min(max_model_len, expected) tokens per sequence


def test_cpu_default_capped_by_free_ram_and_absolute_cap():
    free = 1000 * BPB
    n = determine_num_blocks(SPEC, max_num_seqs=256, max_model_len=64, free_ram_bytes=free)
    assert n == int(free * CPU_MAX_FREE_RAM_FRACTION) // BPB
    big = KVCacheSpec.uniform(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="float32")
    n = determine_num_blocks(big, max_num_seqs=1024, max_model_len=2048, free_ram_bytes=1 << 50)
    assert n == CPU_MAX_KV_BYTES // big.bytes_per_block


def test_too_small_budgets_raise_with_numbers():
    with pytest.raises(ValueError, match=f"{BPB} bytes per block"):
        determine_num_blocks(SPEC, kv_cache_memory=BPB - 1)
    with pytest.raises(ValueError, match="max_model_len=1000"):
        determine_num_blocks(SPEC, kv_cache_memory=10 * BPB, max_model_len=1000)
    with pytest.raises(ValueError, match="max_model_len"):
        determine_num_blocks(SPEC, num_kv_blocks=3, max_model_len=64)
    with pytest.raises(ValueError, match="one block"):
        determine_num_blocks(SPEC, device="cuda", gpu_memory_utilization=0.5, total_device_bytes=100 * BPB,
                             used_device_bytes=40 * BPB, peak_activation_bytes=20 * BPB)
    with pytest.raises(ValueError, match="one block"):
        determine_num_blocks(SPEC, free_ram_bytes=BPB)


def test_free_ram_is_read():
    assert free_ram_bytes() > 0


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_buffers_shapes_and_nbytes(backend):
    if backend == "torch":
        pytest.importorskip("torch")
    cache = PagedKVCache(SPEC, 5, backend=backend)
    k = cache.key_cache(1)
    assert tuple(k.shape) == (5, 16, 4, 8)
    assert cache.nbytes == 5 * BPB
    assert sum(int(b.nbytes) for layer in range(2) for b in (cache.key_cache(layer), cache.value_cache(layer))) == cache.nbytes
    pytest.importorskip("torch")
    view = cache.torch_key_cache(1)  # zero-copy for both backends
    view[0, 0, 0, 0] = 7
    assert float(k[0, 0, 0, 0]) == 7


def _fill(cache, rng):
    for layer in range(cache.spec.num_layers):
        for buf in (cache.key_cache(layer), cache.value_cache(layer)):
            values = rng.standard_normal(tuple(buf.shape)).astype(np.float32)
            if isinstance(buf, np.ndarray):
                buf[...] = values
            else:
                import torch

                buf.copy_(torch.from_numpy(values))


def _snapshot(cache):
    bufs = [f(i) for i in range(cache.spec.num_layers) for f in (cache.key_cache, cache.value_cache)]
    return [b.copy() if isinstance(b, np.ndarray) else b.numpy().copy() for b in bufs]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_copy_blocks(backend):
    if backend == "torch":
        pytest.importorskip("torch")
    spec = KVCacheSpec.uniform(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32")
    cache = PagedKVCache(spec, 8, backend=backend)
    _fill(cache, np.random.default_rng(0))
    before = _snapshot(cache)
    copies = np.array([[1, 5], [5, 2], [3, 7]])  # block 5 is a source and a destination
    cache.copy_blocks(copies)
    after = _snapshot(cache)
    for old, new in zip(before, after):
        want = old.copy()
        want[[5, 2, 7]] = old[[1, 5, 3]]
        np.testing.assert_array_equal(new, want)
    cache.copy_blocks(np.zeros((0, 2), np.int64))
    with pytest.raises(ValueError, match="outside"):
        cache.copy_blocks([[0, 8]])
    with pytest.raises(ValueError, match="repeated"):
        cache.copy_blocks([[0, 1], [2, 1]])


def test_zero_and_free():
    cache = PagedKVCache(KVCacheSpec.uniform(1, 1, 2, 2, "float32"), 3)
    cache.key_cache(0)[...] = 1
    cache.zero()
    assert not cache.key_cache(0).any()
    cache.free()
    with pytest.raises(ValueError, match="freed"):
        cache.key_cache(0)


def test_torch_bfloat16_buffers():
    torch = pytest.importorskip("torch")
    cache = PagedKVCache(KVCacheSpec.uniform(1, 2, 4, 8, "bfloat16"), 3, backend="torch")
    assert cache.key_cache(0).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="bfloat16"):
        PagedKVCache(KVCacheSpec.uniform(1, 2, 4, 8, "bfloat16"), 3, backend="numpy")


def test_bad_cache_args():
    with pytest.raises(ValueError, match="backend"):
        PagedKVCache(SPEC, 3, backend="jax")
    with pytest.raises(ValueError, match="num_blocks"):
        PagedKVCache(SPEC, 0)


def _gpu_reason():
    from kvpage.cuda.interop import gpu_unavailable_reason

    return gpu_unavailable_reason()


_GPU_REASON = _gpu_reason()


@pytest.mark.gpu
@pytest.mark.skipif(_GPU_REASON is not None, reason=f"cupy backend: {_GPU_REASON}")
def test_cupy_buffers_and_dlpack_view():
    torch = pytest.importorskip("torch")
    cache = PagedKVCache(SPEC, 4, backend="cupy")
    k = cache.key_cache(0)
    k[1] = 3
    view = cache.torch_key_cache(0)
    assert view.is_cuda and view.data_ptr() == k.data.ptr
    assert float(view[1].float().mean()) == 3.0
    cache.copy_blocks([[1, 2]])
    assert float(view[2].float().mean()) == 3.0
    cache.free()
    assert torch is not None


def test_imports_stay_torch_free():
    code = ("import sys, kvpage, kvpage.storage.spec, kvpage.storage.sizing, kvpage.storage.paged_cache, "
            "kvpage.attention, kvpage.attention.cpu; "
            "bad = [m for m in ('torch', 'numba', 'cupy') if m in sys.modules]; print(bad); assert not bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_sizing_rule_names_the_precedence():
    from kvpage.storage.sizing import kv_sizing_rule

    assert kv_sizing_rule(num_kv_blocks=8, kv_cache_memory=1 << 20, device="cuda") == "explicit count"
    assert kv_sizing_rule(kv_cache_memory=1 << 20, device="cuda") == "byte budget"
    assert kv_sizing_rule(device="cuda:1") == "GPU profile"
    assert kv_sizing_rule(device="cpu") == "CPU default"
