"""The tiered prefix cache end to end: exact greedy output, restarts, and disk faults.

Every run is fp32 on tiny random models. A "conversation" workload sends
prompts over a pool far too small for them (so blocks are evicted and requests preempted),
then sends each prompt again with its output and a new message (the next turn), so the
second round hits blocks that only the host or disk tier still holds. Greedy tokens must
equal a run with the tiers off, token for token.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpage import LLM, SamplingParams
from kvpage.core.config import disk_entry_bytes
from kvpage.storage.tiers.disk_store import DiskKVStore
from tiny_models import VOCAB, kv_groups_of, tiny_model

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
BASE = dict(block_size=4, num_kv_blocks=24, max_model_len=96, dtype="float32")
TESTS = Path(__file__).resolve().parent


def _first_turns(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, VOCAB, (12,), generator=g).tolist()
    lengths = (23, 30, 17, 26, 35, 21)
    return [(shared if i % 2 else []) + torch.randint(3, VOCAB, (n,), generator=g).tolist()
            for i, n in enumerate(lengths)]


def _converse(llm: LLM, rounds: int = 2) -> tuple[list[list[list[int]]], list[list[int]]]:
    """Run ``rounds`` turns of every conversation; returns (outputs per round, cached tokens per round)."""
    prompts = _first_turns()
    g = torch.Generator().manual_seed(1)
    outputs, cached = [], []
    for _ in range(rounds):
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outs]
        outputs.append(tokens)
        cached.append([o.metrics.num_cached_tokens for o in outs])
        prompts = [p + t + torch.randint(3, VOCAB, (5,), generator=g).tolist() for p, t in zip(prompts, tokens)]
    return outputs, cached


def _check_drained(llm: LLM) -> None:
    scheduler = llm.engine.scheduler
    scheduler.check_integrity()
    assert scheduler.pool.num_free_blocks == scheduler.pool.num_blocks, "pool blocks leaked"
    for tier in (scheduler.offload.host, scheduler.offload.disk):
        if tier is not None:
            assert tier.num_free_slots + tier.num_used_slots == tier.num_slots


@contextlib.contextmanager
def engine(model, **options):
    # Without tiers a hybrid model gets one KV group per attention kind, and a block holds one
    # group's layers: the same bytes are more blocks. The tiers keep a single group.
    tiers = options.get("kv_offloading_size") or options.get("kv_disk_cache")
    base = dict(BASE, num_kv_blocks=BASE["num_kv_blocks"] * (1 if tiers else kv_groups_of(model)))
    llm = LLM(model, **{**base, **options})
    try:
        yield llm
    finally:
        llm.engine.close()
        llm.restore()


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def reference(llama):
    with engine(llama) as llm:
        return _converse(llm)[0]


TIERS = {
    "host": dict(kv_offloading_size=0.001),
    "disk": dict(kv_disk_cache="{dir}"),
    "host+disk": dict(kv_offloading_size=0.001, kv_disk_cache="{dir}"),
    "host, chunked 7": dict(kv_offloading_size=0.001, max_num_batched_tokens=7),
    "host+disk, unchunked": dict(kv_offloading_size=0.001, kv_disk_cache="{dir}", enable_chunked_prefill=False,
                                 max_num_batched_tokens=128),
}


def _options(name: str, tmp_path: Path) -> dict:
    return {k: (str(tmp_path / "kv") if v == "{dir}" else v) for k, v in TIERS[name].items()}


@pytest.mark.parametrize("tiers", list(TIERS))
def test_greedy_output_is_identical_with_tiers_on(llama, reference, tiers, tmp_path):
    with engine(llama, **_options(tiers, tmp_path)) as llm:
        outputs, cached = _converse(llm)
        stats = llm.stats()
        _check_drained(llm)
    assert outputs == reference, tiers
    assert stats["num_preemptions"] > 0, "the pool should be too small for the batch"
    assert stats["kv_host_loads"] + stats["kv_disk_loads"] > 0, "the second turn should hit a lower tier"
    assert sum(cached[1]) > sum(cached[0])


@pytest.mark.parametrize("family", ["gemma2", "gpt2", "qwen3"])
def test_other_families_are_exact_with_host_and_disk(family, tmp_path):
    model = tiny_model(family)
    with engine(model) as llm:
        expected = _converse(llm)[0]
    with engine(model, kv_offloading_size=0.001, kv_disk_cache=str(tmp_path / "kv"), max_num_batched_tokens=9) as llm:
        got = _converse(llm)[0]
        assert llm.stats()["kv_host_loads"] > 0
        _check_drained(llm)
    assert got == expected, family


def test_stats_report_every_tier(llama, tmp_path):
    with engine(llama, kv_offloading_size=0.001, kv_disk_cache=str(tmp_path / "kv")) as llm:
        _converse(llm)
        llm.flush_kv_tiers()
        stats = llm.stats()
    for key in ("kv_host_blocks", "kv_host_used_blocks", "kv_disk_blocks", "kv_disk_used_blocks", "kv_pool_evictions",
                "kv_host_evictions", "kv_disk_evictions", "kv_pool_hit_tokens", "kv_host_hit_tokens",
                "kv_disk_hit_tokens",
                "kv_host_stored_bytes", "kv_host_loaded_bytes", "kv_disk_written_bytes", "kv_disk_read_bytes",
                "kv_disk_errors_corrupt", "kv_disk_errors_full", "kv_disk_errors_read_only"):
        assert key in stats, key
    assert stats["kv_host_stored_bytes"] > 0 and stats["kv_disk_written_bytes"] > 0
    latency = stats["kv_tier_latency"]
    assert latency["host_store"]["count"] > 0 and latency["disk_store"]["count"] > 0


def test_reset_prefix_cache_empties_every_tier(llama, tmp_path):
    with engine(llama, kv_offloading_size=0.001, kv_disk_cache=str(tmp_path)) as llm:
        first = _converse(llm, rounds=1)[0]
        llm.flush_kv_tiers()
        assert _block_files(tmp_path)
        llm.reset_prefix_cache()
        llm.flush_kv_tiers()
        scheduler = llm.engine.scheduler
        assert scheduler.pool.num_cached_blocks == 0
        assert len(scheduler.offload.host) == 0 and len(scheduler.offload.disk) == 0
        assert not _block_files(tmp_path)
        assert _converse(llm, rounds=1)[0] == first
        _check_drained(llm)


# ---------------------------------------------------------------------- restart
RESTART_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from kvpage import LLM, SamplingParams
from kvpage.core.config import disk_entry_bytes
from tiny_models import VOCAB, tiny_model
prompt = torch.randint(3, VOCAB, (150,), generator=torch.Generator().manual_seed(7)).tolist()
llm = LLM(tiny_model("llama"), block_size=4, num_kv_blocks=64, max_model_len=200, dtype="float32",
          kv_disk_cache=sys.argv[1])
out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)[0]
llm.engine.close()
result = {{"cached": out.metrics.num_cached_tokens, "prompt": len(prompt), "tokens": out.outputs[0].token_ids}}
print(json.dumps(result))
"""


