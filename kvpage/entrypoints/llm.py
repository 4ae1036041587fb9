"""``LLM``: the vLLM-style offline API over a model with paged KV.

Model loading and engine assembly live in ``kvpage.engine.builder`` (Hugging Face);
this module is the front end only. Imported lazily (``kvpage.LLM``) so that
``import kvpage`` stays torch-free.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence, Union

from kvpage.core.config import EngineConfig
from kvpage.core.sampling_params import SamplingParams
from kvpage.engine.llm_engine import LLMEngine
from kvpage.engine.outputs import RequestOutput, StreamDelta

if TYPE_CHECKING:
    import torch

    from kvpage.adapters.hf_runner import HFModelRunner

PromptsArg = Union[str, dict, Sequence[Union[str, dict, Sequence[int]]]]
#: vLLM's prompt dictionaries: ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``.
PROMPT_KEYS = ("prompt", "prompt_token_ids")


def engine_config(config: Optional[EngineConfig] = None, **options: Any) -> EngineConfig:
    """``config`` (or the defaults) with ``options`` (``EngineConfig`` field names) applied."""
    if config is not None and not isinstance(config, EngineConfig):
        raise ValueError(f"config must be an EngineConfig (or pass its fields as keywords), got "
                         f"{type(config).__name__}")
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise ValueError(f"unknown engine option(s) {unknown}; expected EngineConfig fields {sorted(names)}")
    return dataclasses.replace(config or EngineConfig(), **options)


class LLM:
    """Paged, continuously batched generation for any supported HF decoder model.

    ``model`` is a local HF folder, an alias (``"smollm2-135m"``) or a loaded
    ``PreTrainedModel``. Settings come as one ``EngineConfig`` and/or as its fields by
    keyword (``LLM(path, max_num_seqs=64)``); see ``EngineConfig`` for units and defaults.
    """

    def __init__(self, model: Any, tokenizer: Any = None, config: Optional[EngineConfig] = None,
                 **options: Any) -> None:
        from kvpage.engine.builder import build_hf_engine, load_model

        self.config = engine_config(config, **options)
        self.model, self.tokenizer, self.model_path = load_model(model, tokenizer, self.config)
        built = build_hf_engine(self.model, self.tokenizer, self.config)
        self.engine: LLMEngine = built.engine
        self.runner: "HFModelRunner" = built.runner
        self._restored = False

    @property
    def device(self) -> "torch.device":
        """Where the model's weights and KV cache live."""
        return self.runner.device

    @property
    def max_model_len(self) -> int:
        """Tokens a sequence may reach, prompt and output together."""
        return self.engine.max_model_len

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

    def stream(self, prompt: Union[str, dict, Sequence[int]],
               sampling_params: Optional[SamplingParams] = None) -> Iterator[StreamDelta]:
        """Yield incremental text and tokens for one prompt as they are produced."""
        (rid,) = self._add_all([_prompt_of(prompt)], self._as_params_list(sampling_params, 1))
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
        if self._restored:
            raise ValueError("this LLM gave its model back (restore()); build a new one (kvpage.patch) to generate")
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
        if isinstance(prompts, (str, dict)):
            return [_prompt_of(prompts)]
        prompts = _as_list(prompts, "prompts")
        if prompts and all(isinstance(t, int) for t in prompts):
            raise ValueError("pass token-id prompts as a list of lists: [[1, 2, 3]]")
        if not prompts:
            raise ValueError("no prompts given")
        return [_prompt_of(p) for p in prompts]

    @staticmethod
    def _as_params_list(params: Any, count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        if isinstance(params, (dict, str)):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {type(params).__name__}")
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

    def reset_prefix_cache(self) -> None:
        """Empty the prefix cache and its lower tiers (host memory, disk files), as vLLM's.

        Raises ``ValueError`` while a request holds cached blocks.
        """
        self.engine.reset_prefix_cache()

    def flush_kv_tiers(self, timeout_s: float = 30.0) -> bool:
        """Wait up to ``timeout_s`` seconds for the disk tier's queued reads and writes; True
        when they all finished (also without tiers)."""
        return self.engine.flush_kv_tiers(timeout_s)

    def close(self) -> None:
        """Finish the disk tier's queued writes and stop background threads (idempotent)."""
        self.engine.close()

    def check_integrity(self) -> None:
        """Assert the engine's block accounting balances (tests, census runs)."""
        self.engine.check_integrity()

    def warm_up(self) -> None:
        """One prefill (a little over two KV blocks) and one decode through the whole engine,
        so that first-use compilation happens now; the step timings start afresh after it.
        The warm-up request counts in the engine's token counters like any other."""
        prompt = [0] * max(1, min(2 * self.engine.block_size + 1, self.max_model_len - 2))
        self.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
        self.engine.reset_step_stats()

    def restore(self) -> None:
        """Give the model back its original attention implementation (plain HF use). This
        ``LLM`` generates no more: ``generate`` and ``stream`` then raise ``ValueError``."""
        self.runner.restore()
        self._restored = True


def _prompt_of(prompt: Any) -> Any:
    """A prompt as the engine takes it: text or token ids; vLLM's dictionaries unwrapped."""
    if not isinstance(prompt, dict):
        return prompt
    keys = set(prompt)
    if len(keys) != 1 or not keys <= set(PROMPT_KEYS):
        raise ValueError(f"a prompt dictionary holds exactly one of {list(PROMPT_KEYS)}; got keys {sorted(keys)}")
    (value,) = prompt.values()
    if "prompt" in prompt and not isinstance(value, str):
        raise ValueError(f"'prompt' must be text, got {type(value).__name__}")
    if "prompt_token_ids" in prompt and isinstance(value, str):
        raise ValueError("'prompt_token_ids' must be a list of token ids, got text")
    return value


def _as_list(value: Any, name: str) -> list:
    try:
        return list(value)
    except TypeError:
        raise ValueError(f"{name} must be a list, got {type(value).__name__}") from None


def patch(model: Any, tokenizer: Any = None, **config: Any) -> LLM:
    """Bind a paged, continuously batching ``LLM`` to a loaded HF model.

    ``config`` takes ``EngineConfig`` fields (block_size, num_kv_blocks, max_num_seqs, ...).
    Raises ``UnsupportedModelError`` (a ``ValueError``) naming the reason when the model's
    attention cannot be paged. Plain ``model.generate`` keeps working while patched;
    ``llm.restore()`` gives the model back its own attention.
    """
    return LLM(model, tokenizer=tokenizer, **config)
