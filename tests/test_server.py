"""Live-server tests: ``kvpage serve`` on 127.0.0.1 driven by the official ``openai``
client and by httpx. Every loop is bounded in count and time."""
from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from kvpage import LLM, SamplingParams
from server_process import running_server, save_tiny_model

# float32: dtype "auto" is bf16 on CPUs with bf16 instructions, and bf16 rounding depends on
# batch composition, while these tests compare served and offline greedy text exactly.
SERVE_ARGS = ("--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "512", "--max-model-len", "128",
              "--max-num-seqs", "96",
              "--max-num-batched-tokens", "256", "--max-tokens-cap", "64", "--max-body-bytes", "65536")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(model_dir, *SERVE_ARGS, "--served-model-name", "tiny") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(model_dir):
    llm = LLM(model_dir, block_size=4, num_kv_blocks=512, max_model_len=128, dtype="float32")
    yield llm
    llm.restore()


def metrics(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def wait_until_idle(base: str, timeout_s: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(base)
        if m["kvpage:num_requests_running"] == 0 and m["kvpage:num_requests_waiting"] == 0 \
                and m["kvpage:kv_cache_usage_perc"] == 0:
            return m
        assert time.monotonic() < deadline, f"server never went idle: {m}"
        time.sleep(0.1)


# ---------------------------------------------------------------------- openai client
def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion_matches_offline_greedy(client, offline):
    out = client.completions.create(model="tiny", prompt="Hello there", max_tokens=8, temperature=0)
    expected = offline.generate(["Hello there"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
    assert out.choices[0].text == expected.outputs[0].text
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_logit_bias_bans_and_forces_tokens(client, offline):
    """OpenAI's ``logit_bias``: -100 bans the greedy token, +100 forces another; the offline
    engine with the same bias gives the same text."""
    greedy = SamplingParams(max_tokens=4, temperature=0)
    first = offline.generate(["Hello there"], greedy, use_tqdm=False)[0].outputs[0].token_ids[0]
    forced = (first + 7) % 50
    for bias in ({first: -100}, {forced: 100}):
        out = client.completions.create(model="tiny", prompt="Hello there", max_tokens=4, temperature=0,
                                        logit_bias={str(k): v for k, v in bias.items()})
        biased = offline.generate(["Hello there"], SamplingParams(max_tokens=4, temperature=0, logit_bias=bias),
                                  use_tqdm=False)[0].outputs[0]
        assert out.choices[0].text == biased.text
        assert biased.token_ids[0] != first if bias == {first: -100} else set(biased.token_ids) == {forced}


def test_chat_prompt_logprobs_score_the_templated_prompt(server):
    body = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": 1}
    response = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    usage, scored = response.json()["usage"], response.json()["prompt_logprobs"]
    assert len(scored) == usage["prompt_tokens"] and scored[0] is None  # vLLM's shape: nothing before token 0
    assert all(isinstance(entry, dict) and entry for entry in scored[1:])


def test_chat_completion_uses_the_chat_template(client, offline):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=6, temperature=0)
    prompt = offline.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                   add_generation_prompt=True)
    expected = offline.generate([prompt], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.outputs[0].text


def test_streaming_completion_and_chat_concatenate(client):
    full = client.completions.create(model="tiny", prompt="stream", max_tokens=10, temperature=0).choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(model="tiny", prompt="stream", max_tokens=10,
                                                                   temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == full
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "s"}], max_tokens=7,
                                          temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(chat)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "s"}], max_tokens=7,
                                           temperature=0).choices[0].message.content
    assert text == whole
    assert chunks[-1].usage.completion_tokens == 7


def test_streamed_logprobs_offsets_run_on_across_chunks(client):
    """``text_offset`` counts from the start of the choice's text in every chunk, as in the
    whole (non-streamed) answer."""
    kwargs = dict(model="tiny", prompt="offsets", max_tokens=10, temperature=0, logprobs=1)
    whole = client.completions.create(**kwargs).choices[0].logprobs
    offsets = [o for c in client.completions.create(stream=True, **kwargs) if c.choices and c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset]
    assert offsets == whole.text_offset and len(offsets) == 10


def test_n_samples_and_seeded_sampling(client):
    kwargs = dict(model="tiny", prompt="seeded", max_tokens=8, temperature=1.0, seed=7, n=3)
    first, second = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1


