"""Incremental detokenization with stop strings. Torch-free; needs any HF-style tokenizer.

Text is produced from a sliding window of tokens so each step decodes only a few
tokens, and a trailing replacement character (an incomplete UTF-8 sequence) is held
back until the next token completes it. Stop strings are searched across token
boundaries in the text produced so far; the text is cut before the stop string.
"""
from __future__ import annotations

from typing import Optional, Sequence


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = []
        self.text = ""
        # Indices into self._ids (a few prompt tokens for spacing context + generated tokens):
        # [prefix_offset, read_offset) were decoded last time; [read_offset, end) are new.
        self._ids: list[int] = list(prompt_token_ids[-6:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._emitted = 0  # characters of self.text already returned as deltas
        self.stopped_by: Optional[str] = None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, force: bool = False) -> None:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        # A trailing U+FFFD is an incomplete UTF-8 sequence: wait for the next token.
        if len(full_text) > len(prefix_text) and (force or not full_text.endswith("\ufffd")):
            self.text += full_text[len(prefix_text) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the new text that is safe to emit (after stop-string cuts)."""
        if self.stopped_by is not None:
            return ""
        self.tokens.extend(token_ids)
        self._ids.extend(token_ids)
        self._advance()
        return self._take_delta()

    def _take_delta(self) -> str:
        if self.stop:
            search_from = max(0, self._emitted - max(len(s) for s in self.stop) + 1)
            hits = [(self.text.find(s, search_from), s) for s in self.stop]
            hits = [(pos, s) for pos, s in hits if pos >= 0]
            if hits:
                pos, stop = min(hits)
                self.text = self.text[:pos]
                self.stopped_by = stop
                delta, self._emitted = self.text[self._emitted :], len(self.text)
                return delta
            # Hold back a tail that could still become a stop string.
            hold = max(len(s) for s in self.stop) - 1
            safe = max(self._emitted, len(self.text) - hold)
        else:
            safe = len(self.text)
        delta, self._emitted = self.text[self._emitted : safe], safe
        return delta

    def flush(self) -> str:
        """At the end of the request: emit everything still held back."""
        delta = ""
        if self.stopped_by is None:
            self._advance(force=True)
            if self.stop:
                delta = self._take_delta()  # a stop string may sit in the held-back tail
        rest, self._emitted = self.text[self._emitted :], len(self.text)
        return delta + rest
