"""A step's token limit from a time target (``SchedulerConfig.max_step_ms``).

Every running stream waits for the whole step, so a step that admits a long prefill stalls
them all. ``StepCostModel`` learns what a step costs on this machine,

    seconds ~= fixed + per_token * tokens + per_seq * sequences

from the steps the engine reports, and ``StepBudget`` turns the target into each step's
token limit once its decodes are scheduled::

    |<- decode tokens (all of them, first) ->|<- prefill chunks: what the target leaves ->|
    0                                                              limit <= max_num_batched_tokens

The prefill share is at least one block (so prompts always progress, even when the decodes
alone exceed the target). With no decode in the step nobody waits on it, and the limit is
``max_num_batched_tokens``, as it is while the model cannot predict yet.

``max_step_ms="auto"`` (``kvpage serve``'s default) needs no number from the user: each
step's target is ``AUTO_DECODE_MULTIPLE`` times what its decodes alone are predicted to
cost, and never under ``AUTO_FLOOR_MS``. A stream then waits at most about that multiple of
its undisturbed inter-token time while prompts arrive, on any machine and model, and the
prompts still get more of every step than the decodes themselves.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Protocol, Union

import numpy as np

# Features are scaled to O(1) before the fit so that the 3x3 solve is well conditioned.
_TOKEN_UNIT = 256.0
_SEQ_UNIT = 16.0
# Relative ridge on the two slopes: decode-only steps have tokens == sequences, and the
# ridge splits an unidentifiable slope between them instead of failing the solve.
_RIDGE = 1e-6

#: ``max_step_ms="auto"``: a step carrying decodes may take this multiple of their own cost...
#: Six: under vLLM's own benchmark client on a 2-core CPU, three kept most steps stretched
#: (the median inter-token time was the target's), six left most steps decode-only with the
#: slowest still below the static budget's (docs/performance.md).
AUTO_DECODE_MULTIPLE = 6.0
#: ...and at least this many milliseconds (a lone stream's decode is only a few milliseconds;
#: a target that small would cut prompts into chunks whose fixed costs dominate).
AUTO_FLOOR_MS = 50.0


class StepCost(Protocol):
    """What ``StepBudget`` needs of a cost model (``StepCostModel``, or a fake in tests)."""

    def observe(self, num_tokens: int, num_seqs: int, seconds: float) -> None:
        """Learn from a step of ``num_tokens`` tokens over ``num_seqs`` sequences that took ``seconds``."""

    def tokens_within(self, seconds: float, num_tokens: int, num_seqs: int) -> Optional[int]:
        """Most tokens a step already holding ``num_tokens`` over ``num_seqs`` sequences may add,
        as one more sequence, and still be predicted to take at most ``seconds``; None when the
        model cannot tell yet."""

    def predict(self, num_tokens: int, num_seqs: int) -> Optional[float]:
        """Predicted seconds of a step of this size; None when the model cannot tell yet."""


class StepCostModel:
    """Online fit of a step's seconds to its tokens and sequences (exponentially weighted
    least squares under non-negative coefficients, O(1) floats per observation; not
    thread-safe).

    Robustness: the first ``skip_first`` steps are ignored (first-use compilation); a step
    whose size lies within the sizes seen so far and whose time is off the prediction by more
    than ``outlier_ratio`` (either way) is ignored as a hiccup (a compile of a new shape, a
    GC pause), unless ``max_rejections`` of them come in a row (the machine changed: the next
    is accepted). Old steps fade with a half-life of ``half_life_steps`` accepted steps.
    """

    def __init__(self, half_life_steps: float = 32.0, skip_first: int = 4, min_observations: int = 4,
                 outlier_ratio: float = 3.0, max_rejections: int = 3) -> None:
        if half_life_steps <= 0 or outlier_ratio <= 1 or min(skip_first, min_observations, max_rejections) < 0:
            raise ValueError("StepCostModel: half_life_steps > 0, outlier_ratio > 1 and non-negative counts")
        self.decay = 0.5 ** (1.0 / half_life_steps)
        self.skip_first = skip_first
        self.min_observations = min_observations
        self.outlier_ratio = outlier_ratio
        self.max_rejections = max_rejections
        # Weighted sums over x = (1, tokens/_TOKEN_UNIT, seqs/_SEQ_UNIT): sum w x x^T and
        # sum w x y, y in seconds.
        self._gram = np.zeros((3, 3))
        self._moment = np.zeros(3)
        self._theta: Optional[tuple[float, float, float]] = None  # in scaled units
        self._tokens_seen = (math.inf, -math.inf)
        self._rejections_in_a_row = 0
        self.num_seen = 0
        self.num_accepted = 0
        self.num_rejected = 0

    # ------------------------------------------------------------------ learning
    def observe(self, num_tokens: int, num_seqs: int, seconds: float) -> None:
        """See ``StepCost.observe``. Non-positive or non-finite values are ignored."""
        if num_tokens <= 0 or num_seqs <= 0 or not 0.0 < seconds < math.inf:
            return
        self.num_seen += 1
        if self.num_seen <= self.skip_first:
            return
        if self._is_outlier(num_tokens, num_seqs, seconds):
            self._rejections_in_a_row += 1
            if self._rejections_in_a_row <= self.max_rejections:
                self.num_rejected += 1
                return
        self._rejections_in_a_row = 0
        self._accept(num_tokens / _TOKEN_UNIT, num_seqs / _SEQ_UNIT, seconds)
        low, high = self._tokens_seen
        self._tokens_seen = (min(low, num_tokens), max(high, num_tokens))

    def _is_outlier(self, num_tokens: int, num_seqs: int, seconds: float) -> bool:
        predicted = self.predict(num_tokens, num_seqs)
        low, high = self._tokens_seen
        if predicted is None or predicted <= 0.0 or not low <= num_tokens <= high:
            return False  # beyond the sizes seen, a miss is news about the model, not a hiccup
        ratio = seconds / predicted
        return ratio > self.outlier_ratio or ratio * self.outlier_ratio < 1.0

    def _accept(self, t: float, s: float, y: float) -> None:
        x = np.array((1.0, t, s))
        self._gram = self.decay * self._gram + np.outer(x, x)
        self._moment = self.decay * self._moment + x * y
        self.num_accepted += 1
        self._theta = _fit_non_negative(self._gram, self._moment)

    # ------------------------------------------------------------------ predictions
    @property
    def fitted(self) -> bool:
        """Whether enough steps were accepted to predict."""
        return self._theta is not None and self.num_accepted >= self.min_observations

    @property
    def coefficients(self) -> Optional[tuple[float, float, float]]:
        """(fixed, per_token, per_seq) in seconds, seconds per token and seconds per sequence;
        None until ``fitted``."""
        if not self.fitted:
            return None
        fixed, per_token, per_seq = self._theta
        return fixed, per_token / _TOKEN_UNIT, per_seq / _SEQ_UNIT

    def predict(self, num_tokens: int, num_seqs: int) -> Optional[float]:
        """Predicted seconds of a step of this size; None until ``fitted``."""
        coef = self.coefficients
        if coef is None:
            return None
        return coef[0] + coef[1] * num_tokens + coef[2] * num_seqs

    def tokens_within(self, seconds: float, num_tokens: int, num_seqs: int) -> Optional[int]:
        """See ``StepCost.tokens_within``; None also while tokens look free (a per-token cost
        that is not positive: nothing seen yet tells what they cost)."""
        coef = self.coefficients
        if coef is None or coef[1] <= 0.0:
            return None
        spare = seconds - self.predict(num_tokens, num_seqs + 1)
        return max(0, math.floor(spare / coef[1]))


def _fit_non_negative(gram: np.ndarray, moment: np.ndarray) -> tuple[float, float, float]:
    """Least squares (with the slopes' ridge) under non-negative coefficients: a negative one
    (a fit pulled by a few odd steps: a negative fixed cost, a negative cost per sequence) is
    fixed at zero and the rest refitted."""
    active = [0, 1, 2]
    while active:
        theta = _solve_subset(gram, moment, active)
        negative = [i for i in active if theta[i] < 0.0]
        if not negative:
            return float(theta[0]), float(theta[1]), float(theta[2])
        active.remove(min(negative, key=lambda i: theta[i]))
    return 0.0, 0.0, 0.0


def _solve_subset(gram: np.ndarray, moment: np.ndarray, active: list[int]) -> np.ndarray:
    """The normal equations restricted to ``active`` coefficients (the others zero). The fixed
    term's diagonal is the sum of the weights (> 0 once a step is seen) and the slopes' carry
    the ridge, so the system is positive definite."""
    a = gram[np.ix_(active, active)].copy()
    slopes = [k for k, i in enumerate(active) if i]
    a[slopes, slopes] += _RIDGE * a[slopes, slopes] + 1e-12
    theta = np.zeros(3)
    theta[active] = np.linalg.solve(a, moment[active])
    return theta


@dataclass(slots=True)
class StepBudget:
    """Each step's token limit for a target of ``target_s`` seconds, from ``model``.

    ``min_prefill_tokens`` (one block) is what prefill always gets beyond the decodes, and
    ``max_tokens`` (``max_num_batched_tokens``) caps the whole step as without a target.
    With ``decode_multiple`` set, a step's target is that multiple of its decodes' predicted
    cost, ``target_s`` being the floor (``max_step_ms="auto"``).
    """

    target_s: float
    min_prefill_tokens: int
    max_tokens: int
    model: StepCost
    decode_multiple: Optional[float] = None
    num_capped_steps: int = 0  # steps whose limit came out below max_tokens

    def limit(self, num_decode_tokens: int, num_decode_seqs: int) -> int:
        """Tokens the whole step may hold, its decodes (already scheduled) included."""
        if num_decode_seqs == 0:
            return self.max_tokens  # nobody waits on this step: prompts go as fast as they can
        target = self.target_s
        if self.decode_multiple is not None:
            decode_cost = self.model.predict(num_decode_tokens, num_decode_seqs)
            if decode_cost is None:
                return self.max_tokens
            target = max(target, self.decode_multiple * decode_cost)
        extra = self.model.tokens_within(target, num_decode_tokens, num_decode_seqs)
        if extra is None:
            return self.max_tokens
        limit = min(self.max_tokens, num_decode_tokens + max(self.min_prefill_tokens, extra))
        self.num_capped_steps += limit < self.max_tokens
        return limit

    def observe(self, num_tokens: int, num_seqs: int, seconds: float) -> None:
        """A successful step's size and the seconds of its work; feeds ``model``."""
        self.model.observe(num_tokens, num_seqs, seconds)

    def stats(self) -> dict:
        """The fitted cost (milliseconds; None before the fit) and how often the target bit."""
        coef = self.model.coefficients if isinstance(self.model, StepCostModel) else None
        fixed, per_token, per_seq = (None, None, None) if coef is None else (1e3 * c for c in coef)
        return {"step_cost_fixed_ms": fixed, "step_cost_per_token_ms": per_token,
                "step_cost_per_seq_ms": per_seq, "num_step_budget_capped": self.num_capped_steps}


def step_budget(max_step_ms: Union[float, str, None], block_size: int, max_num_batched_tokens: int,
                model: Optional[StepCost] = None) -> Optional[StepBudget]:
    """The scheduler's ``StepBudget`` for ``max_step_ms`` (milliseconds, ``"auto"``, or None:
    no target, no budget), over ``model`` or a fresh ``StepCostModel``."""
    if max_step_ms is None:
        return None
    model = model or StepCostModel()
    if max_step_ms == "auto":
        return StepBudget(AUTO_FLOOR_MS / 1e3, block_size, max_num_batched_tokens, model, AUTO_DECODE_MULTIPLE)
    return StepBudget(max_step_ms / 1e3, block_size, max_num_batched_tokens, model)