def _run_process(script: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_restarted_engine_serves_a_long_prompt_from_disk(tmp_path):
    script = RESTART_SCRIPT.format(tests=str(TESTS))
    first = _run_process(script, str(tmp_path))
    second = _run_process(script, str(tmp_path))
    assert first["cached"] == 0
    assert second["cached"] >= 0.9 * second["prompt"], second
    assert second["tokens"] == first["tokens"]


def test_another_model_never_reads_the_files(llama, tmp_path):
    prompt = _first_turns()[4]
    with engine(llama, kv_disk_cache=str(tmp_path)) as llm:
        llm.generate([prompt], GREEDY, use_tqdm=False)
    other = tiny_model("llama", seed=1)  # same architecture, other weights
    with engine(other, kv_disk_cache=str(tmp_path)) as llm:
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert out.metrics.num_cached_tokens == 0
    with engine(llama, kv_disk_cache=str(tmp_path), block_size=8) as llm:  # another block size
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].metrics.num_cached_tokens == 0
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("kvpage-")]) == 3


# ---------------------------------------------------------------------- faults
def _populate(llama, folder: Path) -> list[list[int]]:
    """One conversation round through a writable disk tier; returns its outputs."""
    with engine(llama, kv_disk_cache=str(folder)) as llm:
        outputs = _converse(llm, rounds=1)[0]
    return outputs


def _block_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("kvpage-*/*.safetensors"))


@pytest.mark.parametrize("how", ["flip", "truncate", "garbage", "empty"])
def test_corrupt_files_are_dropped_counted_and_recomputed(llama, reference, tmp_path, how, caplog):
    _populate(llama, tmp_path)
    files = _block_files(tmp_path)
    assert files
    for path in files:
        raw = bytearray(path.read_bytes())
        if how == "flip":
            raw[-5] ^= 0x5A  # tensor bytes: only the checksum can tell
        elif how == "truncate":
            raw = raw[: len(raw) // 3]
        elif how == "garbage":
            raw[8:40] = os.urandom(32)
        else:
            raw = bytearray()
        path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="kvpage"), engine(llama, kv_disk_cache=str(tmp_path)) as llm:
        outputs, cached = _converse(llm)
        stats = llm.stats()
        _check_drained(llm)
    assert outputs == reference  # nothing corrupt was served
    assert stats["kv_disk_errors_corrupt"] > 0 and stats["kv_disk_fetch_failures"] > 0
    assert "corrupt block file" in caplog.text