def test_stop_strings_and_max_tokens(client):
    base = client.completions.create(model="tiny", prompt="stop", max_tokens=12, temperature=0).choices[0].text
    stop = base[4:6]
    out = client.completions.create(model="tiny", prompt="stop", max_tokens=12, temperature=0, stop=[stop])
    assert out.choices[0].text == base[: base.find(stop)] and out.choices[0].finish_reason == "stop"
    assert client.completions.create(model="tiny", prompt="stop", max_tokens=3,
                                     temperature=0).usage.completion_tokens == 3


def test_min_tokens_masks_stop_ids_through_the_server(client, offline):
    """vLLM's ``min_tokens``: the stop id the model wants first is masked until min_tokens
    tokens exist, so the request runs to its length; offline and served agree."""
    prompt = "Hello there"
    first = offline.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
    stop = first.outputs[0].token_ids[0]
    early = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                      extra_body={"stop_token_ids": [stop]})
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens == 1  # it would stop at once
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                    extra_body={"stop_token_ids": [stop], "min_tokens": 6})
    params = SamplingParams(max_tokens=6, min_tokens=6, temperature=0, stop_token_ids=[stop])
    expected = offline.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert stop not in expected.token_ids and len(expected.token_ids) == 6
    assert out.choices[0].text == expected.text and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 6


def test_cached_tokens_are_reported(client):
    prefix = "a shared prefix that is long enough to fill blocks: "
    client.completions.create(model="tiny", prompt=prefix + "one", max_tokens=1, temperature=0)
    out = client.completions.create(model="tiny", prompt=prefix + "two", max_tokens=1, temperature=0)
    assert out.usage.prompt_tokens_details.cached_tokens >= (len(prefix) // 4) * 4


# ---------------------------------------------------------------------- load and disconnects
def test_64_concurrent_streams_are_complete_and_exact(server, offline):
    prompts = [f"request number {i} " + "x" * (i % 17) for i in range(64)]
    expected = [o.outputs[0].text for o in offline.generate(
        prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)]

    async def one(client: httpx.AsyncClient, prompt: str) -> str:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True,
                "ignore_eos": True}
        text, done = [], False
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        assert done
        return "".join(text)

    async def run_all():
        async with httpx.AsyncClient(base_url=server, timeout=120) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, p) for p in prompts)), timeout=240)

    assert asyncio.run(run_all()) == expected
    m = wait_until_idle(server)
    assert m["kvpage:num_free_blocks"] == 512


def test_disconnect_mid_stream_frees_blocks(server):
    async def cut():
        async with httpx.AsyncClient(base_url=server, timeout=60) as client:
            body = {"model": "tiny", "prompt": "long running " * 3, "max_tokens": 64, "temperature": 0,
                    "stream": True, "ignore_eos": True}
            for _ in range(4):
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    lines = 0
                    async for line in response.aiter_lines():
                        lines += line.startswith("data: ")
                        if lines >= 3:
                            break  # leaving the block closes the connection mid-stream

    asyncio.run(cut())
    m = wait_until_idle(server)
    assert m["kvpage:num_free_blocks"] == 512


# ---------------------------------------------------------------------- bad input
BAD_BODIES = [
    ("/v1/completions", b"{not json", "malformed"),
    ("/v1/completions", {"model": "tiny"}, "prompt"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "lots"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10_000}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x" * 300}, "context length"),
    ("/v1/completions", {"prompt": "x" * 100, "max_tokens": 60}, "maximum context length is 128"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream=true"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "token ids"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 200}}, r"\[-100, 100\]"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"100000": 5}}, "outside the vocabulary"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "needs logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "needs content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1,
                              "stream": True}, "stream=false"),
    ("/v1/completions", {"prompt": [1, 2, 100000]}, "vocabulary"),
    ("/v1/completions", {"prompt": ""}, "empty"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, "does not exist"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
]


@pytest.mark.parametrize("path, body, needle", BAD_BODIES)
def test_bad_requests_get_openai_400s(server, path, body, needle):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    response = httpx.post(server + path, timeout=30, **kwargs)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert re.search(needle, error["message"], re.IGNORECASE), error["message"]
    assert httpx.get(server + "/health", timeout=10).status_code == 200


