"""KV cache formats: how one token's K or V row of one head is stored, in bytes.

A format is named by ``kv_cache_dtype`` (vLLM's names where vLLM has them):

=============  =====================================================  ==========================
name           one head's row of ``D`` values: codes, then scales      bytes per row
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
               channels a scale ``s`` and an offset ``m`` as float16:
               ``x = m + code * s`` (asymmetric, per token and head;
               the encoder picks ``m`` and ``s`` by a least-squares
               search, ``kv_quant.int4_ranges``)
=============  =====================================================  ==========================

``G`` (:func:`int4_group`) is 32 where the head size is a multiple of 32, else the whole
head. The fp8 and int4 formats store each head's K and V rows multiplied by an orthonormal
Hadamard matrix (:attr:`KVFormat.rotated`; ``kvpage.attention.kv_rotation``), which spreads
outlier channels over the whole row before it is rounded; int8 stores rows as they are.
A quantized block of a layer is one span of bytes: the codes of its token rows, then their
scales (:meth:`KVFormat.block_regions`), so it is self-contained: it moves as bytes through
copy-on-write, the prefix cache, preemption and the host and disk tiers. Scales are per token (never per block or per channel across
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

    @property
    def rotated(self) -> bool:
        """Whether rows are stored Hadamard-rotated (fp8 and int4): part of the bytes' meaning,
        so the disk tier's fingerprint version changed when fp8 began to rotate. int8 rounds fine enough without it; fp8's
        3 (E4M3) or 2 (E5M2) mantissa bits round a key's outlier channels coarsely, and the
        error of q . k follows them (``docs/memory.md``)."""
        return self.is_fp8 or self.name == "int4"

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ``ValueError`` when rows of ``head_dim`` values cannot take this format."""
        if self.name == "int4" and head_dim % 2:
            raise ValueError(f"kv_cache_dtype int4 packs two values a byte: it needs an even head size, "
                             f"not {head_dim}")

    def code_bytes(self, head_dim: int) -> int:
        """Bytes of one head's row of codes (of the values themselves, unquantized)."""
        if not self.quantized:
            return head_dim * _ITEMSIZE[self.name]
        self.check_head_dim(head_dim)
        return head_dim // 2 if self.name == "int4" else head_dim

    def scale_bytes(self, head_dim: int) -> int:
        """Bytes of one head's row of scales (0 unquantized)."""
        if not self.quantized or head_dim == 0:
            return 0
        if self.is_fp8:
            return 1
        if self.name == "int8":
            return 2
        return 4 * (head_dim // int4_group(head_dim))

    def row_bytes(self, head_dim: int) -> int:
        """Bytes one token stores for one head of ``head_dim`` values: codes and scales."""
        return self.code_bytes(head_dim) + self.scale_bytes(head_dim)

    def block_bytes(self, block_size: int, heads: int, head_dim: int) -> int:
        """Bytes of one block of one layer's K (or V) buffer."""
        return block_size * heads * self.row_bytes(head_dim)

    def buffer_shape(self, num_blocks: int, block_size: int, heads: int, head_dim: int) -> tuple:
        """The shape of one layer's K (or V) buffer: ``[num_blocks, block_size, heads,
        head_dim]`` of values, or for a quantized format ``[num_blocks, block_bytes]`` bytes laid
        out as :func:`block_regions` says."""
        if not self.quantized:
            return (num_blocks, block_size, heads, head_dim)
        return (num_blocks, self.block_bytes(block_size, heads, head_dim))

    def block_regions(self, block_size: int, heads: int, head_dim: int) -> tuple:
        """A quantized block's two regions, as ``(offset, shape)`` pairs in bytes: the codes
        ``[block_size, heads, code_bytes]`` from byte 0, then the scales ``[block_size, heads,
        scale_bytes]``. A block's bytes are one contiguous span. Code rows are 16-byte aligned
        where a row's code bytes are a multiple of 16 (fp8 and int8 at head sizes that are
        multiples of 16, int4 at multiples of 32); the kernels read other rows unaligned."""
        codes = block_size * heads * self.code_bytes(head_dim)
        return ((0, (block_size, heads, self.code_bytes(head_dim))),
                (codes, (block_size, heads, self.scale_bytes(head_dim))))


def int4_group(head_dim: int) -> int:
    """Channels sharing one int4 scale and offset: 32, else the whole head. (Groups of 64
    hold 3.56x bf16's tokens instead of 3.2x, but cost SmolLM2-135M +3.9 % perplexity where
    32 cost +2.8 %: ``docs/memory.md``.)"""
    return 32 if head_dim % 32 == 0 else head_dim


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


@dataclass(frozen=True, slots=True)
class CacheFormat:
    """What a kernel needs besides a layer's K (or V) buffer to read it: the format and the
    block size. A quantized buffer is ``[num_blocks, block_bytes]`` bytes, whose head count
    follows from its width and the head size (:meth:`logical_shape`)."""

    kv_format: KVFormat
    block_size: int

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")

    @property
    def quantized(self) -> bool:
        return self.kv_format.quantized

    def logical_shape(self, buffer_shape: tuple, head_dim: int) -> tuple:
        """``(num_blocks, block_size, heads, head_dim)`` of a buffer of ``buffer_shape`` holding
        rows of ``head_dim`` values (a 4-D unquantized shape is returned as it is)."""
        if not self.quantized:
            return tuple(buffer_shape)
        num_blocks, block_bytes = buffer_shape
        per_head = self.block_size * self.kv_format.row_bytes(head_dim)
        if block_bytes % per_head:
            raise ValueError(f"a {self.kv_format.name} block of {block_bytes} bytes does not hold rows of "
                             f"{head_dim} values in blocks of {self.block_size} tokens")
        return (num_blocks, self.block_size, block_bytes // per_head, head_dim)
