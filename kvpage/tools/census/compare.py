"""Greedy tokens of kvpage against HF ``generate`` on one loaded model, in two engine modes.

The oracle is HF ``generate``, greedy, one unpadded prompt at a time, EOS ignored. kvpage
runs the same prompts in each mode of ``MODES``:

* ``stress``: block size 4, chunked prefill of 6 tokens per step, a prompt run first so the
  others hit its blocks in the prefix cache, and a pool that holds one longest request
  (at least 12 blocks), so concurrent requests are preempted and recomputed;
* ``plain``: block size 16, whole prompts in one step, no prefix cache, room to spare.

A mode is ``exact`` when every token matches, else ``mismatch`` with the first differing
position and HF's margin there (top-1 minus top-2 logit: a near-zero margin is a near tie
in float32, not necessarily a bug). The model must be in float32.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from kvpage.tools.census.modes import MODES

MAX_MODEL_LEN = 48


@dataclass
class ModeResult:
    """One mode's outcome; ``difference`` is None when exact."""

    status: str  # "exact" or "mismatch"
    difference: Optional[dict] = None
    stats: dict = field(default_factory=dict)
    tokens: list = field(default_factory=list)  # kvpage's outputs, per prompt (not in ``as_dict``)

    def as_dict(self) -> dict:
        out: dict[str, Any] = {"status": self.status, **self.stats}
        if self.difference is not None:
            out["first_difference"] = self.difference
        return out


def census_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts of ids in ``[3, min(vocab, 128) - 16)`` (clear of the usual special ids): one
    8-token prefix alone, three prompts that extend it, and three unrelated ones."""
    high = max(4, min(vocab_size, 128) - 16)
    g = torch.Generator().manual_seed(seed)

    def draw(n: int) -> list[int]:
        return torch.randint(3, high, (n,), generator=g).tolist()

    prefix = draw(8)
    return [prefix, prefix + draw(1), prefix + draw(3), prefix + draw(6), draw(2), draw(9), draw(13)]


def hf_greedy(model: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int,
              use_cache: bool = True) -> tuple[list[int], list[float]]:
    """HF's greedy continuation of one unpadded prompt (EOS ignored) and its top-2 margin per
    token; ``use_cache=False`` recomputes the whole sequence for every token instead. Forced
    first/last tokens from the model's generation config (Bart-style ``forced_eos_token_id``,
    a translation target's ``forced_bos_token_id``) are off: plain greedy decoding, as
    kvpage and vLLM serve it."""
    with torch.inference_mode():
        ids = torch.tensor([list(prompt)], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                             forced_eos_token_id=None, forced_bos_token_id=None,
                             output_scores=True, return_dict_in_generate=True, use_cache=use_cache)
    margins = []
    for scores in out.scores:
        top = torch.topk(scores[0].float(), 2).values
        margins.append(float(top[0] - top[1]))
    return out.sequences[0, len(prompt):].tolist(), margins


def first_difference(expected: Sequence[Sequence[int]], got: Sequence[Sequence[int]],
                     margins: Sequence[Sequence[float]]) -> Optional[dict]:
    """Where kvpage first departs from HF: prompt index, output position, both tokens, HF's margin."""
    for index, (want, have) in enumerate(zip(expected, got)):
        for position in range(max(len(want), len(have))):
            hf_token = want[position] if position < len(want) else None
            kv_token = have[position] if position < len(have) else None
            if hf_token != kv_token:
                margin = margins[index][position] if position < len(margins[index]) else None
                return {"prompt": index, "position": position, "hf": hf_token, "kvpage": kv_token,
                        "hf_margin": margin}
    return None