def test_a_size_cap_keeps_the_disk_tier_within_it(llama, reference, tmp_path):
    block_bytes = 2 * 2 * 2 * 16 * 4 * BASE["block_size"]  # K and V x layers x KV heads x head dim x fp32
    cap_gib = 12 * disk_entry_bytes(block_bytes) / 2**30  # room for 12 block files
    with engine(llama, kv_disk_cache=str(tmp_path), kv_disk_cache_size=cap_gib) as llm:
        outputs = _converse(llm)[0]
        llm.flush_kv_tiers()
        stats = llm.stats()
        _check_drained(llm)
    files = _block_files(tmp_path)
    assert outputs == reference
    assert stats["kv_disk_blocks"] == 12 and stats["kv_disk_evictions"] > 0
    assert len(files) <= 12 and sum(f.stat().st_size for f in files) <= cap_gib * 2**30


def test_a_full_disk_degrades_to_recompute(llama, reference, tmp_path, monkeypatch, caplog):
    def full(self, block_hash, key, value):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskKVStore, "write", full)
    with caplog.at_level(logging.WARNING, logger="kvpage"), \
            engine(llama, kv_disk_cache=str(tmp_path), kv_offloading_size=0.001) as llm:
        outputs = _converse(llm)[0]
        llm.flush_kv_tiers()
        llm.engine.step()  # an idle step takes the last failure reports
        stats = llm.stats()
        _check_drained(llm)
    assert outputs == reference
    assert stats["kv_disk_errors_full"] > 0 and stats["kv_disk_used_blocks"] == 0
    assert stats["kv_host_loads"] > 0  # the host tier is unaffected
    assert "No space left" in caplog.text and not _block_files(tmp_path)


@contextlib.contextmanager
def read_only(folder: Path):
    """Make ``folder`` (and its subfolders) unwritable: chmod, and ``chattr +i`` when run as root."""
    dirs = [folder] + [p for p in folder.rglob("*") if p.is_dir()]
    for d in dirs:
        d.chmod(0o555)
    immutable = []
    probe = folder / "probe"
    try:
        probe.touch()
    except OSError:
        pass
    else:  # root ignores permissions: make the folders immutable instead
        probe.unlink()
        for d in dirs:
            if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode == 0:
                immutable.append(d)
        try:
            probe.touch()
        except OSError:
            pass
        else:
            probe.unlink()
            _undo(dirs, immutable)
            pytest.skip("cannot make a folder read-only here (root without chattr)")
    try:
        yield
    finally:
        _undo(dirs, immutable)


def _undo(dirs, immutable) -> None:
    for d in immutable:
        subprocess.run(["chattr", "-i", str(d)], capture_output=True)
    for d in dirs:
        d.chmod(0o755)


def test_a_read_only_folder_serves_what_it_holds_and_saves_nothing(llama, reference, tmp_path, caplog):
    _populate(llama, tmp_path)
    before = {p.name for p in _block_files(tmp_path)}
    with read_only(tmp_path), caplog.at_level(logging.WARNING, logger="kvpage"), \
            engine(llama, kv_disk_cache=str(tmp_path)) as llm:
        outputs, cached = _converse(llm)
        stats = llm.stats()
        _check_drained(llm)
    assert outputs == reference
    assert sum(cached[0]) > 0, "the blocks already on disk are still served"
    assert stats["kv_disk_writable"] == 0 and stats["kv_disk_errors_read_only"] == 1
    assert stats["kv_disk_saves"] == 0 and {p.name for p in _block_files(tmp_path)} == before
    assert "not writable" in caplog.text


def test_a_folder_turning_read_only_mid_run_fails_no_request(llama, reference, tmp_path, caplog):
    folder = tmp_path / "kv"
    with caplog.at_level(logging.WARNING, logger="kvpage"), engine(llama, kv_disk_cache=str(folder)) as llm:
        llm.generate([[9, 9, 9, 9, 9]], GREEDY, use_tqdm=False)  # creates the model's folder
        llm.flush_kv_tiers()
        with read_only(folder):
            outputs = _converse(llm)[0]
            llm.flush_kv_tiers()
            llm.engine.step()
        stats = llm.stats()
        _check_drained(llm)
    assert outputs == reference
    assert stats["kv_disk_errors_read_only"] > 0 and "cannot write a block file" in caplog.text


def test_a_host_tier_larger_than_the_free_ram_is_refused(llama):
    with pytest.raises(ValueError, match="RAM is available"):
        LLM(llama, **BASE, kv_offloading_size=1e6)


def test_an_unusable_folder_is_one_warning_not_a_failure(llama, reference, tmp_path, caplog):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with caplog.at_level(logging.WARNING, logger="kvpage"), engine(llama, kv_disk_cache=str(not_a_dir)) as llm:
        outputs = _converse(llm)[0]
        assert llm.stats()["kv_disk_writable"] == 0
    assert outputs == reference and "cannot create" in caplog.text
