"""Live-server tests of what vLLM users expect beyond plain completions: the seed's exact
command line through the official ``openai`` client, the start-up log and warm-up, the
stats line, echo / prompt log-probabilities, presence and frequency penalties,
``/tokenize`` and ``/detokenize``, and per-request deadlines."""
from __future__ import annotations

import json
import os
import re
import sys
import time

import httpx
import numpy as np
import openai
import pytest
import torch

from kvpage import LLM, SamplingParams
from server_process import log_path, running_server, save_tiny_model

NUM_BLOCKS = 256
ARGS = ("--block-size", "4", "--num-kv-blocks", str(NUM_BLOCKS), "--max-model-len", "256", "--max-tokens-cap", "200",
        "--served-model-name", "tiny", "--log-level", "info", "--stats-interval-s", "0.5", "--dtype", "float32")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(model_dir, *ARGS) as base:
        yield base


@pytest.fixture(scope="module")
def offline(model_dir):
    llm = LLM(model_dir, block_size=4, num_kv_blocks=NUM_BLOCKS, max_model_len=256, dtype="float32")
    yield llm
    llm.restore()


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=60)


def server_log(base: str) -> str:
    with open(log_path(int(base.rsplit(":", 1)[1]))) as f:
        return f.read()


def free_blocks(base: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvpage:num_free_blocks "):
            return float(line.split()[1])
    raise AssertionError("no kvpage:num_free_blocks")


def wait_for_free_blocks(base: str, expected: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while free_blocks(base) != expected:
        assert time.monotonic() < deadline, "blocks were not freed"
        time.sleep(0.1)


# ---------------------------------------------------------------------- the seed's command line
def test_the_seed_command_line_serves_the_openai_client(model_dir):
    kvpage = os.path.join(os.path.dirname(sys.executable), "kvpage")
    command = [kvpage, "serve", "--port", "{port}", "--gpu-memory-utilization", "0.95", "--block-size", "16",
               "--max-num-seqs", "256", "--enable-chunked-prefill", "True", "--max-num-batched-tokens", "2048",
               "--enable-prefix-caching", "--model", model_dir]
    with running_server(None, command=command) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        (model,) = [m.id for m in client.models.list().data]
        out = client.completions.create(model=model, prompt="Hello there", max_tokens=6, temperature=0)
        assert out.choices[0].finish_reason in ("length", "stop") and out.usage.prompt_tokens == 11
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0, stream=True)
        assert [c for c in chat if c.choices and c.choices[0].finish_reason]
        scored = client.completions.create(model=model, prompt="Hello there", max_tokens=0, echo=True, logprobs=1)
        assert scored.choices[0].text == "Hello there" and scored.choices[0].logprobs.token_logprobs[0] is None
        log = server_log(base)
    assert "--gpu-memory-utilization does not apply on cpu" in log
    assert re.search(r"KV cache: \d+ blocks of 16 tokens .*sized by the CPU default rule", log)
    assert log.index("warm-up done") < log.index("GET /health HTTP/1.1\" 200")


# ---------------------------------------------------------------------- start-up log and stats line
def test_startup_log_names_model_device_threads_and_kv_rule(server):
    log = server_log(server)
    assert re.search(r"model .*: dtype float32, device cpu, threads \d+, attention backend \w+ "
                     r"\((native (AVX-512|AVX2) kernels|numba kernels \(native ones unavailable\))", log)
    assert f"KV cache: {NUM_BLOCKS} blocks of 4 tokens" in log and "sized by the explicit count rule" in log
    assert "warming up" in log and "warm-up done in" in log
    assert re.search(r"scheduler: up to \d+ sequences and \d+ tokens a step, chunked prefill on, "
                     r"step-time target auto \(6x the decodes' cost, at least 50 ms\)", log)
    assert re.search(r"ready in [\d.]+ s: engine built in [\d.]+ s, warm-up [\d.]+ s", log)
    assert "does not apply" not in log  # --gpu-memory-utilization was not given


def test_stats_line_reports_throughput(server):
    post(server, "/v1/completions", {"prompt": "stats " * 5, "max_tokens": 20, "ignore_eos": True, "temperature": 0})
    deadline = time.monotonic() + 20
    while True:
        rates = [float(m) for m in re.findall(r"Avg generation throughput: ([\d.]+) tokens/s", server_log(server))]
        if any(rates):
            break
        assert time.monotonic() < deadline, "no stats line with generation throughput"
        time.sleep(0.25)
    line = next(l for l in server_log(server).splitlines() if "Avg generation throughput" in l
                and not l.split("Avg generation throughput: ")[1].startswith("0.0"))
    for field in ("Avg prompt throughput", "Running:", "Waiting:", "KV cache usage:", "KV fragmentation:",
                  "Prefix cache hit rate:", "Preemptions:"):
        assert field in line


# ---------------------------------------------------------------------- echo and prompt log-probabilities
def _reference_prompt_logprobs(offline, ids):
    out = offline.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    return [e.logprob for e in out.prompt_logprobs[1:]]


def test_echo_with_max_tokens_0_returns_prompt_logprobs_in_openai_format(server, offline):
    prompt = "The quick brown fox"
    body = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}).json()
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    ids = offline.tokenizer.encode(prompt)
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert lp["tokens"] == [offline.tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][1:], _reference_prompt_logprobs(offline, ids), atol=1e-5)
    assert all(2 <= len(top) <= 3 and top[tok] == value
               for tok, top, value in zip(lp["tokens"][1:], lp["top_logprobs"][1:], lp["token_logprobs"][1:]))
    assert lp["text_offset"] == list(range(len(prompt)))
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)


