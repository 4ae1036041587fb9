"""The step-time budget (``max_step_ms``): the online step cost model, the per-step token limit,
the scheduler chunking prompts within it while decodes run, exactness through the engine,
and the option's validation (config, ``LLM``, ``kvpage serve``)."""
from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpage import CacheConfig, SamplingParams, Scheduler, SchedulerConfig
from kvpage.core.config import EngineConfig
from kvpage.core.sched.step_budget import AUTO_DECODE_MULTIPLE, AUTO_FLOOR_MS, StepBudget, StepCostModel, step_budget
from kvpage.entrypoints.cli.main import build_parser, main
from kvpage.entrypoints.cli.serve import config_from_args

BS = 4
FIXED, PER_TOKEN, PER_SEQ = 0.020, 1e-4, 5e-4  # seconds, seconds/token, seconds/sequence


def synthetic_steps(n: int, seed: int = 0, noise: float = 0.01):
    """(tokens, seqs, seconds) of ``n`` steps: decodes plus a random prefill share, timed by
    the known coefficients with a little multiplicative noise."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        seqs = int(rng.integers(1, 64))
        tokens = seqs + int(rng.integers(0, 2048 - seqs)) * int(rng.random() < 0.5)
        yield tokens, seqs, (FIXED + PER_TOKEN * tokens + PER_SEQ * seqs) * (1 + noise * rng.standard_normal())


def assert_close(coef, expected=(FIXED, PER_TOKEN, PER_SEQ), rel=0.1):
    for got, want in zip(coef, expected):
        assert got == pytest.approx(want, rel=rel), (coef, expected)


# ---------------------------------------------------------------------- the cost model
def test_the_cost_model_recovers_known_coefficients():
    model = StepCostModel()
    assert model.coefficients is None and model.predict(10, 1) is None and model.tokens_within(1.0, 1, 1) is None
    for tokens, seqs, seconds in synthetic_steps(300):
        model.observe(tokens, seqs, seconds)
    assert model.fitted and model.num_rejected == 0
    assert_close(model.coefficients)


def test_the_cost_model_ignores_the_first_steps_outliers_and_nonsense():
    model = StepCostModel(skip_first=2)
    model.observe(100, 2, 30.0)  # first-use compilation
    model.observe(3000, 2, 60.0)
    model.observe(0, 0, 1.0)
    model.observe(10, 1, float("nan"))
    for i, (tokens, seqs, seconds) in enumerate(synthetic_steps(400, seed=1)):
        model.observe(tokens, seqs, seconds * (10.0 if i % 10 == 9 else 1.0))  # a GC pause every 10th step
    assert model.num_seen == 402 and model.num_rejected >= 30
    assert_close(model.coefficients)


def test_the_cost_model_follows_a_machine_that_slowed_down():
    model = StepCostModel(half_life_steps=16)
    for tokens, seqs, seconds in synthetic_steps(100):
        model.observe(tokens, seqs, seconds)
    for tokens, seqs, seconds in synthetic_steps(200, seed=2):
        model.observe(tokens, seqs, 4 * seconds)  # off by more than outlier_ratio, for good
    assert_close(model.coefficients, (4 * FIXED, 4 * PER_TOKEN, 4 * PER_SEQ))


def test_tokens_within_is_the_most_that_fits_the_target():
    model = StepCostModel()
    for tokens, seqs, seconds in synthetic_steps(200, noise=0.0):
        model.observe(tokens, seqs, seconds)
    target = 0.1
    extra = model.tokens_within(target, 30, 30)
    assert model.predict(30 + extra, 31) <= target < model.predict(31 + extra, 31)
    assert extra == pytest.approx((target - FIXED - PER_TOKEN * 30 - PER_SEQ * 31) / PER_TOKEN, abs=2)
    assert model.tokens_within(0.001, 30, 30) == 0  # the decodes alone are over the target


def test_one_step_size_only_still_predicts_that_size():
    model = StepCostModel(skip_first=0)
    for _ in range(10):
        model.observe(8, 8, 0.05)  # tokens == sequences, constant: the slopes are not identifiable
    assert model.predict(8, 8) == pytest.approx(0.05)


# ---------------------------------------------------------------------- the limit
class FixedExtra:
    """A cost model that always allows ``extra`` more tokens (None: cannot tell)."""

    def __init__(self, extra):
        self.extra = extra
        self.observed: list[tuple[int, int, float]] = []

    def observe(self, num_tokens, num_seqs, seconds):
        self.observed.append((num_tokens, num_seqs, seconds))

    def tokens_within(self, seconds, num_tokens, num_seqs):
        return self.extra


@pytest.mark.parametrize("extra, decodes, seqs, limit", [
    (100, 10, 10, 110),     # what the model allows
    (0, 10, 10, 10 + BS),   # at least one block of prefill
    (-5, 10, 10, 10 + BS),
    (5000, 10, 10, 256),    # never above max_num_batched_tokens
    (0, 254, 254, 256),     # the static cap wins over the one-block floor
    (None, 10, 10, 256),    # an unfitted model: the static budget
    (0, 0, 0, 256),         # no decodes: nobody waits on the step
])
def test_the_limit_is_clamped_to_one_block_and_the_static_budget(extra, decodes, seqs, limit):
    budget = StepBudget(0.05, BS, 256, FixedExtra(extra))
    assert budget.limit(decodes, seqs) == limit
    assert budget.num_capped_steps == (limit < 256)


class LinearCost(FixedExtra):
    """A cost model of ``fixed + per_token * tokens`` seconds (per sequence: free)."""

    def __init__(self, fixed, per_token):
        super().__init__(None)
        self.fixed, self.per_token = fixed, per_token

    def predict(self, num_tokens, num_seqs):
        return self.fixed + self.per_token * num_tokens

    def tokens_within(self, seconds, num_tokens, num_seqs):
        return max(0, round((seconds - self.predict(num_tokens, num_seqs)) / self.per_token))


@pytest.mark.parametrize("decodes, limit", [
    (2, 2 + 90),      # decodes cost 4 + 1 = 5 ms; 6x is under the 50 ms floor: 45 ms (90 tokens) of prefill
    (16, 16 + 120),   # 12 ms of decodes: a 72 ms target leaves them 60 ms, 120 tokens of prefill
    (100, 256),       # 54 ms: a 324 ms target would take 540 tokens; the static cap holds
])
def test_the_auto_target_is_a_multiple_of_the_decodes_cost(decodes, limit):
    """Steps cost 4 ms + 0.5 ms a token."""
    budget = step_budget("auto", BS, 256, LinearCost(0.004, 0.0005))
    assert budget.decode_multiple == AUTO_DECODE_MULTIPLE == 6.0 and budget.target_s == AUTO_FLOOR_MS / 1e3
    assert budget.limit(decodes, decodes) == limit


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(fixed_ms=st.floats(0.0, 200.0), per_token_ms=st.floats(0.001, 5.0), decodes=st.integers(1, 300),
       max_tokens=st.integers(BS, 4096))
def test_the_auto_target_bounds_a_step_at_its_multiple_of_the_decodes(fixed_ms, per_token_ms, decodes, max_tokens):
    """Whatever the machine's costs: the step holds every decode and at least one block of
    prefill (within the static cap), never more than the cap, and is predicted to take at
    most the target (the floor, or the multiple of the decodes' cost) unless the one-block
    minimum alone exceeds it."""
    cost = LinearCost(fixed_ms / 1e3, per_token_ms / 1e3)
    budget = step_budget("auto", BS, max_tokens, cost)
    limit = budget.limit(decodes, decodes)
    assert min(max_tokens, decodes + BS) <= limit <= max_tokens
    target = max(AUTO_FLOOR_MS / 1e3, AUTO_DECODE_MULTIPLE * cost.predict(decodes, decodes))
    if limit > decodes + BS:
        assert cost.predict(limit, decodes + 1) <= target + cost.per_token  # one token of rounding


def test_the_auto_target_waits_for_a_fitted_model():
    unfitted = step_budget("auto", BS, 256)
    assert unfitted.limit(10, 10) == 256 and unfitted.num_capped_steps == 0


def test_no_target_no_budget():
    assert step_budget(None, BS, 256) is None
    budget = step_budget(50.0, BS, 256)
    assert budget.target_s == pytest.approx(0.05) and isinstance(budget.model, StepCostModel)


# ---------------------------------------------------------------------- the scheduler
def make(max_step_ms=None, step_cost=None, budget=64, max_seqs=8, **kw) -> Scheduler:
    return Scheduler(CacheConfig(block_size=BS, num_blocks=256, **kw),
                     SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=256,
                                     max_step_ms=max_step_ms), step_cost)


def step(s: Scheduler, seconds: float = 0.01):
    out = s.schedule()
    if not out.is_empty:
        s.update_from_output(out, [7] * out.metadata.sample_seq_indices.shape[0])
        s.observe_step(out.metadata.num_tokens, out.metadata.num_seqs, seconds)
    s.check_integrity()
    return out


def scheduled(out) -> dict[str, int]:
    return {r.request_id: n for r, n in zip(out.requests, out.num_new_tokens)}


def test_a_long_prompt_is_chunked_within_the_budget_while_decodes_run():
    fake = FixedExtra(6)
    s = make(max_step_ms=50.0, step_cost=fake)
    for i in range(3):
        s.make_request(f"d{i}", [i + 1] * 5, SamplingParams(max_tokens=40, ignore_eos=True))
    first = step(s)
    assert first.metadata.num_tokens == 15  # no decodes yet: the whole static budget was open
    s.make_request("long", list(range(10, 110)), SamplingParams(max_tokens=2, ignore_eos=True))
    chunks = []
    while s.requests["long"].num_output_tokens == 0:
        out = step(s)
        counts = scheduled(out)
        assert all(counts[f"d{i}"] == 1 for i in range(3))  # every decode, every step
        assert out.metadata.num_tokens <= 3 + 6
        chunks.append(counts["long"])
    assert len(chunks) > 10 and sum(chunks) == 100 and max(chunks) == 6
    assert len(fake.observed) == 1 + len(chunks) and s.step_budget.num_capped_steps == len(chunks)


def test_a_prompt_alone_gets_the_static_budget():
    s = make(max_step_ms=1.0, step_cost=FixedExtra(0))
    s.make_request("long", list(range(10, 110)), SamplingParams(max_tokens=2, ignore_eos=True))
    assert step(s).metadata.num_tokens == 64
    assert step(s).metadata.num_tokens == 36


def test_decodes_over_the_target_still_leave_one_block_of_prefill():
    s = make(max_step_ms=1.0, step_cost=FixedExtra(0))
    for i in range(4):
        s.make_request(f"d{i}", [i + 1] * 3, SamplingParams(max_tokens=30, ignore_eos=True))
    step(s)
    s.make_request("long", list(range(10, 30)), SamplingParams(max_tokens=2, ignore_eos=True))
    out = step(s)
    assert scheduled(out)["long"] == BS and out.metadata.num_tokens == 4 + BS


def random_workload(s: Scheduler, seed: int, num_steps: int = 150) -> list:
    """Requests arriving at random steps with random lengths; each step's (id, tokens) list."""
    rng = random.Random(seed)
    trace = []
    for t in range(num_steps):
        for k in range(rng.choice((0, 0, 0, 1, 2))):
            prompt = [rng.randrange(3, 90) for _ in range(rng.randrange(1, 120))]
            s.make_request(f"r{t}-{k}", prompt, SamplingParams(max_tokens=rng.randrange(1, 30), ignore_eos=True))
        out = step(s, seconds=0.001 + 1e-5 * rng.randrange(1, 200))
        trace.append([(r.request_id, n) for r, n in zip(out.requests, out.num_new_tokens)])
    return trace


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_without_a_target_or_with_a_loose_one_the_schedule_is_the_static_one(seed):
    static = make()
    assert static.step_budget is None and "step_cost_fixed_ms" not in static.stats()
    reference = random_workload(static, seed)
    assert random_workload(make(max_step_ms=1e9), seed) == reference
    assert random_workload(make(max_step_ms=1e9, step_cost=FixedExtra(None)), seed) == reference
    tight = make(max_step_ms=1.0, step_cost=FixedExtra(2))
    assert random_workload(tight, seed) != reference and tight.step_budget.num_capped_steps > 0


def test_a_real_cost_model_learns_from_the_steps_and_limits_them():
    """Steps cost 20 ms + 0.1 ms a token; a 30 ms target leaves 100 tokens a step, decodes
    included (but always one block of prefill beyond the decodes)."""
    s = make(max_step_ms=30.0, budget=256, max_seqs=16)
    rng = random.Random(0)
    mixed = []
    for t in range(300):
        if t % 3 == 0:
            s.make_request(f"r{t}", [rng.randrange(3, 90) for _ in range(rng.randrange(20, 200))],
                           SamplingParams(max_tokens=20, ignore_eos=True))
        out = s.schedule()
        if out.is_empty:
            continue
        s.update_from_output(out, [7] * out.metadata.sample_seq_indices.shape[0])
        s.observe_step(out.metadata.num_tokens, out.metadata.num_seqs, FIXED + PER_TOKEN * out.metadata.num_tokens)
        if t > 20 and 0 < out.metadata.num_decodes < out.metadata.num_seqs:
            mixed.append((out.metadata.num_tokens, out.metadata.num_decodes))
    stats = s.stats()
    assert stats["step_cost_per_token_ms"] == pytest.approx(1e3 * PER_TOKEN, rel=0.01)
    assert stats["step_cost_fixed_ms"] == pytest.approx(1e3 * FIXED, rel=0.01)
    assert stats["num_step_budget_capped"] > 0 and mixed
    assert all(tokens <= max(decodes + BS, 100) + 1 for tokens, decodes in mixed)
    assert any(tokens >= 99 for tokens, _ in mixed)  # the target is used, not just the floor


# ---------------------------------------------------------------------- exactness through the engine
@pytest.fixture(scope="module")
def tiny():
    from tiny_models import char_tokenizer, tiny_model

    return tiny_model("llama"), char_tokenizer()


def _greedy(tiny, fake=None, **options) -> tuple[list, dict]:
    """Greedy outputs of eight prompts of mixed lengths, and the engine's stats after them;
    ``fake`` replaces the cost model of a ``max_step_ms`` engine."""
    from kvpage import LLM

    model, tokenizer = tiny
    llm = LLM(model, tokenizer=tokenizer, dtype="float32", block_size=4, num_kv_blocks=256,
              max_num_batched_tokens=32, max_model_len=96, **options)
    if fake is not None:
        llm.engine.scheduler.step_budget.model = fake
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 90) for _ in range(n)] for n in (5, 70, 12, 40, 3, 55, 21, 64)]
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.stats()
    finally:
        llm.restore()


