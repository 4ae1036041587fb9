"""kvpage on Ray Serve: 2 replicas of a tiny model behind the prefix-aware router, on a local
Ray instance (2 CPUs, loopback) that this module starts and stops. Every wait is bounded.

The replica-failure test runs last: it kills a replica under load."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

pytest.importorskip("ray.serve")

from kvpage.entrypoints.ray_serve.app import build_app  # noqa: E402
from kvpage.entrypoints.ray_serve.local import deploy, local_serve, replica_actor_names, wait_for_replicas  # noqa: E402
from server_process import free_port, save_tiny_model  # noqa: E402

pytestmark = pytest.mark.ray

ENGINE = dict(block_size=4, num_kv_blocks=512, max_model_len=256, dtype="float32", num_threads=1, max_num_seqs=32,
              max_num_batched_tokens=256)
SERVER = dict(served_model_names=["tiny"], max_tokens_cap=64, max_body_bytes=65536)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    model_dir = save_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))
    with local_serve(num_cpus=2, port=free_port()) as url:
        deploy(build_app(model_dir, ENGINE, SERVER, num_replicas=2, replica_num_cpus=1), timeout_s=240)
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


def metrics(base: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def test_openai_client_completions_chat_and_streaming(client):
    out = client.completions.create(model="tiny", prompt="Hello there", max_tokens=8, temperature=0)
    assert out.usage.completion_tokens == 8 or out.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(model="tiny", prompt="Hello there", max_tokens=8,
                                                                   temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == out.choices[0].text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0)
    assert chat.choices[0].message.role == "assistant"
    streamed = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=6, temperature=0, stream=True,
                                              stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_errors_are_openai_shaped_4xx(base, client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="", max_tokens=4)
    assert bad.value.body["code"] == "invalid_request"
    with pytest.raises(openai.BadRequestError) as unknown:
        client.completions.create(model="other", prompt="x", max_tokens=4)
    assert unknown.value.body["code"] == "model_not_found"
    malformed = httpx.post(base + "/v1/completions", content=b"{not json", timeout=30,
                           headers={"content-type": "application/json"})
    assert malformed.status_code == 400 and malformed.json()["error"]["message"] == "malformed JSON body"
    huge = httpx.post(base + "/v1/completions", content=b"x" * 70000, timeout=30)
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "body_too_large"


def test_a_shared_prefix_stays_on_the_replica_that_caches_it(client, base):
    prefix = "You are tenant seven's assistant; answer briefly and politely. " * 2
    usages = [client.completions.create(model="tiny", prompt=prefix + f"question {i}?", max_tokens=2,
                                        temperature=0).usage for i in range(6)]
    # the first request fills the cache; every later one is routed to it and reuses the prefix
    assert all(u.prompt_tokens_details.cached_tokens >= (len(prefix) // 4) * 4 for u in usages[1:])
    deadline = time.monotonic() + 30
    while True:  # replica metrics arrive with the next routing-stats report
        m = metrics(base)
        replicas = {k for k in m if k.startswith("kvpage:prefix_cache_hits_total{")}
        if len(replicas) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(replicas) == 2, "both replicas' own metrics are re-exported, labelled by replica"
    assert m['kvpage:router_requests_total{rule="prefix"}'] >= 5
    assert 0 < m["kvpage:router_prefix_hit_rate_estimate"] <= 1


async def _completion(http: httpx.AsyncClient, i: int) -> int:
    body = {"model": "tiny", "prompt": f"request {i} " + "y" * (i % 13), "max_tokens": 64, "temperature": 0,
            "ignore_eos": True}
    return (await http.post("/v1/completions", json=body)).status_code


async def _stream(http: httpx.AsyncClient, i: int, first_chunk: asyncio.Event) -> tuple[bool, bool, bool]:
    """(bytes arrived before the end, it ended with [DONE], an in-band error came)."""
    body = {"model": "tiny", "prompt": f"stream {i}", "max_tokens": 64, "temperature": 0, "ignore_eos": True,
            "stream": True}
    started = done = errored = False
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            started = True
            first_chunk.set()
            if line == "data: [DONE]":
                done = True
            elif "error" in json.loads(line[6:]):
                errored = True
    return started, done, errored


def test_killing_a_replica_mid_run_loses_no_request_that_had_not_streamed(base):
    import ray

    victims = replica_actor_names()
    assert len(victims) == 2

    async def run() -> tuple[list, list]:
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            first_chunk = asyncio.Event()
            completions = [asyncio.create_task(_completion(http, i)) for i in range(32)]
            streams = [asyncio.create_task(_stream(http, i, first_chunk)) for i in range(8)]
            await asyncio.wait_for(first_chunk.wait(), 120)  # tokens flow: requests are in flight on both replicas
            ray.kill(ray.get_actor(victims[0], namespace="serve"), no_restart=True)
            return await asyncio.gather(*completions), await asyncio.gather(*streams)

    statuses, streams = asyncio.run(asyncio.wait_for(run(), 240))
    assert statuses == [200] * 32, "requests that had not started streaming are retried on the live replica"
    assert all(done for _, done, _ in streams), "every stream ends with [DONE], in-band error or not"
    m = metrics(base)
    retried = m.get('kvpage:ingress_replica_failures_total{outcome="retried"}', 0)
    in_stream = m.get('kvpage:ingress_replica_failures_total{outcome="in_stream"}', 0)
    assert retried + in_stream > 0, "the kill hit requests in flight"
    assert m.get('kvpage:ingress_replica_failures_total{outcome="gave_up"}', 0) == 0
    wait_for_replicas(2, timeout_s=180)  # Serve replaces the dead replica
    assert victims[0] not in replica_actor_names()
    assert httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "after", "max_tokens": 2},
                      timeout=60).status_code == 200
