"""Block hashes that stay the same across processes: the key of every KV tier and event.

A full block's hash chains its parent's hash with its own token ids::

    h(root)  = sha256("kvpage/block-hash/v1" | namespace)
    h(b_i)   = sha256(h(b_{i-1}) | int64 little-endian token ids of b_i)

so equal hashes mean equal token prefixes (in the same namespace). Python's ``hash()`` is
salted per process and would make a disk cache useless after a restart; sha256 over a
fixed byte encoding is not. Routers get 64-bit ints (``external_hash``): the low 64 bits
of the digest, vLLM's conversion.
"""
from __future__ import annotations

import hashlib
from typing import Hashable, NewType, Optional, Sequence

import numpy as np

BlockHash = NewType("BlockHash", bytes)  # a 32-byte sha256 digest

_ROOT_TAG = b"kvpage/block-hash/v1"
_STABLE_NAMESPACE_TYPES = (str, int, bytes, type(None))


def namespace_root(namespace: Hashable) -> BlockHash:
    """The hash every chain of ``namespace`` starts from.

    Stable across processes for ``None``, str, int, bytes and tuples of those (their
    ``repr`` is); other namespace objects hash by ``repr`` too, so give them a stable one.
    """
    if namespace is None:
        return BlockHash(hashlib.sha256(_ROOT_TAG).digest())
    if not isinstance(namespace, _STABLE_NAMESPACE_TYPES + (tuple,)):
        namespace = f"{type(namespace).__qualname__}:{namespace!r}"
    return BlockHash(hashlib.sha256(_ROOT_TAG + b"\0" + repr(namespace).encode("utf-8")).digest())


def chain_hashes(parent: BlockHash, token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` (a whole number of blocks), chained from ``parent``.

    One int64 conversion for all tokens, then one sha256 per block (never per token).
    """
    num_blocks = len(token_ids) // block_size
    data = np.asarray(token_ids[: num_blocks * block_size], dtype="<i8").tobytes()
    stride = 8 * block_size
    hashes: list[BlockHash] = []
    for i in range(num_blocks):
        parent = BlockHash(hashlib.sha256(parent + data[i * stride : (i + 1) * stride]).digest())
        hashes.append(parent)
    return hashes


def external_hash(block_hash: BlockHash) -> int:
    """The 64-bit unsigned int a router sees for ``block_hash`` (vLLM's int block hashes)."""
    return int.from_bytes(block_hash[-8:], "big")


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, namespace: Hashable = None,
                        max_blocks: Optional[int] = None) -> list[int]:
    """The 64-bit hashes (``external_hash``) of the full blocks of ``token_ids`` in ``namespace``,
    first block first, at most ``max_blocks``: what a router compares with the hashes a
    radix cache reports (``RadixCache.block_hashes``) or publishes in KV events."""
    num_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    chain = chain_hashes(namespace_root(namespace), list(token_ids[: num_blocks * block_size]), block_size)
    return [external_hash(h) for h in chain]