def test_greedy_output_is_the_same_with_and_without_a_step_target(tiny):
    reference, _ = _greedy(tiny)
    learned, stats = _greedy(tiny, max_step_ms=0.001)  # the fitted model: whatever it allows
    assert learned == reference and "step_cost_per_token_ms" in stats
    fake = FixedExtra(0)  # one block of prefill per step while anything decodes
    chunked, stats = _greedy(tiny, fake, max_step_ms=0.001)
    assert chunked == reference and stats["num_step_budget_capped"] > 0
    assert len(fake.observed) == stats["num_steps"] and all(seconds > 0 for _, _, seconds in fake.observed)


# ---------------------------------------------------------------------- validation
@pytest.mark.parametrize("value", [0, -1, -0.5, float("nan"), float("inf"), True, "50"])
def test_bad_targets_are_value_errors(value):
    with pytest.raises(ValueError, match="max_step_ms must be a positive number"):
        SchedulerConfig(max_step_ms=value)
    with pytest.raises(ValueError, match="max_step_ms must be a positive number"):
        EngineConfig(max_step_ms=value)


def test_a_target_needs_chunked_prefill():
    with pytest.raises(ValueError, match="needs enable_chunked_prefill"):
        SchedulerConfig(max_step_ms=50, enable_chunked_prefill=False, max_num_batched_tokens=2048)
    with pytest.raises(ValueError, match="needs enable_chunked_prefill"):
        EngineConfig(max_step_ms=50, enable_chunked_prefill=False)
    from kvpage.entrypoints.llm import engine_config

    with pytest.raises(ValueError, match="max_step_ms"):
        engine_config(max_step_ms=-3)


