"""Chained hashes of full KV blocks: the identity a router and a replica's radix cache agree on.

For a token sequence cut into blocks of ``block_size`` tokens, block ``i``'s hash is
``hash((hash of block i - 1, tokens of block i))`` with ``ROOT_HASH`` before block 0, so one
hash names a whole prefix, not only its last block: two sequences share block ``i``'s hash
exactly when their first ``i + 1`` blocks are equal (up to 64-bit collisions). Only full
blocks have hashes, like only full blocks are cached.

Python hashes ints and tuples of ints without the per-process salt it uses for ``str`` and
``bytes`` (``PYTHONHASHSEED``), so every process on every node computes the same chain; the
root is an int because ``hash(None)`` is an address on Python 3.11.
"""
from __future__ import annotations

from typing import Optional, Sequence

ROOT_HASH = 0


def next_block_hash(parent_hash: int, block_tokens: tuple) -> int:
    """The hash of a block holding ``block_tokens`` (ints) after the prefix named ``parent_hash``."""
    return hash((parent_hash, block_tokens))


def prefix_block_hashes(tokens: Sequence[int], block_size: int, max_blocks: Optional[int] = None) -> list[int]:
    """Hashes of the full blocks of ``tokens``, first block first (at most ``max_blocks``)."""
    num_blocks = len(tokens) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    hashes, parent = [], ROOT_HASH
    for i in range(num_blocks):
        parent = next_block_hash(parent, tuple(int(t) for t in tokens[i * block_size:(i + 1) * block_size]))
        hashes.append(parent)
    return hashes
