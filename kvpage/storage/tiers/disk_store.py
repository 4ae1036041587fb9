"""The disk tier's files: one safetensors file per block, under a folder per model fingerprint.

Layout::

    <kv_disk_cache>/kvpage-<fingerprint>/<block hash, 64 hex digits>.safetensors

Each file holds tensors ``key`` and ``value``, ``[layers, block_size, kv_heads, head_dim]``
in the KV dtype, or for a quantized KV format (fp8, int8, int4) the blocks' own bytes,
uint8 ``[layers, block_bytes]`` (codes then scales, as in the pool), and string metadata:
the format, the fingerprint (which names the KV format), the block hash and a CRC-32 of
each tensor's bytes.

* Why safetensors: a documented, widely read format with a bounds-checked parser
  (written in Rust) that keeps dtypes such as bfloat16, no pickle, and one small file per
  block, so a damaged file costs one block. A transactional store (LMDB) would give atomic
  writes for free, but one corrupt page can take the whole database down (it trusts its
  pages when it maps them), and the disk tier must survive exactly that.
* The index is the folder itself: names are hashes, sizes and LRU order (modification
  time) come from one ``scandir`` at start-up, so there is no second file to fall out of
  step with the data after a crash.
* Writes are atomic: a temporary file in the same folder, then ``os.replace``. Files are
  not fsynced: a process crash cannot leave a half file under a final name; after a power
  loss a file may be torn, which its checksum catches.
* Reads check the format, fingerprint, hash, shapes, dtype and checksums; any mismatch or
  parse error raises ``CorruptEntry`` (the caller deletes the file and recomputes).
"""
from __future__ import annotations

import itertools
import json
import os
import zlib
from pathlib import Path
from typing import Any, Optional

from kvpage.core.block_hash import BlockHash

FORMAT = "kvpage-kv-block/1"
_SUFFIX = ".safetensors"
_TMP_SUFFIX = ".tmp"


class CorruptEntry(ValueError):
    """A disk-tier file that cannot be trusted (torn, corrupted, or of another format)."""


def _crc(tensor: Any) -> str:
    import torch

    raw = tensor.contiguous().view(torch.uint8).numpy()
    return f"{zlib.crc32(raw):08x}"


class DiskKVStore:
    """Block files for one model (``fingerprint``), each ``block_shape`` per K and V, of ``dtype``."""

    def __init__(self, root: str, fingerprint: str, block_shape: tuple, dtype: Any) -> None:
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.dir = self.root / f"kvpage-{fingerprint[:32]}"
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self._tmp_names = itertools.count()

    def path(self, block_hash: BlockHash) -> Path:
        return self.dir / f"{block_hash.hex()}{_SUFFIX}"

    # ------------------------------------------------------------------ start-up
    def open(self) -> tuple[bool, Optional[str]]:
        """Create the folder and try a write; returns (writable, why not or None).

        Never raises: an unusable folder makes a read-only (or empty) tier.
        """
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return False, f"cannot create {self.dir}: {exc.strerror or exc}"
        probe = self.dir / f".probe.{os.getpid()}{_TMP_SUFFIX}"
        try:
            probe.write_bytes(b"kvpage")
            probe.unlink()
        except OSError as exc:
            return False, f"{self.dir} is not writable: {exc.strerror or exc}"
        return True, None

    def scan(self, remove_leftovers: bool = True) -> list[BlockHash]:
        """Hashes of the block files present, least recently written first.

        Leftover temporary files (a write cut short) are deleted when ``remove_leftovers``.
        """
        found: list[tuple[int, BlockHash]] = []
        try:
            entries = list(os.scandir(self.dir))
        except OSError:
            return []
        for entry in entries:
            name = entry.name
            if name.endswith(_TMP_SUFFIX):
                if remove_leftovers:
                    _unlink(entry.path)
                continue
            stem = name[: -len(_SUFFIX)]
            if not name.endswith(_SUFFIX) or len(stem) != 64:
                continue
            try:
                block_hash = BlockHash(bytes.fromhex(stem))
                found.append((entry.stat().st_mtime_ns, block_hash))
            except (ValueError, OSError):
                continue
        found.sort()
        return [h for _, h in found]

    # ------------------------------------------------------------------ entries
    def write(self, block_hash: BlockHash, key: Any, value: Any) -> int:
        """Write one block atomically; returns the bytes written. Raises ``OSError``."""
        from safetensors.torch import save

        metadata = {"format": FORMAT, "fingerprint": self.fingerprint, "block_hash": block_hash.hex(),
                    "crc32_key": _crc(key), "crc32_value": _crc(value)}
        data = save({"key": key.contiguous(), "value": value.contiguous()}, metadata=metadata)
        tmp = self.dir / f".{block_hash.hex()}.{os.getpid()}.{next(self._tmp_names)}{_TMP_SUFFIX}"
        try:
            with open(tmp, "wb") as handle:
                handle.write(data)
            os.replace(tmp, self.path(block_hash))
        except BaseException:
            _unlink(tmp)
            raise
        return len(data)

    def read(self, block_hash: BlockHash) -> tuple[Any, Any, int]:
        """(key, value, bytes read) of one block. Raises ``CorruptEntry`` for a file that
        fails any check, ``OSError`` (``FileNotFoundError``) when it cannot be read."""
        data = self.path(block_hash).read_bytes()
        key, value = self._decode(data, block_hash)
        return key, value, len(data)

    def _decode(self, data: bytes, block_hash: BlockHash) -> tuple[Any, Any]:
        from safetensors.torch import load

        metadata = _metadata(data)
        expected = {"format": FORMAT, "fingerprint": self.fingerprint, "block_hash": block_hash.hex()}
        for name, want in expected.items():
            if metadata.get(name) != want:
                raise CorruptEntry(f"{name} is {metadata.get(name)!r}, expected {want!r}")
        try:
            tensors = load(data)
        except Exception as exc:  # noqa: BLE001 - the parser's own error type is not public API
            raise CorruptEntry(f"unreadable tensors: {exc}") from None
        key, value = tensors.get("key"), tensors.get("value")
        for name, tensor in (("key", key), ("value", value)):
            if tensor is None or tuple(tensor.shape) != self.block_shape or tensor.dtype != self.dtype:
                raise CorruptEntry(f"tensor {name!r} is missing or has the wrong shape or dtype")
            if _crc(tensor) != metadata.get(f"crc32_{name}"):
                raise CorruptEntry(f"checksum mismatch in {name!r}")
        return key, value

    def remove(self, block_hash: BlockHash) -> None:
        """Delete one block's file (a missing file is fine). Raises other ``OSError``s."""
        try:
            self.path(block_hash).unlink()
        except FileNotFoundError:
            pass

    def clear(self) -> None:
        """Delete every block file of this fingerprint (best effort)."""
        for block_hash in self.scan():
            _unlink(self.path(block_hash))


def _metadata(data: bytes) -> dict:
    """The ``__metadata__`` of a safetensors buffer: 8 bytes little-endian header length, JSON."""
    if len(data) < 8:
        raise CorruptEntry("shorter than a safetensors header")
    size = int.from_bytes(data[:8], "little")
    if size <= 0 or 8 + size > len(data):
        raise CorruptEntry("header length out of range")
    try:
        header = json.loads(data[8 : 8 + size])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CorruptEntry("header is not JSON") from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict):
        raise CorruptEntry("no metadata")
    return metadata


def _unlink(path: Any) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