def test_the_target_reaches_the_scheduler_config():
    config = EngineConfig(max_step_ms=80)
    assert config.scheduler_config(1024).max_step_ms == 80 and EngineConfig().scheduler_config(64).max_step_ms is None
    args = build_parser().parse_args(["serve", "--max-step-ms", "120.5"])
    assert config_from_args(args).max_step_ms == 120.5
    assert EngineConfig(max_step_ms="auto").scheduler_config(64).max_step_ms == "auto"


@pytest.mark.parametrize("argv, target", [
    ([], "auto"),                                   # the server's default: a step target
    (["--no-enable-chunked-prefill"], None),        # ... which needs chunked prefill
    (["--max-step-ms", "off"], None),
    (["--max-step-ms", "auto"], "auto"),
    (["--max-step-ms", "75"], 75.0),
])
def test_the_server_defaults_to_the_auto_target(argv, target):
    assert config_from_args(build_parser().parse_args(["serve", *argv])).max_step_ms == target


@pytest.mark.parametrize("argv, message", [
    (["--max-step-ms", "-1"], "argument --max-step-ms: expected a finite number > 0, got -1"),
    (["--max-step-ms", "0"], "argument --max-step-ms"),
    (["--max-step-ms", "soon"], "expected a number"),
    (["--max-step-ms", "50", "--no-enable-chunked-prefill"], "needs enable_chunked_prefill"),
])
def test_a_bad_target_on_the_command_line_is_one_error_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert err.startswith("usage: kvpage serve") and len(errors) == 1 and message in errors[0]


def test_the_flag_has_help(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--max-step-ms MS" in out and "inter-token latency" in out
