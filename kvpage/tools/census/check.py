"""``kvpage check MODEL``: does kvpage serve this local model exactly? One screen of answer.

Loads the folder (config and weights) in float32 on CPU, asks kvpage's static checks, then
compares a short greedy probe (a few prompts, a few tokens) with HF ``generate`` in both
modes of ``compare.MODES``. The verdict is ``exact``, ``refused`` (kvpage's reason) or
``mismatch`` (the first differing position).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpage.tools.census.compare import census_prompts, compare_with_hf, describe_difference
from kvpage.tools.census.modes import MODE_DESCRIPTIONS

PROBE_TEXTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, there")
MAX_NEW_TOKENS = 6


@dataclass
class CheckReport:
    """What ``check_model`` found; ``lines()`` is the screen ``kvpage check`` prints."""

    model: str
    status: str  # "exact", "refused" or "mismatch"
    reason: str = ""
    architecture: str = ""
    kv_layout: str = ""
    modes: dict = field(default_factory=dict)  # mode -> one-line outcome

    def lines(self) -> list[str]:
        out = [f"kvpage check {self.model}", f"model: {self.architecture}"]
        if self.kv_layout:
            out.append(f"KV per token: {self.kv_layout}")
        for mode, outcome in self.modes.items():
            out.append(f"mode {mode} ({MODE_DESCRIPTIONS[mode]}): {outcome}")
        verdict = {"exact": "kvpage serves this model exactly (greedy tokens equal HF generate, float32)",
                   "refused": f"kvpage does not serve this model: {self.reason}",
                   "mismatch": f"kvpage's greedy tokens differ from HF generate, a kvpage bug: {self.reason}"}
        out.append(f"verdict: {self.status}: {verdict[self.status]}")
        return out


def check_model(path: str, max_new_tokens: int = MAX_NEW_TOKENS) -> CheckReport:
    """Check the HF model folder ``path``. Raises ``ValueError`` if it cannot be loaded."""
    import torch

    from kvpage.adapters.hf_runner import UnsupportedModelError, check_supported

    model, tokenizer = _load(path)
    report = CheckReport(path, "exact", architecture=_architecture(model))
    try:
        check_supported(model)
    except UnsupportedModelError as exc:
        report.status, report.reason = "refused", str(exc)
        return report
    prompts = _prompts(tokenizer, model)
    try:
        with torch.inference_mode():
            modes = compare_with_hf(model, prompts, max_new_tokens, _max_len(model, prompts, max_new_tokens))
    except UnsupportedModelError as exc:
        report.status, report.reason = "refused", str(exc)
        return report
    except Exception as exc:  # noqa: BLE001 - kvpage failing on a model HF runs is the finding
        report.status, report.reason = "mismatch", f"kvpage failed: {type(exc).__name__}: {exc}"
        return report
    report.kv_layout = _kv_layout(model)
    for mode, result in modes.items():
        stats = f"{result.stats['prefix_cache_hits']} prefix-cache hit tokens, {result.stats['preemptions']} " \
                "preemptions"
        report.modes[mode] = ("exact" if result.difference is None else
                              f"MISMATCH at {describe_difference(result.difference)}") + f" ({stats})"
    bad = [f"{mode}: {describe_difference(r.difference)}" for mode, r in modes.items() if r.difference]
    if bad:
        report.status, report.reason = "mismatch", "; ".join(bad)
    return report


def _load(path: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvpage.platform.model_registry import resolve_model_path

    folder = resolve_model_path(path)  # an alias, or a folder with config.json; else ValueError
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    except Exception as exc:  # noqa: BLE001 - any loading failure is the user's to fix
        raise ValueError(f"{path}: transformers cannot load it as a causal LM: {type(exc).__name__}: {exc}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception:  # noqa: BLE001 - a folder without a tokenizer is probed with token ids
        tokenizer = None
    return model, tokenizer


def _prompts(tokenizer: Any, model: Any) -> list[list[int]]:
    """The probe texts through the tokenizer (with a shared-prefix pair), else random token ids."""
    vocab = int(model.get_input_embeddings().weight.shape[0])
    if tokenizer is None:
        return census_prompts(vocab)
    texts = [*PROBE_TEXTS, PROBE_TEXTS[0] + " Paris, and the capital of Italy is"]
    prompts = [list(tokenizer(text)["input_ids"]) for text in texts]
    if not all(prompts) or any(t >= vocab for p in prompts for t in p):
        return census_prompts(vocab)
    return [prompts[0], *prompts]  # the first runs alone first, so the stress mode hits its blocks


def _max_len(model: Any, prompts: list, max_new_tokens: int) -> int:
    """The longest probe request, at least the census's 48 tokens."""
    return max(max(len(p) for p in prompts) + max_new_tokens, 48)


def _architecture(model: Any) -> str:
    text = model.config.get_text_config()
    parameters = sum(p.numel() for p in model.parameters())
    layers = getattr(text, "num_hidden_layers", "?")
    return f"{type(model).__name__} ({model.config.model_type}), {layers} layers, {parameters / 1e6:.1f}M parameters"


def _kv_layout(model: Any) -> str:
    """The per-layer KV layout kvpage uses for ``model`` (one probe forward)."""
    from kvpage.adapters.hf_runner import HFModelRunner
    from kvpage.storage.spec import KVCacheSpec

    runner = HFModelRunner(model)
    try:
        spec = KVCacheSpec(tuple(runner.layer_specs), block_size=16, dtype="float32")
        states = runner.state_layout
    finally:
        runner.restore()
    state = ""
    if states:  # recurrent layers: a fixed state per sequence in state slots, beside any KV
        state = (f"; recurrent state in {len({e.layer for e in states})} layers, "
                 f"{sum(e.nbytes for e in states)} bytes per sequence")
    if not spec.layers:
        return f"none (no attention layers){state}"
    groups = []
    for layout, layers in spec.layers_by_layout().items():
        groups.append(f"{len(layers)} x (K [{layout.k_heads}x{layout.k_head_dim}] + V [{layout.v_heads}x"
                      f"{layout.v_head_dim}])")
    shared = spec.num_layers - len(spec.owner_layers)
    extra = f", {shared} layers reuse another layer's KV" if shared else ""
    return f"{' + '.join(groups)} = {spec.bytes_per_token} bytes in float32{extra}{state}"
