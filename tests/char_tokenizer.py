"""A character tokenizer for engine-level unit tests: no model files needed."""
from __future__ import annotations

SPECIAL = {0: "<pad>", 1: "<s>", 2: "</s>"}


class CharTokenizer:
    """ids 0..2 are special; id i >= 3 is chr(62 + i): "A" is 3, "B" 4, ... "e" is 39."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 62 for c in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(("" if skip_special_tokens else SPECIAL[i]) if i in SPECIAL else chr(62 + i) for i in ids)
