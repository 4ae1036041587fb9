"""Per-request sampling and stopping parameters (vLLM-compatible names)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union


GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    Attributes:
        n: parallel samples for the prompt; they share the prompt's KV blocks (fork).
        max_tokens: most tokens to generate (>= 1).
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; -1 or 0 keeps all.
        min_p: drop tokens below ``min_p`` times the top probability, in [0, 1].
        seed: per-request seed; the same seed gives the same samples.
        repetition_penalty: > 0; values above 1 discourage tokens already seen.
        stop: strings that end generation; they are excluded from the returned text.
        stop_token_ids: token ids that end generation (kept in token_ids, not in text).
        ignore_eos: keep generating past the EOS token.
        min_tokens: tokens to generate before EOS or stop ids may end the request.
        logprobs: number of top log-probabilities returned per generated token.
        prompt_logprobs: number of top log-probabilities returned per prompt token (the
            log-probability of the prompt token itself always comes too); None for none.
            Such a request bypasses the prefix cache: every prompt token must be computed.
        presence_penalty: in [-2, 2]; subtracted from the logit of every token already generated.
        frequency_penalty: in [-2, 2]; times a token's count among the generated tokens,
            subtracted from its logit (OpenAI's definition; the prompt does not count).
        priority: lower runs first under the ``priority`` scheduling policy.
        logit_bias: token id -> a value in [-100, 100] added to its logit before penalties,
            filters and sampling (OpenAI's ``logit_bias``; -100 in effect bans a token, +100
            forces it). Log-probabilities stay those of the model's raw distribution.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    repetition_penalty: float = 1.0
    stop: Union[None, str, Sequence[str]] = None
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: Optional[int] = None
    priority: int = 0
    prompt_logprobs: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict] = None

    def __post_init__(self) -> None:
        # Normalize, but let a non-iterable surface as the ValueError naming the field
        # rather than a bare TypeError from list()/tuple().
        try:
            self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        except TypeError:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}") from None
        try:
            self.stop_token_ids = tuple(self.stop_token_ids or ())
        except TypeError:
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}") from None
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
        self._validate()

    @property
    def greedy(self) -> bool:
        """Temperatures below ``GREEDY_BELOW_TEMPERATURE`` are greedy: dividing logits by a
        (sub)normal-tiny temperature would overflow them to inf."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    def for_sample(self, index: int) -> "SamplingParams":
        """Parameters of sample ``index`` of ``n``: one sample, its own seed derived from this one."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)

    def _validate(self) -> None:
        def is_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def is_real(value: object) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or a non-negative integer, got {self.top_k!r}")
        if not is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be a non-negative integer or None, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise ValueError(f"prompt_logprobs must be a non-negative integer or None, got {self.prompt_logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not is_int(self.priority):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        for token, bias in (self.logit_bias or {}).items():
            if not is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
            if not is_real(bias) or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")
