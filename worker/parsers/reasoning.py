"""Split GLM model output into ``reasoning_content`` and ``content``.

GLM-4.5/4.6 models write ``<think>reasoning</think>content``.  The GLM-4.7/5
chat templates instead end the generation prompt with ``<|assistant|><think>``
when thinking is on, so the output starts *inside* the reasoning and only
contains ``reasoning</think>content``; with thinking off the prompt ends with
``<|assistant|></think>`` and the output is plain content.  The caller knows
which prompt it rendered and says so with ``starts_in_reasoning``.

Rules (the same as vLLM's ``glm45`` reasoning parser, which delegates to
DeepSeek-R1 style parsing when thinking is on and to a pass-through when off):

* a ``<think>`` at the very start of the output is dropped and switches to
  reasoning, whatever the mode: some outputs repeat the tag the prompt opened;
* in reasoning, everything up to the first ``</think>`` is reasoning and the
  rest is content; without a ``</think>`` (e.g. cut by ``max_tokens``) it is all
  reasoning;
* in content, tags are not looked for: the text is passed through untouched.

Both tags are non-special added tokens in GLM's tokenizer, so they reach us as
literal text and may be split across streamed deltas (``</th`` + ``ink>``);
the stream holds back only a suffix that could still become the tag.
"""

from __future__ import annotations

from typing import NamedTuple

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningDelta(NamedTuple):
    """What one :meth:`GlmReasoningParser.feed` adds; empty strings when nothing."""

    reasoning: str
    content: str


def _partial_suffix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class GlmReasoningParser:
    """One request's reasoning splitter: stream with :meth:`feed`/:meth:`finish`, or :meth:`extract`.

    An instance holds the state of one streamed output; :meth:`extract` works on
    a fresh copy, so it can be called on any instance.
    """

    def __init__(self, starts_in_reasoning: bool) -> None:
        self._starts_in_reasoning = starts_in_reasoning
        self._in_reasoning = starts_in_reasoning
        self._at_start = True  # a leading <think> is still possible
        self._buf = ""  # text not yet attributed: at most a partial tag

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """Non-streaming split of a whole output into ``(reasoning, content)``; ``None`` for empty parts."""
        stream = GlmReasoningParser(self._starts_in_reasoning)
        first, last = stream.feed(text), stream.finish()
        reasoning, content = first.reasoning + last.reasoning, first.content + last.content
        return reasoning or None, content or None

    def feed(self, delta: str) -> ReasoningDelta:
        """Attribute a streamed text delta; a possible partial tag is held until the next call."""
        self._buf += delta
        reasoning = ""
        if self._at_start:
            if self._buf.startswith(THINK_START):
                self._buf = self._buf[len(THINK_START) :]
                self._in_reasoning = True
            elif THINK_START.startswith(self._buf):
                return ReasoningDelta("", "")  # still could be "<think>"
            self._at_start = False
        if self._in_reasoning:
            end = self._buf.find(THINK_END)
            if end == -1:
                keep = _partial_suffix_len(self._buf, THINK_END)
                reasoning, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
                return ReasoningDelta(reasoning, "")
            reasoning, self._buf = self._buf[:end], self._buf[end + len(THINK_END) :]
            self._in_reasoning = False
        content, self._buf = self._buf, ""
        return ReasoningDelta(reasoning, content)

    def finish(self) -> ReasoningDelta:
        """End of output: a held partial tag was literal text after all."""
        held, self._buf = self._buf, ""
        self._at_start = False
        return ReasoningDelta(held, "") if self._in_reasoning else ReasoningDelta("", held)
