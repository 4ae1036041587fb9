"""What generation returns (vLLM-compatible shapes). Torch-free."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps in ``time.monotonic()`` seconds, and prefix-cache reuse in tokens."""

    arrival_time: float
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class PromptTokenLogprob:
    """The log-probability of one prompt token given the tokens before it.

    Attributes:
        token_id: the prompt token.
        logprob: its log-probability under the model's raw distribution.
        rank: 1 + the number of tokens the model found strictly more likely.
        top: the ``prompt_logprobs`` most likely tokens, token id -> log-probability,
            most likely first (empty when ``prompt_logprobs == 0``).
    """

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float] = field(default_factory=dict)


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request. ``logprobs[i]`` maps token id -> log-probability for token i."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None
    logprobs: Optional[list[dict[int, float]]] = None
    cumulative_logprob: Optional[float] = None
    error: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    #: With ``SamplingParams.prompt_logprobs``: one entry per prompt token, the first None
    #: (nothing precedes it); otherwise None.
    prompt_logprobs: Optional[list[Optional[PromptTokenLogprob]]] = None

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens


@dataclass(slots=True)
class StreamDelta:
    """New text and tokens of one sample since the previous delta."""

    request_id: str
    index: int
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    logprobs: Optional[list[dict[int, float]]] = None
    error: Optional[str] = None
