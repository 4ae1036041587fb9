"""KV cache formats: how one token's K or V row of one head is stored, in bytes.

A format is named by ``kv_cache_dtype`` (vLLM's names where vLLM has them):

=============  =====================================================  ==========================
name           one head's row of ``D`` values                          bytes per row
=============  =====================================================  ==========================
``bfloat16``,  the values at that dtype                                ``D * itemsize``
``float16``,
``float32``
``fp8_e4m3``   ``D`` fp8 E4M3 codes of ``x / 2**e``, then ``e``        ``D + 1``
(``fp8``)      (a signed byte): a power-of-two scale per token and
               head, so scaling is exact and the codes use fp8's
               whole range
``fp8_e5m2``   the same with E5M2 codes                                ``D + 1``
``int8``       ``D`` int8 codes ``round(x / s)`` in ``[-127, 127]``,    ``D + 2``
               then ``s = absmax / 127`` as float16 (symmetric,
               per token and head)
``int4``       ``D / 2`` bytes of 4-bit codes (element ``2j`` in the   ``D / 2 + 4 * D / G``
               low nibble of byte ``j``), then per group of ``G``
               channels ``s = (max - min) / 15`` and ``min`` as
               float16: ``x = min + code * s`` (asymmetric, per token
               and head)
=============  =====================================================  ==========================

``G`` (:func:`int4_group`) is 64 where the head size is a multiple of 64, else 32, else
the whole head. Every quantized row carries its own scales, so a block (its token rows)
is self-contained: it moves as bytes through copy-on-write, the prefix cache, preemption
and the host and disk tiers. Scales are per token (never per block or per channel across
tokens), so a token's stored bytes depend only on its own K/V values: greedy output cannot
depend on how a prompt was split into chunks or which blocks a prefix hit reused.

Pure and numpy-free: the kernels (``kvpage.kernels.kv_quant`` and the native and CUDA
kernels) implement the byte layouts this module names.
"""
from __future__ import annotations

from dataclasses import dataclass

#: Names the model's own dtype can take (``auto`` resolves to one of them).
MODEL_DTYPES = ("bfloat16", "float16", "float32")
#: Every accepted ``kv_cache_dtype``, vLLM's spellings included.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
_ALIASES = {"fp8": "fp8_e4m3"}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class KVFormat:
    """One storage format of K/V rows (see the module docstring for the byte layouts).

    ``name`` is canonical (``fp8`` becomes ``fp8_e4m3``). An unquantized format stores
    values of dtype ``name``; a quantized one stores ``uint8`` bytes, ``row_bytes(D)`` per
    head and token.
    """

    name: str

    def __post_init__(self) -> None:
        if self.name not in KV_CACHE_DTYPES or self.name in ("auto", *_ALIASES):
            raise ValueError(f"unknown KV format {self.name!r}; expected one of "
                             f"{[n for n in KV_CACHE_DTYPES if n not in ('auto', *_ALIASES)]}")

    @property
    def quantized(self) -> bool:
        return self.name not in _ITEMSIZE

    @property
    def storage_dtype(self) -> str:
        """The dtype of the cache buffers: the format's own, or ``uint8`` bytes."""
        return "uint8" if self.quantized else self.name

    @property
    def is_fp8(self) -> bool:
        return self.name.startswith("fp8")

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ``ValueError`` when rows of ``head_dim`` values cannot take this format."""
        if self.name == "int4" and head_dim % 2:
            raise ValueError(f"kv_cache_dtype int4 packs two values a byte: it needs an even head size, "
                             f"not {head_dim}")

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one head's row of ``head_dim`` values (codes and scales)."""
        if head_dim == 0:
            return 0
        if not self.quantized:
            return head_dim * _ITEMSIZE[self.name]
        if self.is_fp8:
            return head_dim + 1
        if self.name == "int8":
            return head_dim + 2
        self.check_head_dim(head_dim)
        return head_dim // 2 + 4 * (head_dim // int4_group(head_dim))

    def row_width(self, head_dim: int) -> int:
        """The last dimension of a cache buffer of rows of ``head_dim`` values: ``head_dim``
        unquantized, else ``row_bytes(head_dim)``."""
        return self.row_bytes(head_dim) if self.quantized else head_dim

    def head_dim_of(self, row_width: int) -> int:
        """The head size whose rows are ``row_width`` wide (the inverse of :meth:`row_width`)."""
        if not self.quantized or row_width == 0:
            return row_width
        if self.is_fp8:
            return row_width - 1
        if self.name == "int8":
            return row_width - 2
        for head_dim in range(2, 2 * row_width + 1, 2):  # int4: row bytes grow with the head size
            if self.row_bytes(head_dim) == row_width:
                return head_dim
        raise ValueError(f"no head size has int4 rows of {row_width} bytes")


def int4_group(head_dim: int) -> int:
    """Channels sharing one int4 scale and minimum: 64, else 32, else the whole head."""
    for group in (64, 32):
        if head_dim % group == 0:
            return group
    return head_dim


def resolve_kv_format(kv_cache_dtype: str, model_dtype: str) -> KVFormat:
    """The format ``kv_cache_dtype`` names, ``auto`` being the model's dtype ``model_dtype``.

    Raises ``ValueError`` (one line, listing the choices) for an unknown name.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        if model_dtype not in MODEL_DTYPES:
            raise ValueError(f"model dtype must be one of {MODEL_DTYPES}, got {model_dtype!r}")
        return KVFormat(model_dtype)
    return KVFormat(_ALIASES.get(kv_cache_dtype, kv_cache_dtype))
