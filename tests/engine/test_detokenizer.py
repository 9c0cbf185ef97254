"""Tests for engine/detokenizer.py (streaming detokenization, stop strings).

The tiny byte-level tokenizer is the worst case for incremental decoding: every
UTF-8 byte is its own token, so each multi-byte character is split.  The
oracle is ``tokenizers.Tokenizer.decode`` on the whole sequence.
"""

from __future__ import annotations

import random

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.tiny.tokenizer import ADDED_TOKENS, TOKEN_IDS, build_tokenizer

REPL = "\ufffd"
EOS = TOKEN_IDS["<|endoftext|>"]
USER = TOKEN_IDS["<|user|>"]
THINK = TOKEN_IDS["<think>"]
END_THINK = TOKEN_IDS["</think>"]
TOOL_CALL = TOKEN_IDS["<tool_call>"]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def ids_of(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Pushes ids one by one; returns the deltas (flush result last)."""
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    return deltas


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call gets."""

    def __init__(self, tok):
        self._tok = tok
        self.max_ids = 0

    def decode(self, ids, skip_special_tokens=True):
        self.max_ids = max(self.max_ids, len(ids))
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):
        return getattr(self._tok, name)


# ------------------------------------------------------------------ plain text


def test_ascii_streams_one_char_per_token(tok):
    text = "Hello, world! 123"
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in ids_of(text)]
    assert deltas == list(text)
    assert detok.flush() == ""
    assert detok.text == text
    assert not detok.stopped


@pytest.mark.parametrize("char", ["é", "中", "😀"])
def test_multibyte_char_emitted_only_when_complete(tok, char):
    raw = ids_of(char)
    assert len(raw) in (2, 3, 4)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in raw]
    assert deltas[:-1] == [""] * (len(raw) - 1)
    assert deltas[-1] == char
    assert detok.flush() == ""
    assert detok.text == char


def test_mixed_text_never_emits_replacement_char(tok):
    text = "a é 中文 😀! ß🚀x"
    detok = IncrementalDetokenizer(tok)
    deltas = stream(detok, ids_of(text))
    assert all(REPL not in d for d in deltas)
    assert "".join(deltas) == detok.text == text == tok.decode(ids_of(text))


def test_prompt_context_does_not_leak_into_output(tok):
    prompt = [TOKEN_IDS["[gMASK]"], TOKEN_IDS["<sop>"], USER, *ids_of("hi 中"), TOKEN_IDS["<|assistant|>"], THINK]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt, skip_special_tokens=skip)
        ids = ids_of("ok 😀") + [END_THINK]
        assert "".join(stream(detok, ids)) == tok.decode(ids, skip_special_tokens=skip)


def test_prompt_ending_mid_character_is_not_used_as_context(tok):
    prompt = ids_of("ab") + ids_of("中")[:2]
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    ids = ids_of("中")[2:] + ids_of("cd")
    assert "".join(stream(detok, ids)) == tok.decode(ids) == REPL + "cd"


def test_flush_decodes_incomplete_tail_with_replacement(tok):
    ids = ids_of("ok") + ids_of("中")[:2]
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in ids]
    assert deltas == ["o", "k", "", ""]
    tail = detok.flush()
    assert REPL in tail
    assert detok.text == tok.decode(ids) == "ok" + REPL
    assert detok.flush() == ""  # idempotent
    with pytest.raises(RuntimeError):
        detok.push(ord("x"))


# -------------------------------------------------------------- special tokens


def test_skip_special_tokens_true_drops_special_tokens(tok):
    ids = [TOKEN_IDS["<|assistant|>"], *ids_of("Hi"), EOS, USER]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    deltas = stream(detok, ids)
    assert deltas == ["", "H", "i", "", "", ""]
    assert detok.text == "Hi" == tok.decode(ids, skip_special_tokens=True)


def test_skip_special_tokens_false_keeps_special_tokens(tok):
    ids = [TOKEN_IDS["<|assistant|>"], *ids_of("Hi"), EOS, USER]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    deltas = stream(detok, ids)
    assert deltas == ["<|assistant|>", "H", "i", "<|endoftext|>", "<|user|>", ""]
    assert detok.text == tok.decode(ids, skip_special_tokens=False)


def test_non_special_added_tokens_kept_when_skipping(tok):
    ids = [THINK, *ids_of("plan é"), END_THINK, *ids_of("ok"), TOOL_CALL, *ids_of("f"), EOS]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    deltas = stream(detok, ids)
    assert deltas[0] == "<think>"
    assert detok.text == "<think>plan é</think>ok<tool_call>f"
    assert detok.text == tok.decode(ids, skip_special_tokens=True)


