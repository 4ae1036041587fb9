"""The model fingerprint that keys the disk tier: another model never reads these files.

It hashes what determines a block's KV bytes: the model class and configuration (minus
bookkeeping keys such as its path), a sample of every parameter (name, shape, dtype and
the bytes of its first and last elements, so fine-tunes of one architecture differ), the
KV layout (layers, heads, head size), the model's dtype, the KV cache format (a block
written as int8 is never read as fp8: version 2 added it; version 3: fp8 rows are now stored
rotated, which version 2's were not) and the block size. The sample keeps
it fast (milliseconds for a 135M model); a change that leaves every sampled element
untouched would go unnoticed, which no real training run does.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from kvpage.storage.spec import KVCacheSpec

FINGERPRINT_VERSION = "kvpage-kv-fingerprint/3"
_SAMPLE_ELEMENTS = 64
_VOLATILE_CONFIG_KEYS = ("transformers_version", "architectures", "torch_dtype", "dtype")


def _config_json(model: Any) -> str:
    config = getattr(model, "config", None)
    items = config.to_dict() if config is not None else {}
    kept = {k: v for k, v in items.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    return json.dumps(kept, sort_keys=True, default=repr)


def model_fingerprint(model: Any, spec: KVCacheSpec) -> str:
    """64 hex digits naming (model weights, configuration, KV layout, dtype, KV format, block size)."""
    import torch

    digest = hashlib.sha256()
    layers = tuple((layer.k_heads, layer.k_head_dim, layer.v_heads, layer.v_head_dim, layer.reuses)
                   for layer in spec.layers)
    layout = (FINGERPRINT_VERSION, type(model).__name__, layers, spec.block_size, spec.dtype, spec.kv_format.name)
    digest.update(repr(layout).encode())
    digest.update(_config_json(model).encode())
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            flat = param.detach().reshape(-1)
            sample = torch.cat([flat[:_SAMPLE_ELEMENTS], flat[-_SAMPLE_ELEMENTS:]]).to("cpu", torch.float32)
            digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}".encode())
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()