def kvpage_greedy(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, mode: str,
                  max_model_len: int) -> tuple[list[list[int]], dict]:
    """kvpage's greedy outputs in ``mode`` and the engine statistics that show what it exercised.

    Raises ``UnsupportedModelError`` (a ``ValueError``) when kvpage refuses the model.
    """
    from kvpage import LLM, SamplingParams

    options = dict(MODES[mode])
    # The pool holds at least one request of max_model_len tokens (the engine insists), and no more
    # than that in the stress mode, so that concurrent requests there must be preempted.
    options["num_kv_blocks"] = max(options["num_kv_blocks"], _blocks_for_one_request(model, max_model_len, options))
    llm = LLM(model, dtype="float32", max_model_len=max_model_len, exact=True, **options)
    try:
        params = SamplingParams(max_tokens=max_new_tokens, temperature=0, ignore_eos=True)
        if mode == "stress":  # the prefix prompt first, alone: the others then hit its cached blocks
            outs = llm.generate(prompts[:1], params, use_tqdm=False)
            outs += llm.generate(prompts[1:], params, use_tqdm=False)
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        if stats["num_free_blocks"] != stats["num_blocks"]:
            raise RuntimeError(f"{stats['num_blocks'] - stats['num_free_blocks']} KV blocks leaked")
        llm.check_integrity()
        errors = [o.outputs[0].error for o in outs if o.outputs[0].error]
        if errors:
            raise RuntimeError(f"a request failed: {errors[0]}")
    finally:
        llm.restore()
    exercised = {"prefix_cache_hits": int(stats["prefix_cache_hits"]), "preemptions": int(stats["num_preemptions"])}
    return [list(o.outputs[0].token_ids) for o in outs], exercised


def _blocks_for_one_request(model: torch.nn.Module, max_model_len: int, options: dict) -> int:
    """Blocks one request of ``max_model_len`` tokens holds in the engine (every KV group of
    a hybrid model, its sliding groups writing one step's chunk), from the KV spec the
    engine's own probe finds (a config does not always say which layers slide, or which
    hold no KV)."""
    from kvpage.adapters.hf_runner import HFModelRunner
    from kvpage.storage.spec import KVCacheSpec

    bs = options["block_size"]
    chunk = options.get("max_num_batched_tokens", max_model_len) if options.get("enable_chunked_prefill") \
        else max_model_len
    runner = HFModelRunner(model)
    try:
        spec = KVCacheSpec(tuple(runner.layer_specs), bs, "float32")
    finally:
        runner.restore()
    if not spec.layers:  # recurrent layers only: the blocks just count tokens
        return -(-max_model_len // bs)
    return spec.kv_groups().blocks_per_request(max_model_len, bs, min(chunk, max_model_len))


def compare_with_hf(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int = 8,
                    max_model_len: Optional[int] = None,
                    reference: Optional[tuple[list, list]] = None) -> dict[str, ModeResult]:
    """Run every mode of ``MODES`` against HF's greedy tokens (``reference`` if already computed).

    Raises ``UnsupportedModelError`` when kvpage refuses the model; other exceptions are
    kvpage failures and propagate too.
    """
    expected, margins = reference or hf_reference(model, prompts, max_new_tokens)
    length = max_model_len or MAX_MODEL_LEN
    results = {}
    for mode in MODES:
        got, stats = kvpage_greedy(model, prompts, max_new_tokens, mode, length)
        difference = first_difference(expected, got, margins)
        results[mode] = ModeResult("exact" if difference is None else "mismatch", difference, stats, got)
    return results


def hf_reference(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int,
                 use_cache: bool = True) -> tuple[list, list]:
    """HF's greedy tokens and margins for every prompt."""
    pairs = [hf_greedy(model, prompt, max_new_tokens, use_cache) for prompt in prompts]
    return [tokens for tokens, _ in pairs], [margins for _, margins in pairs]


def describe_difference(difference: dict) -> str:
    """One line: where kvpage first departs from HF."""
    margin = difference.get("hf_margin")
    tie = f", HF top-2 margin {margin:.2g}" if margin is not None else ""
    return (f"prompt {difference['prompt']}, output token {difference['position']}: HF {difference['hf']}, "
            f"kvpage {difference['kvpage']}{tie}")