def test_special_token_between_bytes_of_a_character(tok):
    # Matches tokenizers: a skipped special token does not split the byte run,
    # a kept one does (the bytes around it decode to replacement chars).
    e4, b8, ad = ids_of("中")
    for skip in (True, False):
        ids = [e4, EOS, b8, ad, ord("x")]
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        assert "".join(stream(detok, ids)) == tok.decode(ids, skip_special_tokens=skip)


# ---------------------------------------------------------------- stop strings


def test_stop_string_inside_one_token(tok):
    # "</think>" is a single token; the stop string is in the middle of its text.
    ids = [*ids_of("ab"), END_THINK, *ids_of("cd")]
    detok = IncrementalDetokenizer(tok, stop=["thin"])
    deltas = [detok.push(i) for i in ids]
    assert deltas == ["a", "b", "</", "", ""]
    assert detok.stopped
    assert detok.stop_str == "thin"
    assert detok.text == "ab</"
    assert detok.flush() == ""
    assert detok.text == "ab</"


def test_stop_string_is_whole_added_token(tok):
    ids = [THINK, *ids_of("reason"), END_THINK, *ids_of("answer")]
    detok = IncrementalDetokenizer(tok, stop=["</think>"])
    for i in ids:
        detok.push(i)
        if detok.stopped:
            break
    assert detok.text == "<think>reason"


def test_stop_string_spanning_several_tokens(tok):
    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    deltas = [detok.push(i) for i in ids_of("Hello STOP world")]
    assert deltas[:6] == list("Hello ")
    assert deltas[6:] == [""] * 10  # "STO" held, "P" stops, later pushes ignored
    assert detok.stopped
    assert detok.text == "Hello "
    assert detok.flush() == ""


def test_multibyte_stop_string_spanning_tokens(tok):
    detok = IncrementalDetokenizer(tok, stop=["文😀"])
    deltas = stream(detok, ids_of("中文😀x"))
    assert all(REPL not in d for d in deltas)
    assert detok.stopped
    assert detok.text == "中"


def test_partial_stop_match_then_divergence_releases_held_text(tok):
    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    deltas = [detok.push(i) for i in ids_of("STOMP!")]
    assert deltas == ["", "", "", "STOM", "P", "!"]
    assert not detok.stopped
    assert detok.flush() == ""
    assert detok.text == "STOMP!"


def test_overlapping_partial_stop_match(tok):
    detok = IncrementalDetokenizer(tok, stop=["aab"])
    deltas = [detok.push(i) for i in ids_of("aaab")]
    assert deltas == ["", "", "a", ""]
    assert detok.stopped
    assert detok.text == "a"


def test_multiple_stop_strings_first_to_occur_wins(tok):
    detok = IncrementalDetokenizer(tok, stop=["world", "o w"])
    stream(detok, ids_of("hello world"))
    assert detok.stopped and detok.stop_str == "o w"
    assert detok.text == "hell"


def test_multiple_stop_strings_completing_together_earliest_start_wins(tok):
    # Both complete with the last byte of 文; "中文" starts first.
    detok = IncrementalDetokenizer(tok, stop=["文", "中文"])
    stream(detok, ids_of("x中文y"))
    assert detok.stop_str == "中文"
    assert detok.text == "x"
    # Both complete inside one added token; list order does not matter.
    detok = IncrementalDetokenizer(tok, stop=["ink>", "<th"])
    stream(detok, [*ids_of("ab"), THINK])
    assert detok.stop_str == "<th"
    assert detok.text == "ab"


def test_flush_releases_text_held_for_a_possible_stop(tok):
    detok = IncrementalDetokenizer(tok, stop=["STOP", "xyz"])
    deltas = [detok.push(i) for i in ids_of("abST")]
    assert deltas == ["a", "b", "", ""]
    assert detok.text == "ab"
    assert detok.flush() == "ST"
    assert not detok.stopped
    assert detok.text == "abST"


def test_stop_found_at_flush(tok):
    # The stop string only becomes visible once the incomplete tail is decoded.
    ids = ids_of("ab") + ids_of("中")[:1]
    detok = IncrementalDetokenizer(tok, stop=["b" + REPL])
    assert "".join(stream(detok, ids)) == "a"
    assert detok.stopped


def test_empty_and_duplicate_stop_strings_ignored(tok):
    detok = IncrementalDetokenizer(tok, stop=["", "zz", "zz"])
    assert "".join(stream(detok, ids_of("abc"))) == "abc"
    assert not detok.stopped


# ------------------------------------------------------------- property tests

ALPHABET = ["a", "b", " ", "é", "ß", "中", "文", "😀", "🚀", "\n"]
PIECE_TOKENS = [THINK, END_THINK, TOOL_CALL, EOS, USER]


