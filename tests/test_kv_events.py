"""KV events over ZeroMQ: a subscriber rebuilds exactly what every tier holds.

The engine publishes to a SUB socket this test binds on 127.0.0.1 (vLLM's convention: an
address without ``*`` is connected to), and serves replays on a loopback ROUTER. Live
batches may miss the first messages (a PUB drops what it sends before it is connected), so
the test also asks for a replay from sequence 0 and merges by sequence number. Every wait
is bounded.
"""
from __future__ import annotations

import socket
import time

import pytest
import torch

msgspec = pytest.importorskip("msgspec")  # the events extra
zmq = pytest.importorskip("zmq")

from kvpage import LLM, SamplingParams  # noqa: E402
from kvpage.core.block_hash import external_hash  # noqa: E402
from kvpage.engine.kv_events_publisher import END_SEQ, KVEventBatch, decode_batch  # noqa: E402
from tiny_models import VOCAB, tiny_model  # noqa: E402

WAIT_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _drain_live(sub, quiet_s: float = 0.5) -> dict[int, bytes]:
    got, deadline, last = {}, time.monotonic() + WAIT_S, time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - last < quiet_s:
        if sub.poll(50):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            got[int.from_bytes(seq, "big")] = payload
            last = time.monotonic()
    return got


def _replay(context, endpoint: str, start: int = 0) -> dict[int, bytes]:
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        got, deadline = {}, time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if not dealer.poll(100):
                continue
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return got
            got[int.from_bytes(seq, "big")] = payload
        raise AssertionError("the replay did not end in time")
    finally:
        dealer.close(linger=0)


def _rebuild(batches: list[KVEventBatch]) -> set[tuple[int, str]]:
    state: set[tuple[int, str]] = set()
    for batch in batches:
        for event in batch.events:
            name = type(event).__name__
            if name == "AllBlocksCleared":
                state.clear()
            elif name == "BlockStored":
                if event.medium == "GPU":  # the pool tier knows its tokens and chain
                    assert len(event.token_ids) == event.block_size * len(event.block_hashes)
                    assert event.parent_block_hash is None or (event.parent_block_hash, "GPU") in state
                state.update((h, event.medium) for h in event.block_hashes)
            else:
                state.difference_update((h, event.medium) for h in event.block_hashes)
    return state


def _engine_state(llm: LLM) -> set[tuple[int, str]]:
    scheduler = llm.engine.scheduler
    offload = scheduler.offload
    state = {(external_hash(h), "GPU") for h in scheduler.prefix_cache.cached_hashes()}
    state |= {(external_hash(h), "CPU") for h in offload.host.ready_hashes()}
    state |= {(external_hash(h), "DISK") for h in offload.disk.ready_hashes()}
    return state


def test_the_event_stream_rebuilds_every_tier(tmp_path):
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    replay = f"tcp://127.0.0.1:{_free_port()}"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}",
              "replay_endpoint": replay, "topic": "kv"}
    llm = LLM(tiny_model("llama"), block_size=4, num_kv_blocks=24, max_model_len=96, dtype="float32",
              kv_offloading_size=20 * 1024 / 2**30, kv_disk_cache=str(tmp_path), kv_disk_cache_size=40 * 4096 / 2**30,
              kv_events_config=config)
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (30, 41, 25, 33, 38)]
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        for _ in range(2):  # the second turn re-sends each history: hits in every tier
            outs = llm.generate(prompts, params, use_tqdm=False)
            prompts = [p + o.outputs[0].token_ids + [7, 8, 9] for p, o in zip(prompts, outs)]
        llm.flush_kv_tiers()
        llm.engine.step()  # an idle step publishes what the disk threads reported
        stats = llm.stats()
        assert stats["kv_host_evictions"] > 0 and stats["kv_disk_evictions"] > 0  # every tier churned
        assert stats["kv_disk_loads"] > 0  # a request that waited for disk reads loads what they brought
        expected = _engine_state(llm)
        time.sleep(0.2)
        payloads = _drain_live(sub)
        payloads.update(_replay(context, replay))
    finally:
        llm.engine.close()
        llm.restore()
        sub.close(linger=0)
    seqs = sorted(payloads)
    assert seqs == list(range(len(seqs))), "sequence numbers have gaps"
    batches = [decode_batch(payloads[s]) for s in seqs]
    assert type(batches[0].events[0]).__name__ == "AllBlocksCleared"
    assert {type(e).__name__ for b in batches for e in b.events} == {"AllBlocksCleared", "BlockStored",
                                                                     "BlockRemoved"}
    assert {e.medium for b in batches for e in b.events if hasattr(e, "medium")} == {"GPU", "CPU", "DISK"}
    assert _rebuild(batches) == expected
    assert len(expected) > 0


def test_the_wire_format_is_vllms():
    """Tagged msgpack maps inside a batch map, the fields vLLM's subscribers read."""
    from kvpage.core import kv_events as core
    from kvpage.engine.kv_events_publisher import to_wire

    digest = bytes(range(32))
    events = [to_wire(core.BlockStored((digest,), None, (1, 2, 3, 4), 4, "GPU")),
              to_wire(core.BlockRemoved((digest,), "CPU")), to_wire(core.AllBlocksCleared())]
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(KVEventBatch(ts=1.5, events=events)))
    assert raw["ts"] == 1.5
    stored, removed, cleared = raw["events"]
    assert stored == {"type": "BlockStored", "block_hashes": [external_hash(digest)], "parent_block_hash": None,
                      "token_ids": [1, 2, 3, 4], "block_size": 4, "lora_id": None, "medium": "GPU"}
    assert removed == {"type": "BlockRemoved", "block_hashes": [external_hash(digest)], "medium": "CPU"}
    assert cleared == {"type": "AllBlocksCleared"}
    assert 0 <= external_hash(digest) < 2**64


def test_bad_kv_events_configs_are_refused():
    from kvpage.core.config import EngineConfig

    for bad, needle in (("{not json", "not valid JSON"), ('{"enable_kv_cache_events": true, "color": 1}', "unknown"),
                        ('{"publisher": "kafka"}', "publisher"), ("[1]", "JSON object"),
                        ('{"hwm": 0}', "hwm")):
        with pytest.raises(ValueError, match=needle):
            EngineConfig(kv_events_config=bad)
    assert EngineConfig(kv_events_config='{"enable_kv_cache_events": true}').kv_events_config.publisher == "zmq"
