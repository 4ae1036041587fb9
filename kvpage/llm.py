"""``LLM``: the vLLM-style offline API over a Hugging Face model with paged KV.

Imported lazily (``kvpage.LLM``) so that ``import kvpage`` stays torch-free.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

from .engine import LLMEngine
from .outputs import RequestOutput, StreamDelta
from .sampling_params import SamplingParams

PromptsArg = Union[str, Sequence[str], Sequence[Sequence[int]]]


def _resolve_device(device: str):
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device: {exc}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but no CUDA device is available")
    return resolved


def _resolve_dtype(dtype: str, device):
    import torch

    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype == "auto":
        # fp16 on GPU: the Numba kernels take fp16/fp32 (numpy and CuPy have no bfloat16).
        return torch.float32 if device.type == "cpu" else torch.float16
    if dtype not in table:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(table)}, got {dtype!r}")
    return table[dtype]


def load_model(model: Any, tokenizer: Any, dtype: str, device: str):
    """Return (model, tokenizer, local path or None) for a path, an alias or a loaded model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

    from .model_registry import resolve_model_path

    if isinstance(model, PreTrainedModel):
        if isinstance(tokenizer, (str, Path)):
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        return model.eval(), tokenizer, None
    if not isinstance(model, (str, Path)):
        raise ValueError(f"model must be a path, an alias or a PreTrainedModel, got {type(model).__name__}")
    path = resolve_model_path(str(model))
    torch_device = _resolve_device(device)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=_resolve_dtype(dtype, torch_device))
    loaded = loaded.to(torch_device).eval()
    if tokenizer is None or isinstance(tokenizer, (str, Path)):
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer or path))
    return loaded, tokenizer, path


class LLM:
    """Paged, continuously batched generation for any supported HF decoder model.

    ``model`` is a local HF folder, an alias (``"smollm2-135m"``) or a loaded
    ``PreTrainedModel``. Sizes are in tokens, except ``kv_cache_memory`` (bytes).
    ``gpu_memory_utilization`` applies on GPU only.
    """

    def __init__(self, model: Any, tokenizer: Any = None, block_size: int = 16,
                 num_kv_blocks: Optional[int] = None, kv_cache_memory: Optional[int] = None,
                 gpu_memory_utilization: float = 0.9, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, enable_chunked_prefill: bool = True,
                 enable_prefix_caching: bool = True, max_model_len: Optional[int] = None,
                 dtype: str = "auto", device: str = "auto", seed: int = 0,
                 attention_backend: str = "auto", max_waiting: Optional[int] = None) -> None:
        from kvpage.adapters.hf_engine import EngineOptions, build_hf_engine

        options = EngineOptions(block_size, num_kv_blocks, kv_cache_memory, gpu_memory_utilization, max_num_seqs,
                                max_num_batched_tokens, enable_chunked_prefill, enable_prefix_caching,
                                max_model_len, seed, attention_backend, max_waiting)
        self.model, self.tokenizer, self.model_path = load_model(model, tokenizer, dtype, device)
        self.engine: LLMEngine = build_hf_engine(self.model, self.tokenizer, options)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: PromptsArg, sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        Raises ``ValueError`` (queuing nothing) if any prompt or parameter is invalid.
        """
        prompt_list = self._as_prompt_list(prompts)
        params_list = self._as_params_list(sampling_params, len(prompt_list))
        ids = self._add_all(prompt_list, params_list)
        results: dict[str, RequestOutput] = {}
        bar = self._progress(len(ids), use_tqdm)
        try:
            while len(results) < len(ids):
                self.engine.step()
                done = self.engine.take_finished()
                results.update(done)
                if bar is not None and done:
                    bar.update(len(done))
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in ids]

    def stream(self, prompt: Union[str, Sequence[int]], sampling_params: Optional[SamplingParams] = None) -> Iterator[StreamDelta]:
        """Yield incremental text and tokens for one prompt as they are produced."""
        (rid,) = self._add_all([prompt], [sampling_params or SamplingParams()])
        finished = False
        try:
            while not finished:
                for delta in self.engine.step():
                    if delta.request_id == rid:
                        yield delta
                finished = rid in self.engine.take_finished() or not self.engine.has_request(rid)
        finally:
            self.engine.abort(rid)

    def _add_all(self, prompts: list, params: list) -> list[str]:
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, p))
        except Exception:
            for rid in ids:  # all or nothing: a bad prompt queues none of the batch
                self.engine.abort(rid)
            raise
        return ids

    @staticmethod
    def _as_prompt_list(prompts: PromptsArg) -> list:
        if isinstance(prompts, str):
            return [prompts]
        prompts = _as_list(prompts, "prompts")
        if prompts and all(isinstance(t, int) for t in prompts):
            raise ValueError("pass token-id prompts as a list of lists: [[1, 2, 3]]")
        if not prompts:
            raise ValueError("no prompts given")
        return prompts

    @staticmethod
    def _as_params_list(params: Any, count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        params = _as_list(params, "sampling_params")
        if len(params) != count:
            raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
        return params

    @staticmethod
    def _progress(total: int, use_tqdm: bool):
        if not use_tqdm:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="Processed prompts", unit="req")

    # ------------------------------------------------------------------ control
    def stats(self) -> dict:
        return self.engine.stats()

    def restore(self) -> None:
        """Give the model back its original attention implementation (plain HF use)."""
        self.engine.runner.restore()


def _as_list(value: Any, name: str) -> list:
    try:
        return list(value)
    except TypeError:
        raise ValueError(f"{name} must be a list, got {type(value).__name__}") from None
