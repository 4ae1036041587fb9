"""Incremental detokenization with stop strings. Torch-free; needs any HF-style tokenizer.

The detokenizer stores no tokens: each call reads the sequence's own token list (prompt +
output, owned by the scheduler's ``Request``) through two offsets into it, so every step
decodes only a short window. A trailing replacement character (an incomplete UTF-8
sequence) is held back until the next token completes it. Stop strings are searched
across token boundaries in the text produced so far; the text is cut before the stop
string.
"""
from __future__ import annotations

from typing import Optional, Sequence

#: Prompt tokens decoded with the first output tokens, so that leading spaces come out right.
PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Text of one sequence's output tokens, grown one step at a time.

    ``token_ids`` passed to ``update``/``flush`` is the whole sequence (prompt first, then
    output), and only ever grows. Index regions into it::

        [prefix_offset, read_offset)   decoded last time (context for the next decode)
        [read_offset, len(token_ids))  new since then
    """

    def __init__(self, tokenizer, num_prompt_tokens: int, stop: Sequence[str] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self._prefix_offset = max(0, num_prompt_tokens - PROMPT_CONTEXT_TOKENS)
        self._read_offset = num_prompt_tokens
        self._emitted = 0  # characters of self.text already returned as deltas
        self.stopped_by: Optional[str] = None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, token_ids: Sequence[int], force: bool = False) -> None:
        prefix_text = self._decode(token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(token_ids[self._prefix_offset :])
        # A trailing U+FFFD is an incomplete UTF-8 sequence: wait for the next token.
        if len(full_text) > len(prefix_text) and (force or not full_text.endswith("\ufffd")):
            self.text += full_text[len(prefix_text) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)

    def update(self, token_ids: Sequence[int]) -> str:
        """Take the tokens appended since the last call; return the new text that is safe
        to emit (after stop-string cuts)."""
        if self.stopped_by is not None:
            return ""
        self._advance(token_ids)
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

    def flush(self, token_ids: Sequence[int]) -> str:
        """At the end of the sequence: emit everything still held back."""
        delta = ""
        if self.stopped_by is None:
            self._advance(token_ids, force=True)
            if self.stop:
                delta = self._take_delta()  # a stop string may sit in the held-back tail
        rest, self._emitted = self.text[self._emitted :], len(self.text)
        return delta + rest