def random_pieces(rng: random.Random, n: int) -> list[tuple[list[int], str]]:
    """(token ids, text) per piece: characters as UTF-8 bytes, or added tokens."""
    pieces = []
    for _ in range(n):
        if rng.random() < 0.1:
            tid = rng.choice(PIECE_TOKENS)
            pieces.append(([tid], ADDED_TOKENS[tid - 256][0]))
        else:
            ch = rng.choice(ALPHABET)
            pieces.append((ids_of(ch), ch))
    return pieces


@pytest.mark.parametrize("skip", [True, False])
def test_random_valid_utf8_matches_decode(tok, skip):
    rng = random.Random(1234 + skip)
    for _ in range(200):
        ids = [i for piece_ids, _ in random_pieces(rng, rng.randint(0, 40)) for i in piece_ids]
        counting = CountingTokenizer(tok)
        detok = IncrementalDetokenizer(counting, skip_special_tokens=skip)
        deltas = stream(detok, ids)
        assert all(REPL not in d for d in deltas)
        assert "".join(deltas) == detok.text == tok.decode(ids, skip_special_tokens=skip)
        assert counting.max_ids <= 8  # a small window, independent of the length


def reference_with_stops(pieces, stops, skip) -> tuple[str, bool]:
    """Text visible after each piece; cut at the earliest stop once one completes."""
    text = ""
    for _, piece_text in pieces:
        special = piece_text in {c for c, s in ADDED_TOKENS if s}
        if not (skip and special):
            text += piece_text
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[: min(hits)], True
    return text, False


@pytest.mark.parametrize("skip", [True, False])
def test_random_text_with_stop_strings(tok, skip):
    rng = random.Random(99 + skip)
    stopped_count = 0
    for _ in range(300):
        pieces = random_pieces(rng, rng.randint(0, 30))
        pool = ["ab", "a a", "中文", "é😀", "<think>", "k>a", "</", "文\n", "bb", "🚀ß", "<|user|>"]
        stops = rng.sample(pool, rng.randint(1, 3))
        ids = [i for piece_ids, _ in pieces for i in piece_ids]
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip, stop=stops)
        deltas = []
        for i in ids:
            deltas.append(detok.push(i))
            if detok.stopped:
                break
        deltas.append(detok.flush())
        expected, expect_stop = reference_with_stops(pieces, stops, skip)
        assert all(REPL not in d for d in deltas)
        assert "".join(deltas) == detok.text == expected, (stops, pieces)
        assert detok.stopped == expect_stop
        stopped_count += expect_stop
    assert 50 < stopped_count < 250  # both outcomes are exercised


def test_many_skipped_special_tokens_inside_a_character(tok):
    e4, b8, ad = ids_of("中")
    ids = [e4, *[EOS] * 100, b8, *[USER] * 100, ad]
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, skip_special_tokens=True)
    assert "".join(stream(detok, ids)) == tok.decode(ids) == "中"
    assert counting.max_ids <= 4


def test_random_bytes_including_invalid_utf8_match_decode(tok):
    # A random-weight model emits arbitrary bytes: the output must still equal
    # tokenizer.decode, and the decode window must stay bounded.
    rng = random.Random(7)
    for trial in range(300):
        n = rng.randint(0, 120)
        if trial % 3 == 0:  # long runs of high bytes (mostly invalid sequences)
            ids = [rng.randint(0x80, 0xFF) for _ in range(n)]
        else:
            ids = [rng.choice([rng.randint(0, 255), rng.choice(PIECE_TOKENS)]) for _ in range(n)]
        for skip in (True, False):
            counting = CountingTokenizer(tok)
            detok = IncrementalDetokenizer(counting, skip_special_tokens=skip)
            deltas = stream(detok, ids)
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), ids
            assert counting.max_ids <= 16


@pytest.mark.parametrize("text, stop", [("aé日b🎉c", []), ("axyzb", ["xyw"]), ("ab<think>c", [])])
def test_decoded_chars_is_where_each_token_starts(tok, text, stop):
    """Before each push: the character offset of that token's text (a byte inside a multi-byte
    character counts where the character starts), also while text is held back for stop strings."""
    ids = tok.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok, stop=stop, skip_special_tokens=False)
    offsets = []
    for token in ids:
        offsets.append(detok.decoded_chars)
        detok.push(token)
    expected, decoded = [], ""
    for token in ids:  # the oracle: characters of the complete characters decoded before the token
        expected.append(len(decoded))
        decoded = tok.decode(ids[:len(expected)], skip_special_tokens=False).rstrip("\ufffd")
    assert offsets == expected
    assert detok.decoded_chars == len(text)
