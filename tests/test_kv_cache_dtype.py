"""``kv_cache_dtype``: capacity, buffers, plan, option checks and the disk tier's keying, per format.

The engine end to end (greedy output independent of scheduling, tier round trips) is in
``test_kv_cache_dtype_engine.py``, the command line in ``test_kv_cache_dtype_cli.py``. Byte counts here are exact: a format's bytes per row are
a contract (``kvpage.core.kv_formats``), and the engine's block counts follow from them.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvpage.core.config import EngineConfig
from kvpage.core.kv.kv_groups import KVCacheGroups
from kvpage.core.kv_formats import KV_CACHE_DTYPES, KVFormat
from kvpage.kernels.kv_quant import block_views
from kvpage.storage.paged_cache import PagedKVCache
from kvpage.storage.sizing import determine_num_blocks
from kvpage.storage.spec import KVCacheSpec, LayerKVSpec

QUANTIZED = ("fp8_e4m3", "fp8_e5m2", "int8", "int4")
GIB = 1 << 30
# (layers, KV heads, head size): SmolLM2-135M, and a Llama-3-8B-like model with 128-wide heads.
SHAPES = {"smollm2-135m": (30, 3, 64), "d128": (32, 8, 128)}
# Bytes per head and token, scales included: codes + (fp8: 1 exponent byte; int8: fp16 scale;
# int4: fp16 scale and minimum per group of 32 channels).
ROW_BYTES = {64: {"bfloat16": 128, "fp8_e4m3": 65, "fp8_e5m2": 65, "int8": 66, "int4": 32 + 8},
             128: {"bfloat16": 256, "fp8_e4m3": 129, "fp8_e5m2": 129, "int8": 130, "int4": 64 + 16}}
TARGETS = {"fp8_e4m3": 1.95, "fp8_e5m2": 1.95, "int8": 1.9, "int4": 3.2}


# ---------------------------------------------------------------------- capacity
@pytest.mark.parametrize("shape", list(SHAPES))
def test_capacity_at_an_equal_budget_meets_the_targets(shape):
    layers, heads, head_dim = SHAPES[shape]
    budget, block_size = 8 * GIB, 16
    blocks = {}
    for name in ("bfloat16", *QUANTIZED):
        spec = KVCacheSpec.uniform(layers, heads, head_dim, block_size, "bfloat16", name)
        token_bytes = 2 * layers * heads * ROW_BYTES[head_dim][name]
        assert spec.bytes_per_token == token_bytes
        assert spec.bytes_per_block == block_size * token_bytes
        blocks[name] = determine_num_blocks(spec, kv_cache_memory=budget, max_model_len=2048)
        assert blocks[name] == budget // (block_size * token_bytes)  # exactly what fits, scales included
    for name, target in TARGETS.items():
        # bytes per token meet the target exactly; block counts, up to the last partial block
        # (int4 holds exactly 3.2x: 13107 blocks against 4096 at 8 GiB for 128-wide heads)
        assert ROW_BYTES[head_dim]["bfloat16"] / ROW_BYTES[head_dim][name] >= target, (shape, name)
        assert blocks[name] >= int(target * blocks["bfloat16"]), (shape, name, blocks)


def test_hybrid_blocks_take_the_format_too():
    layers = (LayerKVSpec.symmetric(3, 64, sliding_window=32), LayerKVSpec.symmetric(3, 64)) * 3
    spec = KVCacheSpec(layers, 16, "bfloat16", "int8")
    groups = spec.kv_groups(hybrid=True)
    assert groups.is_hybrid
    assert spec.bytes_per_block_of(groups) == groups.group_size * 16 * 2 * 3 * 66


def test_auto_is_the_model_dtype_and_fp8_is_e4m3():
    spec = KVCacheSpec.uniform(2, 2, 16, 4, "float16")
    assert spec.kv_format == KVFormat("float16") and not spec.cache_format.quantized
    fp8 = dataclasses.replace(spec, kv_cache_dtype="fp8")
    assert fp8.kv_format.name == "fp8_e4m3" and fp8.cache_format.block_size == 4 and fp8.cache_format.quantized
    assert dataclasses.replace(spec, kv_cache_dtype="float32").bytes_per_token == 2 * spec.bytes_per_token


# ---------------------------------------------------------------------- option checks
def _one_line(exc: BaseException) -> str:
    message = str(exc)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("bad", ["int3", "fp16x", "", "FP8", None, 8])
def test_a_bad_name_is_one_line_listing_the_choices(bad):
    with pytest.raises(ValueError) as info:
        EngineConfig(kv_cache_dtype=bad)
    message = _one_line(info.value)
    assert message.startswith("kv_cache_dtype must be one of") and all(name in message for name in KV_CACHE_DTYPES)
    if isinstance(bad, str):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
            KVCacheSpec.uniform(1, 1, 16, 4, "float32", bad)


def test_llm_refuses_a_bad_name_before_loading_anything():
    from kvpage import LLM

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of") as info:
        LLM("no-such-model-folder", kv_cache_dtype="int2")
    _one_line(info.value)


def test_every_name_is_accepted():
    for name in KV_CACHE_DTYPES:
        assert EngineConfig(kv_cache_dtype=name).kv_cache_dtype == name
        KVCacheSpec.uniform(1, 1, 16, 4, "float32", name)


def test_an_odd_head_size_cannot_take_int4():
    with pytest.raises(ValueError, match="layer 1: kv_cache_dtype int4 .* even head size, not 15") as info:
        KVCacheSpec((LayerKVSpec.symmetric(1, 16), LayerKVSpec(1, 16, 1, 15)), 4, "float32", "int4")
    _one_line(info.value)
    KVCacheSpec((LayerKVSpec(1, 16, 1, 15),), 4, "float32", "int8")  # other formats take any size


def test_check_backend_fits_refuses_what_a_quantized_cache_cannot_hold():
    from kvpage.engine.builder import check_backend_fits

    mla = KVCacheSpec((LayerKVSpec(4, 24, 4, 8),), 4, "float32", "fp8")
    with pytest.raises(ValueError, match=r"layer 0 has K \[4, 24\] and V \[4, 8\] per token \(MLA\).*kv_cache_dtype auto") as info:
        check_backend_fits(mla, "cpu")
    _one_line(info.value)
    keys_only = KVCacheSpec((LayerKVSpec.symmetric(2, 16), LayerKVSpec(1, 32, 1, 0)), 4, "float32", "int8")
    with pytest.raises(ValueError, match="layer 1 stores keys only"):
        check_backend_fits(keys_only, "cpu")
    check_backend_fits(dataclasses.replace(mla, kv_cache_dtype="auto"), "cpu")  # unquantized: as before
    check_backend_fits(KVCacheSpec.uniform(2, 2, 16, 4, "float32", "int4"), "cpu")
    # An unquantized cache of another dtype: the fast kernels attend in the query's dtype.
    other = KVCacheSpec.uniform(2, 2, 16, 4, "float32", "float16")
    with pytest.raises(ValueError, match="kv_cache_dtype float16 differs from the model's dtype float32") as info:
        check_backend_fits(other, "cpu")
    _one_line(info.value)
    check_backend_fits(other, "reference")


# ---------------------------------------------------------------------- buffers
def _backends() -> list[str]:
    return ["numpy", "torch"]


def _spec(name: str, model_dtype: str = "float32") -> KVCacheSpec:
    # Two layouts: a plain layer and a wider one (per-layer shapes), and a layer reusing layer 0.
    layers = (LayerKVSpec.symmetric(2, 16), LayerKVSpec.symmetric(3, 32), LayerKVSpec.symmetric(2, 16, reuses=0))
    return KVCacheSpec(layers, 4, model_dtype, name)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("name", ["auto", "float16", *QUANTIZED])
def test_buffers_have_the_formats_shape_dtype_and_bytes(backend, name):
    spec = _spec(name)
    cache = PagedKVCache(spec, 5, backend=backend)
    fmt = spec.kv_format
    for layer, (heads, head_dim) in enumerate(((2, 16), (3, 32), (2, 16))):
        for buf in (cache.key_cache(layer), cache.value_cache(layer)):
            assert tuple(buf.shape) == fmt.buffer_shape(5, 4, heads, head_dim)
            assert str(buf.dtype).removeprefix("torch.") == fmt.storage_dtype
            if fmt.quantized:
                assert tuple(buf.shape) == (5, 4 * heads * fmt.row_bytes(head_dim))
    assert cache.key_cache(2) is cache.key_cache(0)
    owned = {id(b): b for i in (0, 1) for b in (cache.key_cache(i), cache.value_cache(i))}.values()
    assert cache.nbytes == 5 * spec.bytes_per_block == sum(b.size * b.itemsize if backend == "numpy"
                                                            else b.numel() * b.element_size() for b in owned)
    assert cache.cache_format == spec.cache_format and cache.kv_format == fmt


def _gpu_reason():
    from kvpage.cuda.interop import gpu_unavailable_reason

    return gpu_unavailable_reason()


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason="cupy backend: no GPU")
@pytest.mark.parametrize("name", QUANTIZED)
def test_cupy_quantized_buffers_and_their_torch_views(name):
    cache = PagedKVCache(_spec(name), 4, backend="cupy")
    k = cache.key_cache(1)
    assert str(k.dtype) == "uint8" and tuple(k.shape) == (4, 4 * 3 * cache.kv_format.row_bytes(32))
    k[1] = 7
    view = cache.torch_key_cache(1)
    assert view.is_cuda and view.dtype == torch.uint8 and view.data_ptr() == k.data.ptr
    cache.copy_blocks([[1, 3]])
    assert bool((view[3] == 7).all()) and cache.nbytes == 4 * cache.spec.bytes_per_block
    cache.free()


@pytest.mark.parametrize("name", QUANTIZED)
def test_hybrid_group_buffers_are_quantized_too(name):
    layers = (LayerKVSpec.symmetric(2, 16, sliding_window=8), LayerKVSpec.symmetric(2, 16)) * 2
    spec = KVCacheSpec(layers, 4, "float32", name)
    groups = spec.kv_groups(hybrid=True)
    cache = PagedKVCache(spec, 6, backend="torch", groups=groups)
    assert tuple(cache.key_cache(0).shape) == (6, 4 * 2 * spec.kv_format.row_bytes(16))
    assert cache.key_cache(0).dtype == torch.uint8
    assert cache.nbytes == 6 * spec.bytes_per_block_of(groups) == 6 * groups.group_size * 4 * 2 * 2 * \
        spec.kv_format.row_bytes(16)


def _random_bytes(cache: PagedKVCache, rng) -> None:
    for layer in cache.spec.owner_layers:
        for buf in (cache.key_cache(layer), cache.value_cache(layer)):
            data = rng.integers(0, 256, size=tuple(buf.shape), dtype=np.uint8)
            buf[...] = data if isinstance(buf, np.ndarray) else torch.from_numpy(data)


def _block_bytes(cache: PagedKVCache, block: int) -> bytes:
    parts = []
    for layer in cache.spec.owner_layers:
        for buf in (cache.key_cache(layer), cache.value_cache(layer)):
            row = buf[block]
            parts.append((row if isinstance(row, np.ndarray) else row.numpy()).tobytes())
    return b"".join(parts)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("name", QUANTIZED)
def test_copy_blocks_moves_a_quantized_block_byte_for_byte(backend, name):
    cache = PagedKVCache(_spec(name), 6, backend=backend)
    _random_bytes(cache, np.random.default_rng(0))
    before = [_block_bytes(cache, b) for b in range(6)]
    cache.copy_blocks([[1, 4], [4, 2], [0, 5]])  # block 4 is a source and a destination
    after = [_block_bytes(cache, b) for b in range(6)]
    assert after[4] == before[1] and after[2] == before[4] and after[5] == before[0]
    assert [after[b] for b in (0, 1, 3)] == [before[b] for b in (0, 1, 3)]
    # The codes and the scales of a block moved together: the views see the same rows.
    src = block_views(cache.key_cache(1), cache.kv_format, 4, 3, 32)
    assert all(bytes(np.asarray(view[4]).tobytes()) == bytes(np.asarray(view[1]).tobytes()) for view in src)
    cache.zero()
    assert not any(any(_block_bytes(cache, b)) for b in range(6))
    cache.free()
    with pytest.raises(ValueError, match="freed"):
        cache.key_cache(0)


def test_bfloat16_quantized_formats_work_on_numpy_buffers():
    # The model's dtype does not matter to a quantized buffer: uint8 works on every backend.
    cache = PagedKVCache(_spec("int8", "bfloat16"), 2, backend="numpy")
    assert cache.key_cache(0).dtype == np.uint8
    with pytest.raises(ValueError, match="bfloat16 needs the torch backend"):
        PagedKVCache(_spec("auto", "bfloat16"), 2, backend="numpy")


# ---------------------------------------------------------------------- tiers
@pytest.mark.parametrize("name", QUANTIZED)
def test_host_tier_and_disk_files_hold_the_blocks_bytes(name, tmp_path):
    from kvpage.core.block_hash import BlockHash
    from kvpage.storage.tiers import disk_block_shape
    from kvpage.storage.tiers.disk_store import DiskKVStore
    from kvpage.storage.tiers.host_buffers import HostKVBuffers

    spec = KVCacheSpec.uniform(3, 2, 32, 4, "float32", name)
    cache = PagedKVCache(spec, 6, backend="torch")
    _random_bytes(cache, np.random.default_rng(1))
    original = [_block_bytes(cache, b) for b in range(6)]
    host = HostKVBuffers(cache, 4)
    assert host.nbytes == 4 * spec.bytes_per_block
    host.store(np.array([[1, 0], [3, 2], [5, 3]]))
    disk = DiskKVStore(str(tmp_path), "a" * 64, disk_block_shape(spec), torch.uint8)
    assert disk.open() == (True, None)
    assert disk_block_shape(spec) == (3, 4 * 2 * spec.kv_format.row_bytes(32))
    keys, values = host.gather_pool([5])
    written = disk.write(BlockHash(bytes(32)), keys[0], values[0])
    assert written >= 2 * 3 * 4 * 2 * spec.kv_format.row_bytes(32)
    cache.zero()
    host.load(np.array([[0, 0], [2, 4], [3, 1]]))
    assert _block_bytes(cache, 0) == original[1] and _block_bytes(cache, 4) == original[3]
    assert _block_bytes(cache, 1) == original[5]
    key, value, _ = disk.read(BlockHash(bytes(32)))
    host.write_slot(1, key, value)
    host.load(np.array([[1, 5]]))
    assert _block_bytes(cache, 5) == original[5]


def test_the_disk_fingerprint_names_the_format():
    from kvpage.storage.tiers.fingerprint import FINGERPRINT_VERSION, model_fingerprint
    from tiny_models import tiny_model

    model = tiny_model("llama")
    prints = {name: model_fingerprint(model, KVCacheSpec.uniform(2, 2, 16, 4, "float32", name))
              for name in ("float32", "bfloat16", *QUANTIZED)}
    assert len(set(prints.values())) == len(prints)
    assert model_fingerprint(model, KVCacheSpec.uniform(2, 2, 16, 4, "float32", "auto")) == prints["float32"]
    assert model_fingerprint(model, KVCacheSpec.uniform(2, 2, 16, 4, "float32", "fp8")) == prints["fp8_e4m3"]
    assert FINGERPRINT_VERSION.endswith("/3")  # 3: fp8 rows are stored rotated, which version 2's were not


def test_an_int8_disk_folder_is_not_read_as_fp8(tmp_path):
    """fp8 and int8 rows of 64 differ by one byte; e4m3 and e5m2 rows not at all: only the
    fingerprint (hence the folder) keeps them apart, and a store refuses a foreign file."""
    from kvpage.core.block_hash import BlockHash
    from kvpage.storage.tiers import disk_block_shape
    from kvpage.storage.tiers.disk_store import CorruptEntry, DiskKVStore
    from kvpage.storage.tiers.fingerprint import model_fingerprint
    from tiny_models import tiny_model

    model = tiny_model("llama")
    stores = {}
    for name in ("int8", "fp8_e4m3", "fp8_e5m2"):
        spec = KVCacheSpec.uniform(2, 2, 16, 4, "float32", name)
        stores[name] = DiskKVStore(str(tmp_path), model_fingerprint(model, spec), disk_block_shape(spec), torch.uint8)
        assert stores[name].open()[0]
    block = torch.zeros(disk_block_shape(KVCacheSpec.uniform(2, 2, 16, 4, "float32", "fp8")), dtype=torch.uint8)
    stores["fp8_e4m3"].write(BlockHash(bytes(32)), block, block.clone())
    assert len({store.dir for store in stores.values()}) == 3
    assert stores["fp8_e5m2"].scan() == [] and stores["int8"].scan() == []
    # A file copied into the other folder by hand is refused on its fingerprint.
    target = stores["fp8_e5m2"].path(BlockHash(bytes(32)))
    target.write_bytes(stores["fp8_e4m3"].path(BlockHash(bytes(32))).read_bytes())
    with pytest.raises(CorruptEntry, match="fingerprint"):
        stores["fp8_e5m2"].read(BlockHash(bytes(32)))


def test_kv_groups_single_covers_the_spec():
    spec = KVCacheSpec.uniform(2, 2, 16, 4, "float32", "int4")
    assert spec.bytes_per_block_of(KVCacheGroups.single(2)) == spec.bytes_per_block
