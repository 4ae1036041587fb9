"""Request bodies of the OpenAI-compatible endpoints (pydantic), and their mapping to
``SamplingParams``. Unknown fields are ignored, as OpenAI's API does."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvpage.core.sampling_params import SamplingParams

MAX_N = 16


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


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
    stream_options: Optional[StreamOptions] = None
    #: Token id (as a string, OpenAI's keys) -> bias in [-100, 100] added to its logit.
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    #: Seconds from arrival after which the request ends with finish_reason "length" (the
    #: server's --max-request-seconds, when shorter, wins).
    timeout: Optional[float] = Field(default=None, gt=0, allow_inf_nan=False)

    def to_sampling_params(self, max_tokens: int, logprobs: Optional[int],
                           prompt_logprobs: Optional[int] = None) -> SamplingParams:
        return SamplingParams(n=self.n, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop=self.stop,
                              stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                              min_tokens=self.min_tokens, repetition_penalty=self.repetition_penalty,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs, logit_bias=self.token_bias())

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self):
        if self.stream_options is not None and not self.stream:
            raise _param_error("stream_options is only allowed with stream=true", "stream_options")
        return self

    def token_bias(self) -> Optional[dict[int, float]]:
        """``logit_bias`` with integer token ids; ``ValueError`` for a key that is not one."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise _param_error(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            bias[token] = value
        return bias

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    """``max_tokens: 0`` is allowed with ``echo`` (score the prompt only). ``echo`` with
    ``logprobs`` returns the prompt tokens' log-probabilities too (OpenAI's format);
    ``prompt_logprobs`` is vLLM's field for them (its format, on each choice)."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(default=None, ge=0)
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    prompt_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    echo: bool = False

    def check_echo(self) -> None:
        """Raise ``ValueError`` for combinations this server does not serve."""
        if self.max_tokens == 0 and not self.echo:
            raise _param_error("max_tokens=0 needs echo=true (there would be nothing to return)", "max_tokens")
        if self.stream and (self.max_tokens == 0 or self.prompt_logprobs is not None
                            or (self.echo and self.logprobs is not None)):
            raise _param_error("max_tokens=0, prompt_logprobs and echo with logprobs need stream=false", "stream")

    @property
    def num_prompt_logprobs(self) -> Optional[int]:
        """Top log-probabilities to compute per prompt token, or None when none are wanted."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None

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

    @model_validator(mode="after")
    def _content_where_needed(self):
        if self.content is None and self.role in ("system", "user", "developer"):
            raise _param_error(f"a {self.role} message needs content", "messages")
        return self

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
    #: vLLM's: the prompt tokens' log-probabilities (of the templated prompt), at the top
    #: level of the response.
    prompt_logprobs: Optional[int] = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _logprob_fields_fit(self):
        if self.top_logprobs and not self.logprobs:
            raise _param_error("top_logprobs needs logprobs=true", "top_logprobs")
        if self.stream and self.prompt_logprobs is not None:
            raise _param_error("prompt_logprobs needs stream=false", "stream")
        return self


def _param_error(message: str, param: str) -> ValueError:
    error = ValueError(message)
    error.param = param  # type: ignore[attr-defined]
    return error
