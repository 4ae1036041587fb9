"""``/tokenize``, ``/detokenize`` and ``/tokenizer_info``, in vLLM's request and response shapes.

- ``POST /tokenize`` ``{"prompt": str}`` (``add_special_tokens`` default true) or
  ``{"messages": [...]}`` (chat template; ``add_generation_prompt`` default true,
  ``add_special_tokens`` default false) -> ``{"count", "max_model_len", "tokens",
  "token_strs"}`` (``token_strs`` only with ``return_token_strs``).
- ``POST /detokenize`` ``{"tokens": [int]}`` -> ``{"prompt": str}``; ids outside the
  vocabulary are a 400.
- ``GET /tokenizer_info`` -> the special tokens, the chat template and the context length
  (what lm-eval's remote tokenizer reads).
"""
from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, model_validator

from kvpage.entrypoints.openai.protocol import ChatMessage


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    tokens: list[int]


def tokenize(tokenizer: Any, max_model_len: int, req: TokenizeRequest) -> dict:
    if req.prompt is not None:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = list(tokenizer.encode(req.prompt, add_special_tokens=special))
    else:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template; tokenize a prompt instead")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=req.add_generation_prompt)
        ids = list(tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens)))
    strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(tokenizer: Any, vocab_size: int, req: DetokenizeRequest) -> dict:
    bad = [t for t in req.tokens if not 0 <= t < vocab_size]
    if bad:
        error = ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        error.param = "tokens"  # type: ignore[attr-defined]
        raise error
    return {"prompt": tokenizer.decode(req.tokens)}


def tokenizer_info(tokenizer: Any, max_model_len: int) -> dict:
    return {"tokenizer_class": type(tokenizer).__name__, "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token, "pad_token": tokenizer.pad_token,
            "chat_template": getattr(tokenizer, "chat_template", None), "model_max_length": max_model_len}
