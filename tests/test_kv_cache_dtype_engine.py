"""Quantized KV blocks through the whole engine: output independent of scheduling, and blocks
that move byte for byte through the host and disk tiers.

Every run is fp32 on a tiny random Llama. A token's stored bytes depend only on its own K/V
values (per-token scales) and attention reads K/V back from the cache, so greedy tokens must
be identical, token for token, whether a prompt is prefilled whole or in chunks, hits the
prefix cache or not, and is preempted and recomputed or not (a K/V value's last bit can
still follow the batch's row count through torch's matmuls, but on this model and these
prompts it never moves a token); and a block that went to the host or disk tier and came
back holds the very bytes it left with.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from kvpage import LLM, SamplingParams
from tiny_models import VOCAB, tiny_model

QUANTIZED = ("fp8_e4m3", "fp8_e5m2", "int8", "int4")
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
BASE = dict(block_size=4, num_kv_blocks=128, max_model_len=96, dtype="float32")


def _prompts(seed: int = 0) -> list[list[int]]:
    """Six prompts, every other one behind a shared 12-token prefix (three blocks)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, VOCAB, (12,), generator=g).tolist()
    lengths = (23, 30, 17, 26, 35, 21)
    return [(shared if i % 2 else []) + torch.randint(3, VOCAB, (n,), generator=g).tolist()
            for i, n in enumerate(lengths)]


@contextlib.contextmanager
def engine(model, kv_cache_dtype: str, **options):
    llm = LLM(model, **{**BASE, "kv_cache_dtype": kv_cache_dtype, **options})
    try:
        yield llm
        llm.check_integrity()
    finally:
        llm.close()
        llm.restore()


def _generate(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.metrics.num_cached_tokens for o in outs]


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def reference(llama):
    """Per format: each prompt prefilled whole, no prefix cache, a pool that never preempts."""
    results = {}
    for name in QUANTIZED:
        with engine(llama, name, enable_prefix_caching=False, enable_chunked_prefill=False,
                    max_num_batched_tokens=128) as llm:
            assert llm.stats()["kv_cache_dtype"] == name
            assert llm.runner.kv_cache.key_cache(0).dtype == torch.uint8
            results[name] = _generate(llm, _prompts())[0]
            assert llm.runner.kv_cache.key_cache(0).any(), "the cache should hold the prompts' bytes"
    return results


@pytest.mark.parametrize("name", QUANTIZED)
def test_chunked_prefill_gives_the_same_tokens(llama, reference, name):
    with engine(llama, name, enable_prefix_caching=False, max_num_batched_tokens=7) as llm:  # chunks cross blocks
        assert _generate(llm, _prompts())[0] == reference[name]


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_prefix_hit_gives_the_same_tokens(llama, reference, name):
    prompts = _prompts()
    with engine(llama, name, max_num_batched_tokens=7) as llm:
        first, _ = _generate(llm, prompts[:2])
        rest, cached = _generate(llm, prompts[2:])
    assert first + rest == reference[name]
    assert cached[1] >= 12 and cached[3] >= 12, cached  # prompts 3 and 5 reuse prompt 1's shared blocks


@pytest.mark.parametrize("name", QUANTIZED)
def test_preemption_and_recompute_give_the_same_tokens(llama, reference, name):
    with engine(llama, name, num_kv_blocks=24, enable_prefix_caching=False) as llm:
        tokens, _ = _generate(llm, _prompts())
        assert llm.stats()["num_preemptions"] > 0, "the pool should be too small for the batch"
    assert tokens == reference[name]


# ---------------------------------------------------------------------- tiers, byte for byte
def _block_bytes(llm: LLM, block: int) -> bytes:
    """One pool block as the disk tier stores it: every owner layer's K, then every V."""
    kv = llm.runner.kv_cache
    layers = kv.spec.owner_layers
    keys = [kv.torch_key_cache(i)[block].cpu().numpy().tobytes() for i in layers]
    values = [kv.torch_value_cache(i)[block].cpu().numpy().tobytes() for i in layers]
    return b"".join(keys + values)


def _cached_blocks(llm: LLM) -> dict[str, bytes]:
    """Every cached pool block's bytes, by block hash (hex)."""
    prefix_cache = llm.engine.scheduler.prefix_cache
    found = {}
    for block in range(llm.runner.kv_cache.num_blocks):
        entry = prefix_cache.cached_block(block)
        if entry is not None:
            found[entry[0].hex()] = _block_bytes(llm, block)
    return found


