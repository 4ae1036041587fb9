"""Request bodies of the OpenAI-compatible endpoints (pydantic), and their mapping to
``SamplingParams``. Unknown fields are ignored, as OpenAI's API does."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from kvpage.sampling_params import SamplingParams

MAX_N = 16


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    seed: Optional[int] = None
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: Optional[dict] = None
    user: Optional[str] = None

    def to_sampling_params(self, max_tokens: int, logprobs: Optional[int]) -> SamplingParams:
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported; use repetition_penalty")
        return SamplingParams(n=self.n, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop=self.stop,
                              stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                              min_tokens=self.min_tokens, repetition_penalty=self.repetition_penalty,
                              logprobs=logprobs)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    echo: bool = False

    def prompts(self) -> list:
        """The prompt field as a list of prompts (strings or token-id lists)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [p]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict], None] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
