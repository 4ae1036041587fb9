"""The Hadamard rotation of fp8 and int4 KV: heads are stored rotated, so no channel's outlier dominates a row's rounding.

A key or value row quantized to 4 bits per token loses most where a few channels carry
much larger values than the rest (keys have such outlier channels): the row's scale
follows the outliers and the other channels round to a handful of codes. In fp8 each value
keeps its own exponent, but its 3 (E4M3) or 2 (E5M2) mantissa bits round an outlier channel
by an amount as large as the outlier, and where queries have the same outlier channels that
error dominates ``q . k``; rotated, it is spread over the whole row. Multiplying each
head's rows by an orthonormal Hadamard matrix ``R`` spreads every channel over all of
them, so the rotated row is near Gaussian and quantizes well; since ``R`` is orthonormal,
``(q R) . (k R) = q . k`` and ``sum_j p_j (v_j R) = (sum_j p_j v_j) R``. Attention over a
rotated cache (:attr:`KVFormat.rotated <kvpage.core.kv_formats.KVFormat.rotated>`: fp8 and
int4) therefore runs on ``q R`` and rotated K/V rows, and its output is turned back
with ``R^T`` (``R`` is symmetric, so ``R^T = R``). Rotation is per token, so stored bytes
still depend on nothing but the token's own values. On SmolLM2-135M, int4 with the rotation
costs about a quarter of the perplexity the same format costs without it, and fp8_e4m3 about
four fifths (``docs/memory.md``).

``R`` is block-diagonal: Sylvester Hadamard blocks of the largest power of two dividing the
head size, at most :data:`MAX_BLOCK` (rotating across the int4 groups spreads an outlier over
several groups' scales, which is what it is for).
"""
from __future__ import annotations

import functools

import numpy as np

#: The largest Hadamard block (a head of 256 is rotated as two blocks of 128).
MAX_BLOCK = 128


@functools.lru_cache(maxsize=None)
def hadamard_rotation(head_dim: int) -> np.ndarray:
    """float32 ``[head_dim, head_dim]``: the symmetric orthonormal block-diagonal Hadamard ``R``."""
    block = 1
    while head_dim % (2 * block) == 0 and 2 * block <= MAX_BLOCK:
        block *= 2
    h = np.ones((1, 1))
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    rotation = np.kron(np.eye(head_dim // block), h / np.sqrt(block))
    return rotation.astype(np.float32)


@functools.lru_cache(maxsize=None)
def _torch_rotation(head_dim: int, device: str):
    import torch

    return torch.from_numpy(hadamard_rotation(head_dim)).to(device)


def rotate(x, dtype=None):
    """``x [..., D]`` (a torch tensor) times ``R``, in float32, returned as ``dtype`` (default x's)."""
    rotation = _torch_rotation(int(x.shape[-1]), str(x.device))
    return (x.float() @ rotation).to(dtype or x.dtype)