def _file_bytes(path: Path) -> bytes:
    from safetensors.torch import load

    tensors = load(path.read_bytes())
    assert tensors["key"].dtype == torch.uint8
    return tensors["key"].numpy().tobytes() + tensors["value"].numpy().tobytes()


@pytest.mark.parametrize("name", QUANTIZED)
def test_disk_files_hold_the_pools_bytes_and_a_restart_reads_them_back(llama, reference, name, tmp_path):
    prompts = _prompts()
    with engine(llama, name, kv_disk_cache=str(tmp_path)) as llm:
        assert _generate(llm, prompts)[0] == reference[name]
        assert llm.flush_kv_tiers()
        written = _cached_blocks(llm)
    files = sorted(tmp_path.glob("kvpage-*/*.safetensors"))
    assert files and len(list(tmp_path.iterdir())) == 1
    for path in files:  # a file is its block's bytes, codes and scales as the pool held them
        assert _file_bytes(path) == written[path.stem]
    with engine(llama, name, kv_disk_cache=str(tmp_path)) as llm:  # a restart: only the disk has them
        tokens, cached = _generate(llm, prompts)
        loaded = _cached_blocks(llm)
        assert llm.stats()["kv_disk_loads"] > 0
    assert tokens == reference[name]
    assert sum(cached) >= 4 * sum(len(p) // 4 for p in prompts) // 2, cached
    restored = {h: b for h, b in loaded.items() if h in written}
    assert restored and all(b == written[h] for h, b in restored.items())


@pytest.mark.parametrize("name", QUANTIZED)
def test_host_tier_round_trip_is_byte_for_byte(llama, reference, name):
    prompts = _prompts()
    with engine(llama, name, kv_offloading_size=0.001) as llm:
        assert _generate(llm, prompts)[0] == reference[name]
        before = _cached_blocks(llm)
        prefix_cache = llm.engine.scheduler.prefix_cache
        prefix_cache.evict(llm.engine.scheduler.pool.num_cached_blocks)  # to the host tier
        tokens, cached = _generate(llm, prompts)
        after = _cached_blocks(llm)
        assert llm.stats()["kv_host_loads"] > 0 and sum(cached) > 0
    assert tokens == reference[name]
    common = set(before) & set(after)
    assert common and all(after[h] == before[h] for h in common)


def test_an_int8_disk_cache_is_not_read_by_an_fp8_engine(llama, tmp_path):
    prompt = _prompts()[4]
    with engine(llama, "int8", kv_disk_cache=str(tmp_path)) as llm:
        llm.generate([prompt], GREEDY, use_tqdm=False)
    with engine(llama, "fp8", kv_disk_cache=str(tmp_path)) as llm:
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].metrics.num_cached_tokens == 0
        assert llm.stats()["kv_disk_loads"] == 0
    with engine(llama, "int8", kv_disk_cache=str(tmp_path)) as llm:  # its own format still reads them
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].metrics.num_cached_tokens > 0
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("kvpage-")]) == 2


def test_the_engine_gets_the_blocks_and_bytes_the_plan_prints(llama, tmp_path, capsys):
    from kvpage.entrypoints.cli.main import main

    llama.config.save_pretrained(tmp_path)
    for name in ("int4", "fp8"):
        assert main(["plan", str(tmp_path), "--max-model-len", "96", "--kv-cache-memory", "1MiB", "--block-size", "4",
                     "--dtype", "float32", "--kv-cache-dtype", name, "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        with engine(llama, name, num_kv_blocks=None, kv_cache_memory=1 << 20) as llm:
            stats = llm.stats()
        assert stats["num_blocks"] == plan["with_hybrid"]["num_blocks"]
        assert stats["kv_bytes_per_token"] == plan["bytes_per_token"]


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_bfloat16_model_runs_on_every_quantized_format(name):
    model = tiny_model("llama", dtype=torch.bfloat16)
    with engine(model, name, dtype="bfloat16") as llm:
        outs = llm.generate(_prompts()[:3], GREEDY, use_tqdm=False)
        assert llm.stats()["num_step_errors"] == 0
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
