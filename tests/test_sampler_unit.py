"""The torch Sampler on hand-made logits: greedy, seeded sampling, filters, penalties,
log-probabilities, invalid rows, n > 1 forks, and SampleResult.merge."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvpage import Request, SamplingParams
from kvpage.engine.interfaces import SampleResult
from kvpage.engine.sampler import Sampler

V = 16


def req(params: SamplingParams, prompt=(1,), outputs=(), request_id: str = "r") -> Request:
    r = Request(request_id, list(prompt), params)
    r.all_token_ids += list(outputs)  # outputs follow the prompt; num_prompt_tokens is unchanged
    return r


def random_logits(rows: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=gen) * scale


def tokens(result: SampleResult) -> list[int]:
    return result.token_ids.tolist()


def test_greedy_is_argmax_per_row():
    logits = random_logits(5, scale=3.0)
    result = Sampler().sample(logits, [req(SamplingParams(temperature=0)) for _ in range(5)])
    assert tokens(result) == torch.argmax(logits, dim=-1).tolist()
    assert result.token_ids.dtype == np.int64
    assert result.logprobs == [None] * 5
    assert np.isnan(result.token_logprobs).all()  # not asked for
    assert result.invalid_rows == [] and result.forks == {}


def test_greedy_below_the_temperature_threshold():
    logits = random_logits(3, seed=1)
    result = Sampler().sample(logits, [req(SamplingParams(temperature=1e-6)) for _ in range(3)])
    assert tokens(result) == torch.argmax(logits, dim=-1).tolist()


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    logits = torch.zeros(1, V)  # uniform: every token is equally likely
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = [tokens(Sampler(seed=s).sample(logits, [req(seeded)]))[0] for s in range(3)]
    assert alone[0] == alone[1] == alone[2]  # the sampler's global seed does not matter
    crowd_logits = torch.cat([random_logits(2, seed=7), logits, random_logits(1, seed=8)])
    crowd = [req(SamplingParams(temperature=1.0)), req(SamplingParams(temperature=0.7, seed=3)), req(seeded),
             req(SamplingParams(temperature=0))]
    assert tokens(Sampler(seed=5).sample(crowd_logits, crowd))[2] == alone[0]


def test_seeded_draws_depend_on_the_output_position():
    logits = torch.zeros(1, V)
    params = SamplingParams(temperature=1.0, seed=11)
    draws = [tokens(Sampler().sample(logits, [req(params, outputs=[0] * pos)]))[0] for pos in range(12)]
    assert draws == [tokens(Sampler().sample(logits, [req(params, outputs=[0] * pos)]))[0] for pos in range(12)]
    assert len(set(draws)) > 1  # a fresh generator per position, not one fixed draw


def test_different_seeds_give_different_streams():
    logits = torch.zeros(1, V)
    def stream(seed):
        return [tokens(Sampler().sample(logits, [req(SamplingParams(temperature=1.0, seed=seed),
                                                     outputs=[0] * pos)]))[0] for pos in range(10)]
    assert stream(1) != stream(2)


def test_unseeded_sampling_follows_the_sampler_seed():
    logits = torch.zeros(8, V)
    rows = [req(SamplingParams(temperature=1.0)) for _ in range(8)]
    assert tokens(Sampler(seed=3).sample(logits, rows)) == tokens(Sampler(seed=3).sample(logits, rows))
    assert tokens(Sampler(seed=3).sample(logits, rows)) != tokens(Sampler(seed=4).sample(logits, rows))


def test_top_k_one_equals_greedy():
    logits = random_logits(32, seed=2)
    rows = [req(SamplingParams(temperature=1.5, top_k=1, seed=i)) for i in range(32)]
    assert tokens(Sampler().sample(logits, rows)) == torch.argmax(logits, dim=-1).tolist()


def test_top_k_keeps_only_the_k_best():
    logits = random_logits(1, seed=3).expand(200, -1).contiguous()
    rows = [req(SamplingParams(temperature=2.0, top_k=3, seed=i)) for i in range(200)]
    top3 = set(torch.topk(logits[0], 3).indices.tolist())
    drawn = set(tokens(Sampler().sample(logits, rows)))
    assert drawn == top3


def test_tiny_top_p_equals_greedy():
    logits = random_logits(32, seed=4)
    rows = [req(SamplingParams(temperature=1.0, top_p=1e-6, seed=i)) for i in range(32)]
    assert tokens(Sampler().sample(logits, rows)) == torch.argmax(logits, dim=-1).tolist()


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    # probabilities 0.5, 0.3, 0.2 (and nothing else): top_p=0.7 keeps {0, 1}; 0.8 keeps all three
    logits = torch.full((1, V), float("-inf"))
    logits[0, :3] = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    batch = logits.expand(300, -1).contiguous()
    def drawn(top_p):
        rows = [req(SamplingParams(temperature=1.0, top_p=top_p, seed=i)) for i in range(300)]
        return set(tokens(Sampler().sample(batch, rows)))
    assert drawn(0.7) == {0, 1}
    assert drawn(0.85) == {0, 1, 2}
    assert drawn(0.4) == {0}


def test_min_p_drops_tokens_below_a_share_of_the_top_probability():
    # token 1 has half the probability of token 0; every other token 1/e^2 of it
    logits = torch.zeros(1, V)
    logits[0, 0] = 2.0
    logits[0, 1] = 2.0 - math.log(2.0)
    batch = logits.expand(300, -1).contiguous()
    def drawn(min_p):
        rows = [req(SamplingParams(temperature=1.0, min_p=min_p, seed=i)) for i in range(300)]
        return set(tokens(Sampler().sample(batch, rows)))
    assert drawn(0.6) == {0}
    assert drawn(0.4) == {0, 1}
    assert drawn(0.0) == set(range(V))
    assert drawn(1.0) == {0}


def test_repetition_penalty_changes_the_argmax_when_the_top_token_was_seen():
    logits = torch.zeros(1, V)
    logits[0, 5] = 3.0
    logits[0, 7] = 2.0
    fresh = req(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[1, 2])
    seen = req(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[1, 2], outputs=[5])
    seen_in_prompt = req(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[5, 2])
    no_penalty = req(SamplingParams(temperature=0), prompt=[5])
    batch = logits.expand(4, -1).contiguous()
    assert tokens(Sampler().sample(batch, [fresh, seen, seen_in_prompt, no_penalty])) == [5, 7, 7, 5]


def test_repetition_penalty_pushes_negative_logits_further_down():
    logits = torch.full((1, V), -10.0)
    logits[0, 3] = -1.0
    logits[0, 4] = -1.5
    # seen token 3: -1.0 * 2 = -2.0 < -1.5
    r = req(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[3])
    assert tokens(Sampler().sample(logits, [r])) == [4]
    # a penalty below 1 encourages seen tokens instead: -1.5 * 0.5 = -0.75 > -1.0
    r = req(SamplingParams(temperature=0, repetition_penalty=0.5), prompt=[4])
    assert tokens(Sampler().sample(logits, [r])) == [4]


def test_repetition_penalty_does_not_change_the_callers_logits():
    logits = random_logits(1, seed=5)
    before = logits.clone()
    Sampler().sample(logits, [req(SamplingParams(temperature=0, repetition_penalty=3.0), prompt=[0, 1, 2])])
    assert torch.equal(logits, before)


def test_logprobs_hold_top_k_and_the_drawn_token_from_the_raw_distribution():
    logits = random_logits(1, seed=6, scale=2.0)
    log_probs = torch.log_softmax(logits[0], dim=-1)
    order = torch.argsort(log_probs, descending=True).tolist()
    result = Sampler().sample(logits, [req(SamplingParams(temperature=0, logprobs=3))])
    (entry,) = result.logprobs
    assert set(entry) == set(order[:3])
    for token, value in entry.items():
        assert value == pytest.approx(float(log_probs[token]), abs=1e-6)
    assert tokens(result) == [order[0]]
    assert result.token_logprobs[0] == pytest.approx(float(log_probs[order[0]]), abs=1e-6)


def test_logprobs_include_a_drawn_token_outside_the_top_k():
    # The penalty makes token 1 the pick; log-probabilities stay those of the raw model.
    logits = torch.zeros(1, V)
    logits[0, 0], logits[0, 1] = 4.0, 3.0
    log_probs = torch.log_softmax(logits[0], dim=-1)
    r = req(SamplingParams(temperature=0, repetition_penalty=4.0, logprobs=1), prompt=[0])
    result = Sampler().sample(logits, [r])
    assert tokens(result) == [1]
    assert set(result.logprobs[0]) == {0, 1}
    assert result.logprobs[0][0] == pytest.approx(float(log_probs[0]), abs=1e-6)
    assert result.logprobs[0][1] == pytest.approx(float(log_probs[1]), abs=1e-6)
    assert result.token_logprobs[0] == pytest.approx(float(log_probs[1]), abs=1e-6)


def test_logprobs_zero_returns_only_the_drawn_token_and_only_for_rows_that_ask():
    logits = random_logits(3, seed=7)
    rows = [req(SamplingParams(temperature=0, logprobs=0)), req(SamplingParams(temperature=0)),
            req(SamplingParams(temperature=0, logprobs=V + 10))]
    result = Sampler().sample(logits, rows)
    picked = torch.argmax(logits, dim=-1).tolist()
    assert list(result.logprobs[0]) == [picked[0]]
    assert result.logprobs[1] is None and math.isnan(result.token_logprobs[1])
    assert len(result.logprobs[2]) == V  # k is clamped to the vocabulary
    assert result.token_logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[picked[0]]), abs=1e-6)


def test_invalid_rows_report_nan_posinf_and_all_neginf():
    logits = random_logits(6, seed=8)
    logits[1, 3] = float("nan")
    logits[2, 0] = float("inf")
    logits[3, :] = float("-inf")
    logits[4, :V - 1] = float("-inf")  # a masked vocabulary is fine while one token is left
    logits[5, 2] = float("-inf")
    result = Sampler().sample(logits, [req(SamplingParams(temperature=0)) for _ in range(6)])
    assert result.invalid_rows == [1, 2, 3]
    assert tokens(result)[4] == V - 1
    assert tokens(result)[0] == int(torch.argmax(logits[0]))


def test_n_greater_than_one_forks_at_the_first_token():
    logits = torch.zeros(2, V)
    params = SamplingParams(n=3, temperature=1.0, seed=9)
    first = req(params)
    later = req(params, outputs=[4])  # already past its first token: no forks
    result = Sampler().sample(logits, [first, later])
    assert list(result.forks) == [0]
    fork = result.forks[0]
    assert fork.token_ids.shape == (2,) and fork.token_ids.dtype == np.int64
    # sample k draws with its own seed (seed + k) at position 0, like a one-sample request would
    for k in (1, 2):
        own = Sampler().sample(logits[:1], [req(SamplingParams(temperature=1.0, seed=9 + k))])
        assert int(fork.token_ids[k - 1]) == tokens(own)[0]
    again = Sampler().sample(logits, [req(params), req(params, outputs=[4])])
    assert tokens(again.forks[0]) == tokens(fork) and tokens(again) == tokens(result)


def test_greedy_forks_repeat_the_argmax_and_carry_logprobs():
    logits = random_logits(1, seed=10)
    result = Sampler().sample(logits, [req(SamplingParams(n=3, temperature=0, logprobs=1))])
    best = int(torch.argmax(logits[0]))
    fork = result.forks[0]
    assert tokens(result) == [best] and tokens(fork) == [best, best]
    assert fork.logprobs == [result.logprobs[0], result.logprobs[0]]
    assert fork.token_logprobs.tolist() == pytest.approx([result.token_logprobs[0]] * 2)


def test_invalid_row_gets_no_forks():
    logits = torch.full((1, V), float("nan"))
    result = Sampler().sample(logits, [req(SamplingParams(n=2, temperature=0))])
    assert result.invalid_rows == [0] and result.forks == {}


def test_merge_places_rows_and_fills_missing_ones():
    sampler = Sampler()
    logits = random_logits(3, seed=11)
    logits[2, 0] = float("nan")
    parts = {0: sampler.sample(logits[0:1], [req(SamplingParams(temperature=0, logprobs=0))]),
             2: sampler.sample(logits[2:3], [req(SamplingParams(n=2, temperature=0))])}
    merged = SampleResult.merge(parts, 3)
    assert merged.token_ids.tolist() == [int(torch.argmax(logits[0])), 0, int(parts[2].token_ids[0])]
    assert merged.logprobs[0] == parts[0].logprobs[0] and merged.logprobs[1:] == [None, None]
    assert merged.token_logprobs[0] == parts[0].token_logprobs[0]
    assert np.isnan(merged.token_logprobs[1:]).all()
    assert merged.invalid_rows == [2]
    assert merged.forks == {}  # the invalid row drew no forks

    forked = sampler.sample(logits[1:2], [req(SamplingParams(n=3, temperature=0))])
    merged = SampleResult.merge({1: forked}, 2)
    assert merged.token_ids.tolist() == [0, int(torch.argmax(logits[1]))]
    assert list(merged.forks) == [1] and merged.forks[1] is forked.forks[0]
    assert merged.invalid_rows == []


def test_min_tokens_masks_eos_and_stop_ids_greedy_and_sampled():
    """EOS (the request's and the model's, even with ignore_eos) and stop ids carry all the
    mass; until min_tokens output tokens exist they are never drawn, then they win again."""
    logits = torch.full((1, V), -40.0)  # never drawn
    logits[0, [2, 3, 9]] = 10.0  # 2: request EOS, 3: a second model EOS, 9: a stop id
    logits[0, 11] = 0.0  # the best token left
    sampler = Sampler(eos_token_ids=[2, 3])

    def draw(params, produced, rows=1):
        requests = [Request(f"r{i}", [1], params, eos_token_id=2) for i in range(rows)]
        for r in requests:
            r.all_token_ids += [0] * produced
        return tokens(sampler.sample(logits.expand(rows, -1), requests))

    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, min_tokens=3, max_tokens=8, stop_token_ids=[9],
                                ignore_eos=True)  # unseeded: every sampled row is its own draw
        assert set(draw(params, 0, rows=32)) == {11}  # masked for greedy and for every sampled draw
        assert set(draw(params, 2, rows=32)) == {11}
        assert set(draw(params, 3, rows=32)) <= {2, 3, 9}  # min_tokens reached: no mask
    unmasked = SamplingParams(temperature=0, max_tokens=8)
    assert draw(unmasked, 0) in ([2], [3], [9])


def test_min_tokens_keeps_raw_logprobs_and_ignores_ids_past_the_vocabulary():
    logits = random_logits(1, seed=4, scale=3.0)
    top = int(torch.argmax(logits))
    params = SamplingParams(temperature=0, min_tokens=2, logprobs=0, stop_token_ids=[top, V + 5])
    result = Sampler().sample(logits, [req(params)])
    assert tokens(result)[0] != top
    raw = torch.log_softmax(logits[0], dim=-1)[tokens(result)[0]]
    assert result.token_logprobs[0] == pytest.approx(float(raw), rel=1e-6)  # the model's, not the masked one
    assert logits[0, top] > logits[0, tokens(result)[0]]  # the input logits are left untouched


def test_logit_bias_shifts_the_draw_not_the_logprobs():
    logits = random_logits(2, seed=5, scale=2.0)
    best = torch.argmax(logits, dim=-1).tolist()
    banned = SamplingParams(temperature=0, logprobs=1, logit_bias={best[0]: -100})
    forced = SamplingParams(temperature=0.7, seed=3, logit_bias={3: 100})
    result = Sampler().sample(logits.clone(), [req(banned), req(forced)])
    second = torch.topk(logits[0], 2).indices[1].item()
    assert tokens(result) == [second, 3]
    raw = torch.log_softmax(logits[0], -1)[second].item()
    assert result.token_logprobs[0] == pytest.approx(raw)  # the model's raw distribution
    ignored = SamplingParams(temperature=0, logit_bias={V + 5: 100})  # past the vocabulary: no effect
    assert tokens(Sampler().sample(logits.clone(), [req(ignored), req(ignored)])) == best


@pytest.mark.parametrize("bias, message", [({1: 101}, r"\[-100, 100\]"), ({-1: 1}, "non-negative token ids"),
                                           ({"5": 1}, "non-negative token ids"), ([1, 2], "must map token ids")])
def test_bad_logit_bias_is_a_value_error(bias, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)
