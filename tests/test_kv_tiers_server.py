"""A live server restarted on the same disk KV cache serves a repeated long prompt from it.

Two ``kvpage serve`` processes on 127.0.0.1, one after the other, on one ``--kv-disk-cache``
folder. The first computes a long prompt (its blocks are written through to disk) and is
stopped with SIGINT; the second, fresh, must report at least 90 % of the same prompt's
tokens as cached on its first request, answer the same text, and show the disk hits in
``/metrics``.
"""
from __future__ import annotations

import random

import httpx
import pytest

from server_process import running_server, save_tiny_model

ARGS = ("--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "256", "--max-tokens-cap", "16",
        "--stats-interval-s", "0")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))


def _complete(base: str, prompt: str) -> dict:
    response = httpx.post(base + "/v1/completions", timeout=120,
                          json={"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def _metrics(base: str) -> str:
    return httpx.get(base + "/metrics", timeout=10).text


def test_a_restarted_server_serves_a_repeated_long_prompt_from_disk(model_dir, tmp_path):
    rng = random.Random(3)
    prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ,.") for _ in range(200))
    args = (*ARGS, "--served-model-name", "tiny", "--kv-disk-cache", str(tmp_path / "kv"))
    with running_server(model_dir, *args) as base:
        first = _complete(base, prompt)
    with running_server(model_dir, *args) as base:
        second = _complete(base, prompt)
        metrics = _metrics(base)
    tokens = second["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * tokens
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    disk_hits = next(line for line in metrics.splitlines() if line.startswith('kvpage:kv_tier_hits_total{tier="disk"}'))
    assert float(disk_hits.rpartition(" ")[2]) >= 0.9 * tokens
    for family in ("kvpage:kv_tier_load_seconds_bucket", "kvpage:kv_tier_stored_bytes_total",
                   "kvpage:kv_tier_evictions_total", "kvpage:kv_disk_errors_total", "kvpage:kv_tier_used_blocks"):
        assert family in metrics, family
