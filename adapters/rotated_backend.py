"""An attention backend over a cache that stores heads rotated (fp8 and int4 KV: ``kvpage.attention.kv_rotation``).

``RotatedBackend`` wraps any backend: K/V rows are rotated before they are stored, queries
before they attend, and the result is rotated back, so the backend's kernels see an
ordinary fp8 or int4 cache and never know. Scores and softmax are unchanged by an orthonormal
rotation (sliding windows, softcap and sinks included); only the values' rounding is.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from kvpage.attention.kv_rotation import rotate


class RotatedBackend:
    """``inner`` behind the rotation; every other attribute is ``inner``'s."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def prepare(self, metadata):
        return self.inner.prepare(metadata)

    def write_kv(self, key_cache, value_cache, k: torch.Tensor, v: torch.Tensor, prepared) -> None:
        self.inner.write_kv(key_cache, value_cache, rotate(k), rotate(v), prepared)

    def attention(self, q: torch.Tensor, key_cache, value_cache, prepared, *args, **kwargs) -> torch.Tensor:
        return rotate(self.inner.attention(rotate(q), key_cache, value_cache, prepared, *args, **kwargs))

    def write_and_attend(self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor], key_cache,
                         value_cache, prepared, *args, write: bool = True, **kwargs) -> torch.Tensor:
        fused = getattr(self.inner, "write_and_attend", None)
        if fused is None:
            if write:
                self.write_kv(key_cache, value_cache, k, v, prepared)
            return self.attention(q, key_cache, value_cache, prepared, *args, **kwargs)
        k, v = (rotate(k), rotate(v)) if write else (k, v)
        return rotate(fused(rotate(q), k, v, key_cache, value_cache, prepared, *args, write=write, **kwargs))
