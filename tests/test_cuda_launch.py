"""Host-side parts of ``kvpage.cuda``: light import, launch-shape arithmetic, input checks.

None of these compile or launch a kernel, and none import ``numba.cuda``.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvpage.cuda.launch_config import (MIN_PARTITION_TOKENS, SHARED_BUDGET_BYTES, choose_splits, choose_tile,
                                       prefill_rows, shared_bytes)


def test_import_is_light_and_compiles_nothing() -> None:
    code = ("import sys, kvpage, kvpage.cuda as kc; kc.paged_attention; kc.store_kv; "
            "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'cupy') or m.startswith('numba.cuda')]; "
            "print(heavy)")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("rows,head_dim", [(1, 64), (8, 128), (16, 128), (32, 128), (8, 256), (4, 8)])
def test_choose_tile_is_largest_power_of_two_that_fits(rows: int, head_dim: int) -> None:
    tile = choose_tile(rows, head_dim)
    assert tile & (tile - 1) == 0
    assert shared_bytes(rows, head_dim, tile) <= SHARED_BUDGET_BYTES
    assert tile == 64 or shared_bytes(rows, head_dim, 2 * tile) > SHARED_BUDGET_BYTES


def test_choose_tile_rejects_huge_heads() -> None:
    with pytest.raises(ValueError, match="shared memory"):
        choose_tile(64, 1024)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8, 16, 32])
def test_prefill_rows_hold_whole_tokens(group: int) -> None:
    rows = prefill_rows(group)
    assert rows % group == 0 and rows >= group


@pytest.mark.parametrize("blocks,ctx,tile,sms,req", [
    (64, 2048, 32, 132, None), (8, 32768, 32, 132, None), (1024, 4096, 32, 132, None),
    (4, 100, 8, 132, None), (2, 13, 2, 1, 3), (2, 1, 4, 1, 5), (16, 4096, 64, 132, 7)])
def test_choose_splits_covers_context(blocks: int, ctx: int, tile: int, sms: int, req) -> None:
    splits, partition = choose_splits(blocks, ctx, tile, sms, req)
    assert partition % tile == 0
    assert splits * partition >= ctx > (splits - 1) * partition
    if req is not None:
        assert splits <= req
    else:
        assert splits == 1 or partition >= MIN_PARTITION_TOKENS - tile


def test_choose_splits_fills_the_machine_for_small_batches() -> None:
    splits, _ = choose_splits(num_blocks=8, max_context=32768, tile=32, num_sms=132)
    assert splits * 8 >= 132  # at least one block per SM


def test_choose_splits_rejects_zero() -> None:
    with pytest.raises(ValueError, match="num_splits"):
        choose_splits(4, 100, 8, 1, 0)


def _args(**over):
    rng = np.random.default_rng(0)
    a = dict(q=rng.standard_normal((3, 4, 8)).astype(np.float32),
             key_cache=np.zeros((4, 4, 2, 8), np.float32), value_cache=np.zeros((4, 4, 2, 8), np.float32),
             query_start_loc=np.array([0, 1, 3], np.int32), seq_lens=np.array([2, 5], np.int32),
             block_tables=np.array([[0, 1], [2, 3]], np.int32), scaling=0.5)
    a.update(over)
    return a


@pytest.mark.parametrize("over,match", [
    (dict(q=np.zeros((3, 3, 8), np.float32)), "multiple of num_kv_heads"),
    (dict(q=np.zeros((3, 4, 16), np.float32)), "head_dim mismatch"),
    (dict(q=np.zeros((3, 4, 8), np.float64)), "float16 or float32"),
    (dict(value_cache=np.zeros((4, 4, 2, 4), np.float32)), "two equal caches"),
    (dict(query_start_loc=np.array([0, 3], np.int32)), "query_start_loc must be"),
    (dict(query_start_loc=np.array([0, 2, 1], np.int32)), "rise from 0"),
    (dict(seq_lens=np.array([2, 1], np.int32)), "seq_lens must be"),
    (dict(block_tables=np.zeros((3, 2), np.int32)), "block_tables must be"),
    (dict(sinks=np.zeros(2, np.float32)), "sinks must be"),
    (dict(sliding_window=-2), "sliding_window"),
])
def test_paged_attention_rejects_bad_input(over: dict, match: str) -> None:
    from kvpage.cuda import paged_attention

    with pytest.raises(ValueError, match=match):
        paged_attention(**_args(**over))


def test_store_kv_rejects_bad_input() -> None:
    from kvpage.cuda import store_kv

    kc = np.zeros((2, 4, 2, 8), np.float32)
    k = np.zeros((3, 2, 8), np.float32)
    with pytest.raises(ValueError, match="k/v must be"):
        store_kv(kc, kc.copy(), np.zeros((3, 1, 8), np.float32), k, np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="slot_mapping must be"):
        store_kv(kc, kc.copy(), k, k, np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="num_blocks \\* block_size"):
        store_kv(kc, kc.copy(), k, k, np.array([0, 1, 8], np.int64))
    with pytest.raises(ValueError, match="device array"):  # in-place writes need device caches
        store_kv(kc, kc.copy(), k, k, np.array([0, 1, 7], np.int64))


def test_repo_root_on_sys_path_does_not_hide_nvidia_cuda() -> None:
    """From the repo root (``python -m pytest``), top-level ``cuda`` is our directory; it must
    still expose NVIDIA's ``cuda.bindings``/``cuda.pathfinder`` to numba-cuda and CuPy."""
    pytest.importorskip("numba")
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = "import numba.cuda, cuda, cuda.bindings; print(cuda.bindings.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert str(root / "cuda") not in out.stdout


def test_kernel_argument_views_are_made_once_per_layout(monkeypatch) -> None:
    """``as_kernel_arg`` caches its zero-copy views by (device, address, shape, strides,
    dtype): the same layout again reuses the view; any other layout gets its own."""
    import torch

    from kvpage.cuda import interop

    made = []
    monkeypatch.setattr(interop, "simulator_enabled", lambda: False)
    monkeypatch.setattr(interop, "array_kind", lambda x: interop.TORCH)  # CPU tensors stand in for CUDA ones
    monkeypatch.setattr(interop, "_zero_copy_view", lambda x: made.append(x) or object())
    monkeypatch.setattr(interop, "_ARG_VIEWS", {})
    cache = torch.zeros(4, 16, 2, 8)
    first = interop.as_kernel_arg(cache)
    assert interop.as_kernel_arg(cache) is first and interop.as_kernel_arg(cache.view(4, 16, 2, 8)) is first
    others = [cache[1:], cache.view(torch.int32), cache.transpose(1, 2), cache.reshape(64, 16)]
    views = [interop.as_kernel_arg(x) for x in others]
    assert len({id(v) for v in views} | {id(first)}) == 5 and len(made) == 5
    monkeypatch.setattr(interop, "MAX_ARG_VIEWS", 5)
    interop.as_kernel_arg(torch.zeros(3))  # a full cache starts over rather than growing
    assert len(interop._ARG_VIEWS) == 1
