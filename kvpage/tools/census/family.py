"""One family of transformers' causal-LM registry, classified: exact, refused, mismatch or skipped.

Steps, each of which can end the family's run:

1. build a tiny random config and model (``tiny_config``); if the full set of shrunk
   values is rejected, relaxed variants are tried, and if none builds and runs under HF,
   the family is ``skipped`` with HF's error (HF itself cannot build or run it);
2. kvpage's static checks (attention interface, recurrent or sparse layers) -> ``refused``
   with kvpage's reason;
3. HF ``generate`` greedy on the census prompts -> ``skipped`` if HF fails on them;
4. kvpage in every mode of ``compare.MODES``: ``exact``, ``refused`` (kvpage's reason),
   or ``mismatch`` (the first differing position, or the error kvpage raised). A
   difference is first checked against HF itself: if HF's cached ``generate`` disagrees
   with HF recomputing the sequence without a cache and kvpage equals the latter, HF's
   reference cannot judge the family, which is then ``skipped`` with both positions.

``report_phase`` is told which step runs, so a supervisor that has to kill a hung run can
say where it hung.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

from kvpage.tools.census.compare import (MAX_MODEL_LEN, census_prompts, compare_with_hf, describe_difference, first_difference,
                      hf_reference)

MAX_NEW_TOKENS = 8
MAX_ATTEMPTS = 40  # tiny-config variants tried before HF is declared unable to run the family
LADDER_SECONDS = 60.0  # ... and the time they may take


def causal_lm_families() -> dict[str, str]:
    """transformers' causal-LM registry: model type -> model class name."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def run_family(name: str, report_phase: Callable[[str], None] = lambda phase: None) -> dict:
    """Classify one family (see the module docstring); returns ``{"status", "reason", "modes", ...}``."""
    start = time.monotonic()
    result = _classify(name, report_phase)
    result["seconds"] = round(time.monotonic() - start, 1)
    return result


def _classify(name: str, report_phase: Callable[[str], None]) -> dict:
    import transformers

    from kvpage.adapters.hf_runner import UnsupportedModelError, check_supported

    class_name = causal_lm_families()[name]
    model_class = getattr(transformers, class_name, None)
    if model_class is None:
        return _result("skipped", f"transformers exports no class {class_name}", class_name)
    report_phase("build")
    model, problem = _build_tiny_model(name, model_class)
    if model is None:
        return _result("skipped", f"HF cannot build or run a tiny {name} config: {problem}", class_name)
    info = {"model_class": class_name, "config": _config_summary(model)}
    if getattr(model.config, "is_encoder_decoder", False):
        return {**_result("skipped", "an encoder-decoder model, not a decoder-only text model"), **info}
    try:
        check_supported(model)
    except UnsupportedModelError as exc:
        return {**_result("refused", str(exc)), **info}
    report_phase("hf")
    prompts = census_prompts(_vocab_size(model))
    try:
        reference = hf_reference(model, prompts, MAX_NEW_TOKENS)
    except Exception as exc:  # noqa: BLE001 - HF failing on plain token ids is a skip, not a kvpage result
        return {**_result("skipped", f"HF generate fails on token-id prompts: {_error(exc)}"), **info}
    report_phase("kvpage")
    try:
        modes = compare_with_hf(model, prompts, MAX_NEW_TOKENS, _max_len(model), reference)
    except UnsupportedModelError as exc:
        return {**_result("refused", str(exc)), **info}
    except Exception as exc:  # noqa: BLE001 - a kvpage failure on a model HF runs is a bug to report
        return {**_result("mismatch", f"kvpage failed: {_error(exc)}"), **info}
    mode_dicts = {mode: r.as_dict() for mode, r in modes.items()}
    bad = {mode: r for mode, r in modes.items() if r.status != "exact"}
    if bad:
        inconsistent = _hf_disagrees_with_itself(model, prompts, reference[0], modes)
        if inconsistent:
            return {**_result("skipped", inconsistent, modes=mode_dicts), **info}
        reason = "; ".join(f"{mode}: {describe_difference(r.difference)}" for mode, r in bad.items())
        return {**_result("mismatch", reason, modes=mode_dicts), **info}
    return {**_result("exact", "", modes=mode_dicts), **info}