def test_echo_with_generated_tokens_and_token_id_prompts(server, offline):
    ids = offline.tokenizer.encode("score me")
    body = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 2, "echo": True, "logprobs": 1,
                                            "temperature": 0}).json()
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    assert choice["text"].startswith("score me") and len(lp["tokens"]) == len(ids) + 2
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
    np.testing.assert_allclose(lp["token_logprobs"][1:len(ids)], _reference_prompt_logprobs(offline, ids), atol=1e-5)


def test_vllm_prompt_logprobs_field(server, offline):
    ids = offline.tokenizer.encode("rank these")
    body = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 1}).json()
    entries = body["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry in zip(ids[1:], entries[1:]):
        mine = entry[str(token)]
        assert mine["rank"] >= 1 and mine["decoded_token"] == offline.tokenizer.decode([token])
        assert min(e["rank"] for e in entry.values()) == 1 and len(entry) <= 2


@pytest.mark.parametrize("body, param, needle", [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "needs echo"),
    ({"prompt": "hi", "max_tokens": 2, "prompt_logprobs": 1, "stream": True}, "stream", "stream=false"),
    ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs", "less than or equal"),
    ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty", "less than or equal"),
    ({"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty", "greater than or equal"),
    ({"prompt": "hi", "timeout": 0}, "timeout", "greater than 0"),
    ({"prompt": "hi", "timeout": "soon"}, "timeout", "number"),
])
def test_bad_echo_penalty_and_timeout_requests_are_400(server, body, param, needle):
    response = post(server, "/v1/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"], error


# ---------------------------------------------------------------------- penalties
def test_presence_and_frequency_penalties_match_offline(server, offline):
    kw = dict(max_tokens=24, temperature=0, ignore_eos=True, presence_penalty=1.5, frequency_penalty=2.0)
    body = post(server, "/v1/completions", {"prompt": "aaaa", **kw}).json()
    expected = offline.generate(["aaaa"], SamplingParams(**kw), use_tqdm=False)[0].outputs[0].text
    plain = offline.generate(["aaaa"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].text
    assert body["choices"][0]["text"] == expected
    assert max(expected.count(c) for c in set(expected)) <= max(plain.count(c) for c in set(plain))


# ---------------------------------------------------------------------- tokenize / detokenize
def test_tokenize_and_detokenize(server, offline):
    tok = offline.tokenizer
    body = post(server, "/tokenize", {"prompt": "Hi there", "return_token_strs": True}).json()
    assert body["tokens"] == tok.encode("Hi there") and body["count"] == 8 and body["max_model_len"] == 256
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(text, add_special_tokens=False) and chat["token_strs"] is None
    assert post(server, "/detokenize", {"tokens": body["tokens"]}).json() == {"prompt": "Hi there"}
    info = httpx.get(server + "/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == tok.eos_token and info["model_max_length"] == 256


@pytest.mark.parametrize("path, body, needle", [
    ("/detokenize", {"tokens": [5, 100000]}, "outside the vocabulary"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/tokenize", {}, "exactly one of prompt and messages"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "does not exist"),
])
def test_bad_tokenizer_requests_are_400(server, path, body, needle):
    response = post(server, path, body)
    assert response.status_code == 400 and needle in response.json()["error"]["message"], response.text


# ---------------------------------------------------------------------- deadlines
def test_request_timeout_ends_with_length_and_frees_blocks(server):
    body = {"prompt": "deadline " * 6, "max_tokens": 200, "ignore_eos": True, "temperature": 0, "timeout": 0.1}
    started = time.monotonic()
    out = post(server, "/v1/completions", body).json()
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] < 200 and time.monotonic() - started < 10
    wait_for_free_blocks(server, NUM_BLOCKS)


def test_streamed_request_timeout_sends_the_finish_reason(server):
    body = {"prompt": "stream deadline", "max_tokens": 200, "ignore_eos": True, "stream": True, "timeout": 0.1, "n": 2}
    reasons, done = {}, False
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                for choice in json.loads(line[6:])["choices"]:
                    if choice["finish_reason"]:
                        reasons[choice["index"]] = choice["finish_reason"]
    assert done and reasons == {0: "length", 1: "length"}
    wait_for_free_blocks(server, NUM_BLOCKS)


def test_server_wide_max_request_seconds(model_dir):
    with running_server(model_dir, "--block-size", "4", "--num-kv-blocks", "128", "--max-model-len", "256",
                        "--max-tokens-cap", "200", "--max-request-seconds", "0.2") as base:
        body = {"prompt": "server deadline", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
        out = post(base, "/v1/completions", body).json()
        assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] < 200
        # A request's own longer timeout does not extend the server's deadline.
        out = post(base, "/v1/completions", {**body, "timeout": 60}).json()
        assert out["usage"]["completion_tokens"] < 200
        wait_for_free_blocks(base, 128)


def test_hf_forward_agrees_with_the_served_prompt_logprobs(server, model_dir, offline):
    """The served numbers are the model's: compare with a plain HF forward of the prompt."""
    from transformers import AutoModelForCausalLM

    ids = offline.tokenizer.encode("plain forward")
    body = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}).json()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    np.testing.assert_allclose(body["choices"][0]["logprobs"]["token_logprobs"][1:], expected, atol=1e-5)
