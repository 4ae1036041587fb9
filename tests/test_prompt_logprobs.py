"""Prompt log-probabilities (scheduler rows -> runner logits -> sampler) and OpenAI's
presence / frequency penalties."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpage import LLM, SamplingParams
from kvpage.core.sched.metadata import build_step_metadata
from kvpage.core.request import Request
from kvpage.engine.sampler import Sampler
from tiny_models import VOCAB, tiny_model


def _request(rid, prompt, computed=0, blocks=8, **params):
    r = Request(rid, prompt, SamplingParams(**params))
    r.num_computed_tokens = computed
    r.block_ids = list(range(blocks))
    return r


def test_metadata_lists_prompt_rows_after_the_sampled_rows():
    decode = _request("d", [5, 6, 7])
    decode.all_token_ids.append(8)
    decode.num_computed_tokens = 3
    whole = _request("w", [10, 11, 12, 13], prompt_logprobs=2)
    chunk = _request("c", [20, 21, 22, 23, 24, 25], computed=2, prompt_logprobs=0)
    m = build_step_metadata([decode, whole, chunk], [1, 4, 3], block_size=4)
    # rows: decode 0 | whole 1..4 | chunk 5..7 (positions 2, 3, 4 of a 6-token prompt)
    assert m.num_sampled_rows == 2 and m.sample_seq_indices.tolist() == [0, 1]
    assert m.logits_indices.tolist() == [0, 4, 1, 2, 3, 5, 6, 7]
    assert m.prompt_logits_seq_indices.tolist() == [1, 1, 1, 2, 2, 2]
    assert m.prompt_logits_token_ids.tolist() == [11, 12, 13, 23, 24, 25]
    assert m.prompt_logits_positions.tolist() == [1, 2, 3, 3, 4, 5]


def test_no_prompt_rows_without_the_parameter_or_after_the_prompt():
    plain = _request("p", [1, 2, 3, 4])
    done = _request("x", [1, 2, 3], prompt_logprobs=1)
    done.all_token_ids.append(9)
    done.num_computed_tokens = 3
    m = build_step_metadata([done, plain], [1, 4], block_size=4)
    assert m.num_prompt_logits_rows == 0 and m.logits_indices.tolist() == [0, 4]


def test_sampler_prompt_logprobs_rank_and_top():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.0]])
    entries = Sampler.prompt_logprobs(logits, np.array([1, 2]), [2, 0])
    expected = torch.log_softmax(logits, dim=-1)
    assert entries[0].token_id == 1 and entries[0].rank == 2
    assert entries[0].logprob == pytest.approx(float(expected[0, 1]))
    assert list(entries[0].top) == [0, 1] and entries[0].top[0] == pytest.approx(float(expected[0, 0]))
    assert entries[1].rank == 1 and entries[1].top == {}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _hf_prompt_logprobs(model, prompt):
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[i - 1, prompt[i]]) for i in range(1, len(prompt))]


@pytest.mark.parametrize("budget, cached_first", [(8, False), (2048, False), (8, True)],
                         ids=["chunked", "whole", "chunked-after-prefix-cached"])
def test_prompt_logprobs_equal_hf(model, budget, cached_first):
    llm = LLM(model, block_size=4, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=budget)
    try:
        g = torch.Generator().manual_seed(3)
        prompt = torch.randint(3, VOCAB, (29,), generator=g).tolist()
        if cached_first:  # the prompt's blocks are in the prefix cache; the request must not use them
            llm.generate([list(prompt)], SamplingParams(max_tokens=1), use_tqdm=False)
        out = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3),
                           use_tqdm=False)[0]
        entries = out.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        assert [e.token_id for e in entries[1:]] == prompt[1:]
        np.testing.assert_allclose([e.logprob for e in entries[1:]], _hf_prompt_logprobs(model, prompt), atol=1e-5)
        assert all(len(e.top) == 3 and max(e.top.values()) >= e.logprob for e in entries[1:])
        assert out.metrics.num_cached_tokens == 0
        llm.check_integrity()
    finally:
        llm.restore()


# ---------------------------------------------------------------------- penalties
class _Seq:
    def __init__(self, prompt, output):
        self.all_token_ids = list(prompt) + list(output)
        self.output_token_ids = list(output)


def test_presence_and_frequency_penalties_follow_openai():
    logits = torch.zeros(1, 6)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = Sampler._apply_penalties(logits, [_Seq([4, 4, 4], [1, 1, 3])], [params])
    # token 1 twice: -(0.25 * 2 + 0.5); token 3 once: -(0.25 + 0.5); prompt-only token 4 untouched
    assert out[0].tolist() == pytest.approx([0.0, -1.0, 0.0, -0.75, 0.0, 0.0])
    assert logits.abs().sum() == 0  # the input is not modified


def test_negative_presence_penalty_encourages_and_greedy_follows():
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    request = Request("r", [0], SamplingParams(temperature=0, presence_penalty=-0.5))
    request.all_token_ids.append(1)
    assert Sampler().sample(logits, [request]).token_ids.tolist() == [1]


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [2.5, -2.01, float("nan"), "1", True])
def test_penalties_are_validated(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("value", [-1, 1.5, "2", True])
def test_prompt_logprobs_is_validated(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