def _hf_disagrees_with_itself(model: Any, prompts: list, cached: list, modes: dict) -> Optional[str]:
    """Why HF's reference cannot judge kvpage here, or None: HF ``generate`` with its cache
    and HF recomputing the whole sequence per token (no cache) disagree, and kvpage equals
    the latter in every mode (e.g. a cache that slides a window the model's mask does not
    apply, so prefill and decode attend differently)."""
    full, margins = hf_reference(model, prompts, MAX_NEW_TOKENS, use_cache=False)
    where = first_difference(cached, full, margins)
    if where is None or any(result.tokens != full for result in modes.values()):
        return None
    return (f"HF generate disagrees with HF's own full forward without a cache (prompt {where['prompt']}, output "
            f"token {where['position']}: cached {where['hf']}, uncached {where['kvpage']}); kvpage equals the full "
            "forward in every mode, so HF's reference is not self-consistent for this tiny config")


def _result(status: str, reason: str, model_class: Optional[str] = None, modes: Optional[dict] = None) -> dict:
    out: dict[str, Any] = {"status": status, "reason": reason, "modes": modes or {}}
    if model_class is not None:
        out["model_class"] = model_class
    return out


def _build_tiny_model(name: str, model_class: type) -> tuple[Any, Optional[str]]:
    """The first tiny variant HF builds (and, unless kvpage refuses it statically, runs one
    short generate on); else (None, the first error). Variants are tried for at most
    ``LADDER_SECONDS`` and ``MAX_ATTEMPTS`` builds."""
    import torch

    from kvpage.tools.census.tiny_config import candidate_overrides

    first_error = None
    attempts = 0
    deadline = time.monotonic() + LADDER_SECONDS
    for config_class in _config_classes(name, model_class):
        for repeats in (1, 2):
            try:
                candidates = list(candidate_overrides(config_class, repeats))
            except Exception as exc:  # noqa: BLE001 - the config class's own defaults fail
                first_error = first_error or f"{config_class.__name__}(): {_error(exc)}"
                break
            for overrides in candidates:
                attempts += 1
                if attempts > MAX_ATTEMPTS or time.monotonic() > deadline:
                    return None, first_error
                try:
                    torch.manual_seed(0)
                    model = model_class._from_config(config_class(**overrides), dtype=torch.float32).eval()
                    _prepare(model)
                    _smoke_test(model)
                    return model, None
                except Exception as exc:  # noqa: BLE001 - try the next variant
                    first_error = first_error or _error(exc)
    return None, first_error


def _config_classes(name: str, model_class: type) -> list:
    """The registry's config class for ``name``, then the model class's own if it differs
    (aliases such as 'exaone' map their own config to another family's model class)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    classes = [CONFIG_MAPPING[name]] if name in CONFIG_MAPPING else []
    own = getattr(model_class, "config_class", None)
    if own is not None and own not in classes:
        classes.append(own)
    return classes


def _smoke_test(model: Any) -> None:
    """One short HF generate; raises what HF raises (a tiny variant HF cannot run is not a
    kvpage result: the ladder tries the next one)."""
    import torch

    with torch.inference_mode():  # longer than the tiny sliding windows, so windowed paths run too
        ids = torch.arange(3, 15).unsqueeze(0)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                       eos_token_id=None, pad_token_id=0)


def _prepare(model: Any) -> None:
    """Model-level defaults a checkpoint would carry (a default language for X-MOD)."""
    languages = getattr(model.config, "languages", None)
    if languages and hasattr(model, "set_default_language"):
        model.set_default_language(list(languages)[0])


def _vocab_size(model: Any) -> int:
    embeddings = model.get_input_embeddings()
    weight = getattr(embeddings, "weight", None)
    return int(weight.shape[0]) if weight is not None else int(_get(model, "vocab_size") or 128)


def _max_len(model: Any) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = _get(model, name)
        if isinstance(value, int) and value > 0:
            return min(value, MAX_MODEL_LEN)
    return MAX_MODEL_LEN


def _get(model: Any, name: str) -> Any:
    """``name`` of the model's text config; None if absent or unreadable (some configs refuse
    global reads of per-layer attributes)."""
    try:
        return getattr(model.config.get_text_config(), name, None)
    except Exception:  # noqa: BLE001
        return None


def _config_summary(model: Any) -> dict:
    keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    summary = {key: _get(model, key) for key in keys}
    summary["parameters"] = sum(p.numel() for p in model.parameters())
    return {k: v for k, v in summary.items() if isinstance(v, int)}


def _error(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"
