"""GLM reasoning split: non-streaming, and streaming over every way of cutting the text."""

from __future__ import annotations

import pytest

from worker.parsers import REASONING_PARSERS, GlmReasoningParser


def _stream(starts_in_reasoning: bool, chunks: list[str]) -> tuple[str | None, str | None]:
    parser = GlmReasoningParser(starts_in_reasoning)
    reasoning = content = ""
    for delta in [*map(parser.feed, chunks), parser.finish()]:
        reasoning += delta.reasoning
        content += delta.content
    return reasoning or None, content or None


def _splits(text: str) -> list[list[str]]:
    """Every cut into two deltas, plus one delta per character."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


CASES = [
    # (starts_in_reasoning, output, expected (reasoning, content))
    (True, "Let me think.</think>The answer is 4.", ("Let me think.", "The answer is 4.")),
    (True, "<think>Let me think.</think>The answer is 4.", ("Let me think.", "The answer is 4.")),
    (False, "<think>Let me think.</think>The answer is 4.", ("Let me think.", "The answer is 4.")),
    (False, "The answer is 4.", (None, "The answer is 4.")),
    (False, "a <think> b </think> c", (None, "a <think> b </think> c")),  # only a leading tag counts
    (True, "still thinking, cut by max_tokens", ("still thinking, cut by max_tokens", None)),
    (True, "cut inside the tag </thi", ("cut inside the tag </thi", None)),
    (True, "</think>no reasoning at all", (None, "no reasoning at all")),
    (True, "x < y and </thinking> is not </think>\n\nreply", ("x < y and </thinking> is not ", "\n\nreply")),
    (True, "one</think>two</think>three", ("one", "two</think>three")),
    (False, "<thin", (None, "<thin")),
    (True, "", (None, None)),
    (True, "思考</think>答案", ("思考", "答案")),
]


@pytest.mark.parametrize(("starts_in_reasoning", "text", "expected"), CASES)
def test_extract(starts_in_reasoning: bool, text: str, expected: tuple[str | None, str | None]) -> None:
    assert GlmReasoningParser(starts_in_reasoning).extract(text) == expected


@pytest.mark.parametrize(("starts_in_reasoning", "text", "expected"), CASES)
def test_streaming_matches_extract_for_every_split(
    starts_in_reasoning: bool, text: str, expected: tuple[str | None, str | None]
) -> None:
    for chunks in _splits(text):
        assert _stream(starts_in_reasoning, chunks) == expected, chunks


def test_end_tag_split_across_deltas_is_held_back() -> None:
    parser = GlmReasoningParser(starts_in_reasoning=True)
    assert parser.feed("thinking </th") == ("thinking ", "")  # "</th" may be the tag
    assert parser.feed("ink>answer") == ("", "answer")
    assert parser.finish() == ("", "")


def test_leading_think_split_across_deltas() -> None:
    parser = GlmReasoningParser(starts_in_reasoning=False)
    assert parser.feed("<thi") == ("", "")
    assert parser.feed("nk>why") == ("why", "")
    assert parser.feed("</think>so") == ("", "so")


def test_thinking_off_passes_content_through_immediately() -> None:
    parser = GlmReasoningParser(starts_in_reasoning=False)
    assert parser.feed("Hello") == ("", "Hello")
    assert parser.feed(" </th") == ("", " </th")


def test_extract_leaves_the_instance_usable_for_streaming() -> None:
    parser = GlmReasoningParser(starts_in_reasoning=True)
    assert parser.extract("a</think>b") == ("a", "b")
    assert parser.feed("c") == ("c", "")


def test_registry() -> None:
    assert REASONING_PARSERS["glm45"] is GlmReasoningParser