def test_oversized_body_gets_413(server):
    response = httpx.post(server + "/v1/completions", json={"prompt": "y" * 100_000}, timeout=30)
    assert response.status_code == 413 and "exceeds" in response.json()["error"]["message"]
    assert httpx.get(server + "/health", timeout=10).status_code == 200


def test_openai_client_sees_bad_request_errors(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", temperature=5)


# ---------------------------------------------------------------------- metrics
def test_metrics_exist_and_move(server, client):
    before = metrics(server)
    for name in ("kvpage:kv_cache_usage_perc", "kvpage:kv_cache_fragmentation_perc", "kvpage:num_requests_running",
                 "kvpage:num_requests_waiting", "kvpage:prefix_cache_queries_total", "kvpage:prefix_cache_hits_total",
                 "kvpage:num_preemptions_total", "kvpage:prompt_tokens_total", "kvpage:generation_tokens_total",
                 "kvpage:time_to_first_token_seconds_count", "kvpage:inter_token_latency_seconds_count",
                 "kvpage:e2e_request_latency_seconds_count"):
        assert name in before, name
    client.completions.create(model="tiny", prompt="metrics please", max_tokens=5, temperature=0)
    after = metrics(server)
    assert after["kvpage:generation_tokens_total"] >= before["kvpage:generation_tokens_total"] + 5
    assert after["kvpage:prompt_tokens_total"] > before["kvpage:prompt_tokens_total"]
    assert after["kvpage:e2e_request_latency_seconds_count"] == before["kvpage:e2e_request_latency_seconds_count"] + 1
    assert after["kvpage:inter_token_latency_seconds_count"] >= before["kvpage:inter_token_latency_seconds_count"] + 4


# ---------------------------------------------------------------------- a second server: key and queue bound
@pytest.fixture(scope="module")
def guarded_server(model_dir):
    with running_server(model_dir, "--block-size", "4", "--num-kv-blocks", "64", "--max-model-len", "128",
                        "--api-key", "s3cret", "--max-num-seqs", "1", "--max-waiting", "1") as base:
        yield base


def test_api_key_is_required(guarded_server):
    body = {"prompt": "hi", "max_tokens": 2}
    assert httpx.post(guarded_server + "/v1/completions", json=body, timeout=30).status_code == 401
    wrong = httpx.post(guarded_server + "/v1/completions", json=body, timeout=30,
                       headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    ok = openai.OpenAI(base_url=guarded_server + "/v1", api_key="s3cret", max_retries=0)
    assert ok.completions.create(model=ok.models.list().data[0].id, prompt="hi", max_tokens=2).choices
    assert httpx.get(guarded_server + "/health", timeout=10).status_code == 200  # health needs no key


def test_full_waiting_queue_gets_503_with_retry_after(guarded_server):
    headers = {"Authorization": "Bearer s3cret"}
    # Long enough that the one running request outlasts the flood's arrival.
    body = {"prompt": "busy " * 4, "max_tokens": 100, "ignore_eos": True, "temperature": 0}

    async def flood():
        async with httpx.AsyncClient(base_url=guarded_server, headers=headers, timeout=120) as client:
            return await asyncio.wait_for(asyncio.gather(*(client.post("/v1/completions", json=body)
                                                           for _ in range(8))), timeout=180)

    responses = asyncio.run(flood())
    codes = sorted(r.status_code for r in responses)
    assert 200 in codes and 503 in codes, codes
    refused = next(r for r in responses if r.status_code == 503)
    assert refused.headers["retry-after"] and refused.json()["error"]["code"] == "queue_full"


def test_graceful_shutdown_ends_streams_and_exits(model_dir):
    """SIGINT with a stream in flight: the stream ends (finished or cut) and the process exits."""
    import signal
    import subprocess
    import sys

    from server_process import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvpage", "serve", model_dir, "--port", str(port),
                             "--block-size", "4", "--num-kv-blocks", "64", "--max-model-len", "128",
                             "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "server did not start"
            time.sleep(0.25)
        body = {"prompt": "keep going", "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGINT)
            try:
                for _ in lines:  # drains what is left; ends when the server closes the stream
                    pass
            except httpx.HTTPError:
                pass  # a cut stream is an acceptable end
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
