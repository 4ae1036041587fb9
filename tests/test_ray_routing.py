"""The pieces of kvpage's Ray Serve scale-out that need no running Ray: block hashes against the
radix cache, the routing rule, routing keys, the in-process ASGI bridge, metric re-export."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kvpage.core.block_hash import prompt_block_hashes
from kvpage.core.kv.block_pool import BlockPool
from kvpage.core.kv.radix_cache import RadixCache
from kvpage.entrypoints.ray_serve.prefix_policy import ReplicaView, matched_blocks, rank_replicas


# ---------------------------------------------------------------------- block hashes
def test_radix_cache_reports_the_hashes_a_router_computes():
    pool = BlockPool(num_blocks=16, block_size=4)
    cache = RadixCache(pool)
    tokens = list(range(10, 30))  # 5 full blocks
    blocks = pool.allocate(5)
    cache.insert(tokens, blocks)
    other = tokens[:8] + [99] * 8  # shares two blocks, then differs
    other_blocks = blocks[:2] + pool.allocate(2)
    cache.insert(other, other_blocks)
    reported = set(cache.block_hashes())
    assert len(reported) == 7
    assert set(prompt_block_hashes(tokens, 4)) <= reported and set(prompt_block_hashes(other, 4)) <= reported
    assert matched_blocks(prompt_block_hashes(tokens[:12] + [5, 5, 5, 5], 4), reported) == 3
    assert len(cache.block_hashes(max_blocks=3)) == 3


def test_block_hashes_name_whole_prefixes():
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 5, 6, 7, 8]
    ha, hb = prompt_block_hashes(a, 4), prompt_block_hashes(b, 4)
    assert len(ha) == 2 and ha[1] != hb[1], "the same second block after different first blocks differs"
    assert prompt_block_hashes(a + [1, 2], 4) == ha, "only full blocks have hashes"
    assert prompt_block_hashes(a, 4, max_blocks=1) == ha[:1]


# ---------------------------------------------------------------------- the rule
def _view(name, cached=(), load=0):
    return ReplicaView(name, set(cached), len(cached), load)


def test_longest_cached_prefix_wins_then_load_breaks_ties():
    prompt = [11, 12, 13, 14]
    decision = rank_replicas(prompt, [_view("a", [11], 0), _view("b", [11, 12, 13], 3), _view("c", [], 0)])
    assert decision.rule == "prefix" and decision.ranking[0] == "b" and decision.matched_blocks == 3
    tie = rank_replicas(prompt, [_view("a", [11, 12, 13], 2), _view("b", [11, 12, 13], 1)])
    assert tie.ranking == ("b", "a")


def test_a_short_shared_preamble_does_not_attract_traffic():
    prompt = list(range(10))
    decision = rank_replicas(prompt, [_view("a", [0, 1], 1), _view("b", [], 0)], min_match_fraction=0.5)
    assert decision.rule == "miss" and decision.ranking[0] == "b"


def test_imbalance_falls_back_to_least_loaded():
    prompt = [1, 2, 3]
    decision = rank_replicas(prompt, [_view("hot", [1, 2, 3], 20), _view("idle", [], 2)], imbalance_threshold=8)
    assert decision.rule == "imbalanced" and decision.ranking == ("idle", "hot")
    within = rank_replicas(prompt, [_view("hot", [1, 2, 3], 9), _view("idle", [], 2)], imbalance_threshold=8)
    assert within.rule == "prefix" and within.ranking[0] == "hot"


def test_a_miss_goes_to_the_least_loaded_then_the_emptiest():
    decision = rank_replicas([7, 8], [_view("full", [1, 2, 3], 0), _view("empty", [], 0), _view("busy", [], 4)])
    assert decision.rule == "miss" and decision.ranking == ("empty", "full", "busy")
    with pytest.raises(ValueError):
        rank_replicas([1], [])


# ---------------------------------------------------------------------- routing keys
@pytest.fixture(scope="module")
def tokenizer():
    from server_process import CHAT_TEMPLATE
    from tiny_models import char_tokenizer

    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_routing_keys_follow_the_replicas_tokenization(tokenizer):
    from kvpage.entrypoints.ray_serve.routing_key import routing_key
    from kvpage.entrypoints.openai import handlers
    from kvpage.entrypoints.openai.protocol import ChatCompletionRequest

    body = {"model": "m", "prompt": "abcdefghij", "max_tokens": 1}
    key = routing_key("/v1/completions", json.dumps(body).encode(), tokenizer, 4)
    assert key.num_prompt_tokens == 10 and key.block_size == 4
    assert list(key.block_hashes) == prompt_block_hashes(tokenizer.encode("abcdefghij"), 4)
    chat = {"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    ids = handlers.chat_token_ids(tokenizer, ChatCompletionRequest.model_validate(chat))
    key = routing_key("/v1/chat/completions", json.dumps(chat).encode(), tokenizer, 4)
    assert list(key.block_hashes) == prompt_block_hashes(ids, 4) and key.num_prompt_tokens == len(ids)
    ids_key = routing_key("/v1/completions", json.dumps({"prompt": [5, 6, 7, 8, 9]}).encode(), tokenizer, 4)
    assert list(ids_key.block_hashes) == prompt_block_hashes([5, 6, 7, 8], 4)


@pytest.mark.parametrize("path,body", [("/v1/completions", b"{not json"), ("/v1/completions", b'{"prompt": ""}'),
                                       ("/v1/chat/completions", b'{"messages": 3}'), ("/health", b"")])
def test_bad_or_unkeyed_requests_get_the_empty_key(tokenizer, path, body):
    from kvpage.entrypoints.ray_serve.routing_key import RoutingKey, routing_key

    assert routing_key(path, body, tokenizer, 4) == RoutingKey.empty()


# ---------------------------------------------------------------------- the ASGI bridge
def test_asgi_bridge_streams_head_then_body_and_disconnects_on_close():
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from kvpage.entrypoints.ray_serve.asgi_bridge import HttpHead, HttpRequest, run_asgi

    app = FastAPI()
    closed = asyncio.Event()

    @app.post("/echo")
    async def echo(body: dict):
        return {"got": body}

    @app.get("/stream")
    async def stream():
        async def chunks():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
            finally:
                closed.set()
        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def run():
        items = [x async for x in run_asgi(app, HttpRequest("POST", "/echo", "", (("content-type", "application/json"),),
                                                            b'{"a": 1}'))]
        assert isinstance(items[0], HttpHead) and items[0].status == 200
        assert json.loads(b"".join(items[1:])) == {"got": {"a": 1}}
        missing = [x async for x in run_asgi(app, HttpRequest("GET", "/nope", "", (), b""))]
        assert missing[0].status == 404
        gen = run_asgi(app, HttpRequest("GET", "/stream", "", (), b""))
        head = await gen.__anext__()
        assert dict(head.headers)["content-type"].startswith("text/event-stream")
        assert (await gen.__anext__()).startswith(b"data: 0")
        await gen.aclose()  # the ingress's client went away
        await asyncio.wait_for(closed.wait(), 5)

    asyncio.run(asyncio.wait_for(run(), 30))


# ---------------------------------------------------------------------- metrics
def test_router_metrics_reexport_replica_metrics_with_a_label():
    from prometheus_client import generate_latest

    from kvpage.entrypoints.ray_serve.router_metrics import RouterMetrics

    metrics = RouterMetrics()
    metrics.observe("prefix", 100, 80)
    metrics.observe("miss", 100, 0)
    metrics.set_replica_texts({"r1": "# TYPE kvpage:num_free_blocks gauge\nkvpage:num_free_blocks 7.0\n",
                               "r2": "# TYPE kvpage:num_free_blocks gauge\nkvpage:num_free_blocks 9.0\n"})
    text = generate_latest(metrics.registry).decode()
    assert 'kvpage:num_free_blocks{replica="r1"} 7.0' in text and 'kvpage:num_free_blocks{replica="r2"} 9.0' in text
    assert "kvpage:router_prefix_hit_rate_estimate 0.4" in text
    assert 'kvpage:router_requests_total{rule="prefix"} 1.0' in text


# ---------------------------------------------------------------------- configuration
def test_the_serve_config_file_builds_through_kvpage_serves_parser():
    pytest.importorskip("ray.serve")
    import yaml

    from kvpage.entrypoints.cli.ray_app import _argv, app_builder

    config = yaml.safe_load((Path(__file__).parents[1] / "docs" / "ray-serve.yaml").read_text())
    args = config["applications"][0]["args"]
    assert _argv({"model": "m", "block_size": 8, "enable_prefix_caching": False, "replicas": 3}) == [
        "serve", "m", "--block-size", "8", "--no-enable-prefix-caching", "--replicas", "3"]
    app = app_builder(args)
    assert type(app).__name__ == "Application"
    with pytest.raises(SystemExit):
        app_builder({"model": "m", "router": "nonsense"})
