"""The vLLM-style ``LLM`` API: outputs, sampling, stop strings, streaming, stats, bad input."""
from __future__ import annotations

import pytest

from kvpage import LLM, SamplingParams
from tiny_models import VOCAB, char_tokenizer, hf_greedy, tiny_model


@pytest.fixture(scope="module")
def llm():
    engine = LLM(tiny_model("llama"), tokenizer=char_tokenizer(), block_size=4, num_kv_blocks=128,
                 max_num_batched_tokens=32, max_model_len=96)
    yield engine
    engine.restore()


def _assert_no_leak(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == 0
    llm.check_integrity()


def test_outputs_keep_input_order_and_report_fields(llm):
    prompts = ["a long prompt that runs first", "b", "medium prompt"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    tok = llm.tokenizer
    for out, prompt in zip(outs, prompts):
        assert out.prompt_token_ids == tok.encode(prompt)
        sample = out.outputs[0]
        assert len(sample.token_ids) == 5 and sample.finish_reason == "length"
        assert sample.text == tok.decode(sample.token_ids, skip_special_tokens=True)
        m = out.metrics
        assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert llm.model_path is None
    _assert_no_leak(llm)


def test_token_prompts_match_hf(llm):
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    for out, prompt in zip(outs, prompts):
        assert out.outputs[0].token_ids == hf_greedy(llm.model, prompt, 6)


def test_prefix_cache_reports_cached_tokens(llm):
    shared = "the same system prompt, long enough for blocks: "
    llm.generate([shared + "first"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    (out,) = llm.generate([shared + "second"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    common = len(shared)
    assert out.metrics.num_cached_tokens == (common // 4) * 4
    assert llm.stats()["prefix_cache_hits"] >= out.metrics.num_cached_tokens


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=40, seed=1234, ignore_eos=True)
    alone = llm.generate(["seeded"], params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate(["other one", "seeded", "more"], [SamplingParams(max_tokens=7, temperature=1.0), params,
                                                         SamplingParams(max_tokens=3, temperature=0.5)],
                         use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == alone
    other_seed = llm.generate(["seeded"], SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_stop_strings_cut_text_across_tokens(llm):
    base = llm.generate(["stop test"], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = base.text
    assert len(text) >= 6
    stop = text[3:5]  # two characters = two tokens of the char tokenizer: crosses a token boundary
    (out,) = llm.generate(["stop test"], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]),
                          use_tqdm=False)
    cut = text.find(stop)
    assert out.outputs[0].text == text[:cut]
    assert out.outputs[0].finish_reason == "stop"
    assert len(out.outputs[0].token_ids) == cut + len(stop)
    _assert_no_leak(llm)


def test_stop_token_ids_and_eos(llm):
    base = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    target = base[3]
    first = base.index(target)
    (out,) = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[target]),
                          use_tqdm=False)
    assert out.outputs[0].token_ids == base[: first + 1] and out.outputs[0].finish_reason == "stop"


def test_stream_deltas_concatenate_to_final_text(llm):
    params = SamplingParams(max_tokens=15, temperature=0, ignore_eos=True)
    final = llm.generate(["stream me"], params, use_tqdm=False)[0].outputs[0]
    deltas = list(llm.stream("stream me", params))
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert deltas[-1].finish_reason == "length"
    _assert_no_leak(llm)


def test_logprobs_are_top_k_of_the_model_distribution(llm):
    (out,) = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=3, temperature=0, logprobs=3, ignore_eos=True),
                          use_tqdm=False)
    sample = out.outputs[0]
    assert len(sample.logprobs) == 3
    for token, entry in zip(sample.token_ids, sample.logprobs):
        assert token in entry and 3 <= len(entry) <= 4
        assert max(entry.values()) == pytest.approx(entry[token])  # greedy picks the top token
        assert all(v <= 0 for v in entry.values())


def test_stats_keys(llm):
    stats = llm.stats()
    for key in ("num_blocks", "num_free_blocks", "num_cached_blocks", "kv_cache_usage", "kv_fragmentation",
                "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_running", "num_waiting"):
        assert key in stats
    assert 0.0 <= stats["kv_cache_usage"] <= 1.0 and 0.0 <= stats["kv_fragmentation"] <= 1.0


@pytest.mark.parametrize("prompt, params, match", [
    ("", SamplingParams(), "empty"),
    ([[]], None, "empty"),
    ([[1, VOCAB + 5]], None, "vocabulary"),
    ([[-1, 3]], None, "vocabulary"),
    ("x" * 200, SamplingParams(max_tokens=1), "max_model_len"),
    ([[True, 2]], None, "sequence of integer token ids"),  # a bool is an int to Python, not a token
    ([b"hi"], None, "sequence of integer token ids"),
    ([{"prompt": "hi", "prompt_token_ids": [1]}], None, "exactly one of"),
    ({"text": "hi"}, None, "exactly one of"),
    ([{"prompt": [1, 2]}], None, "'prompt' must be text"),
    (["fine"], SamplingParams(logprobs=VOCAB + 1), "exceeds the vocabulary"),
])
def test_bad_prompts_raise_and_lose_nothing(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params, use_tqdm=False)
    _assert_no_leak(llm)
    # A batch holding one bad prompt queues nothing, and later work still runs.
    with pytest.raises(ValueError):
        llm.generate(["fine", prompt if isinstance(prompt, (str, dict)) else prompt[0]], params, use_tqdm=False)
    _assert_no_leak(llm)
    assert len(llm.generate(["still fine"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) >= 1


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"), (dict(min_p=2.0), "min_p"), (dict(n=0), "n"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(temperature=float("nan")), "temperature"),
])
def test_bad_sampling_params_raise(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_vllms_prompt_dictionaries_are_prompts(llm):
    greedy = SamplingParams(max_tokens=3, temperature=0)
    plain = [o.outputs[0].token_ids for o in llm.generate(["abc", [5, 6, 7]], greedy, use_tqdm=False)]
    wrapped = llm.generate([{"prompt": "abc"}, {"prompt_token_ids": [5, 6, 7]}], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in wrapped] == plain and wrapped[0].prompt == "abc"
    assert llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy, use_tqdm=False)[0].outputs[0].token_ids == plain[1]
    assert "".join(d.text for d in llm.stream({"prompt": "abc"}, greedy)) == wrapped[0].outputs[0].text


@pytest.mark.parametrize("params", [{"max_tokens": 2}, "greedy", [{"max_tokens": 2}]])
def test_sampling_params_of_the_wrong_type_raise(llm, params):
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(["abc"], params, use_tqdm=False)
    _assert_no_leak(llm)


def test_settings_of_the_wrong_type_raise():
    from kvpage import EngineConfig

    with pytest.raises(ValueError, match="config must be an EngineConfig"):
        LLM(tiny_model("llama"), config={"block_size": 4})
    with pytest.raises(ValueError, match="tokenizer must be"):
        LLM(tiny_model("llama"), tokenizer=5)
    for name in ("enable_prefix_caching", "enable_chunked_prefill", "disable_hybrid_kv_cache_manager"):
        with pytest.raises(ValueError, match=f"{name} must be True or False"):
            EngineConfig(**{name: "no"})
    with pytest.raises(ValueError, match="ignore_eos must be True or False"):
        SamplingParams(ignore_eos="no")
    with pytest.raises(ValueError, match="contradicts onednn_linears=True$"):  # names only what clashes
        EngineConfig(exact=True, onednn_linears=True)


def test_unknown_model_path_raises():
    with pytest.raises(ValueError, match="unknown model"):
        LLM("/no/such/model/folder")


def test_restore_gives_back_plain_generate():
    model = tiny_model("qwen2")
    before = hf_greedy(model, [3, 4, 5], 5)
    engine = LLM(model, block_size=4, num_kv_blocks=16, max_model_len=64)
    assert model.config._attn_implementation == "kvpage"
    assert hf_greedy(model, [3, 4, 5], 5) == before  # plain generate works while patched
    engine.restore()
    assert model.config._attn_implementation == "sdpa"
    assert hf_greedy(model, [3, 4, 5], 5) == before
    with pytest.raises(ValueError, match="gave its model back"):  # not a quiet step error per request
        engine.generate([[3, 4, 5]], SamplingParams(max_tokens=2), use_tqdm=False)


def test_parallel_samples_fork_and_share_prompt_blocks(llm):
    prompt = "a prompt of exactly forty-one characters!"  # 41 tokens: 10 full blocks + 1 partial
    params = SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
    engine = llm.engine
    rid = engine.add_request(prompt, params)
    while not engine.scheduler.running or engine.scheduler.running[0].num_output_tokens == 0:
        engine.step()
    # After the first token: 4 samples hold the 11 prompt blocks once, not four times.
    samples = [engine.scheduler.requests[f"{rid}#{k}"] for k in range(4)]
    shared = set(samples[0].block_ids[:10])
    assert all(set(s.block_ids[:10]) == shared for s in samples)
    assert llm.stats()["num_blocks"] - llm.stats()["num_free_blocks"] == 11
    while engine.has_unfinished_requests():
        engine.step()
    (out,) = engine.take_finished().values()
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds, different samples
    _assert_no_leak(llm)
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]  # seeded


def test_prompts_admitted_together_share_their_common_prefix(llm):
    shared = "shared system prompt of some length: "
    outs = llm.generate([shared + "one", shared + "two", shared + "three"],
                        SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert outs[0].metrics.num_cached_tokens == 0 or outs[0].metrics.num_cached_tokens % 4 == 0
    assert all(o.metrics.num_cached_tokens >= (len(shared) // 4) * 4 for o in outs[1:])


def test_patch_is_the_drop_in_for_a_loaded_model():
    from kvpage import patch

    model = tiny_model("mistral")
    expected = hf_greedy(model, [5, 6, 7, 8], 6)
    llm = patch(model, block_size=4, num_kv_blocks=32, max_model_len=64)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected
    assert hf_greedy(model, [5, 6, 7, 8], 6) == expected  # plain generate still works
    llm.restore()
