"""Incremental (streaming) detokenization with stop strings.

Tokens arrive one at a time from the engine; :class:`IncrementalDetokenizer`
turns them into text deltas for streaming responses.  Guarantees:

* No delta ever contains a partially decoded character.  Byte-level BPE (GLM's
  tokenizer and the tiny tokenizer alike) splits multi-byte UTF-8 characters
  over several tokens; text whose decoding still ends in U+FFFD is held back
  until the character is complete.
* ``skip_special_tokens`` is passed straight to ``tokenizers.Tokenizer.decode``:
  special added tokens are dropped, non-special added tokens (``<think>``,
  ``<tool_call>``, ...) stay in the text for the reasoning/tool parsers.
* ``stop`` strings follow OpenAI semantics: output ends right before the first
  stop string, which is not included; text that could still turn into a stop
  string is held back until it either completes one or diverges from all.
* The concatenation of all deltas (``push`` results and ``flush``) equals
  ``tokenizer.decode(generated_ids, skip_special_tokens=...)`` cut at the stop
  string.

How the text is produced (the prefix/read-offset scheme known from vLLM and
text-generation-inference, reimplemented here): we keep a short window of
token ids.  ``_prefix`` is where the window starts, ``_read`` where the text
already handed out ends; ``_prefix_text`` is the decoding of
``ids[_prefix:_read]``.  For each new token we decode ``ids[_prefix:]``; if it
does not end in U+FFFD, everything after ``_prefix_text`` is new text and the
window slides (``_prefix <- _read``, ``_read <- end``).  Decoding a window that
starts one step back (instead of at ``_read``) gives decoders that treat the
first token of a sequence specially the context they need.  Each step decodes
only a few tokens, so the cost per token does not grow with the output.

A trailing U+FFFD is normally an incomplete character and resolves within at
most three more bytes.  A random-weight model can, however, emit genuinely
invalid bytes for a long stretch; waiting for a clean end would then let the
window grow without bound.  Once more than ``_MAX_HELD_TOKENS`` tokens are held
we therefore look for a split point whose text is final: the window text must
decode identically as two halves, and the head must end either in a complete
character or be followed by at least three text-carrying tokens (a UTF-8
sequence is at most four bytes, so later bytes can no longer change it).  This
keeps the output identical to ``tokenizer.decode`` for byte-level tokenizers.
``_MAX_WINDOW_TOKENS`` is a last-resort cap for decoders where no split
verifies.  Special tokens that ``skip_special_tokens`` drops never enter the
window (decode removes them before decoding, so this changes nothing).

Stop strings are matched on the decoded text: ``_held`` keeps the (at most
``len(longest stop) - 1`` characters long) tail that is a prefix of some stop
string; each push searches only ``_held`` plus the new text.  When several
stop strings complete in the same push, the one starting earliest wins.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded ahead of the first generated token (context for the decoder).
_PROMPT_CONTEXT_TOKENS = 5
# Tokens that may sit behind a trailing U+FFFD before we look for a final split.
_MAX_HELD_TOKENS = 4
# Held tokens after which the window text is emitted as it is (last resort).
_MAX_WINDOW_TOKENS = 64
# A UTF-8 character is at most 4 bytes, so 3 following bytes settle any head.
_SETTLING_TOKENS = 3


class IncrementalDetokenizer:
    """Streams the text of one request's generated tokens.

    ``push`` each sampled token id and send the returned delta; when ``stopped``
    becomes true, end the request with ``finish_reason="stop"``.  At the end of
    generation (EOS, length, abort) call ``flush`` and send its result too.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Empty stop strings would match everywhere; OpenAI-compatible servers ignore them.
        self._stop: tuple[str, ...] = tuple(dict.fromkeys(s for s in (stop or ()) if s))
        # With skip_special_tokens, decode() drops special tokens before decoding,
        # so they never need to enter the window (an EOS costs no decode at all).
        self._skipped_ids: frozenset[int] = (
            frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
            if skip_special_tokens
            else frozenset()
        )

        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._prefix_text = ""
        if prompt_token_ids:
            context = [int(t) for t in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]]
            context_text = self._decode(context)
            # A prompt ending mid-character would make the generated bytes complete
            # it; decode(generated) treats them on their own, so go without context.
            if not context_text.endswith(_REPLACEMENT):
                self._ids = context
                self._read = len(context)
                self._prefix_text = context_text

        self._held = ""  # decoded text withheld because it may begin a stop string
        self._decoded_chars = 0  # characters decoded so far, held ones included
        self._chunks: list[str] = []
        self._text_cache: str | None = ""
        self._stop_str: str | None = None
        self._flushed = False

    # ------------------------------------------------------------------ API

    def push(self, token_id: int) -> str:
        """Adds one generated token; returns the text that is safe to emit now."""
        if self._stop_str is not None:
            return ""  # already stopped; tokens generated in the same step are ignored
        if self._flushed:
            raise RuntimeError("push() after flush()")
        token_id = int(token_id)
        if token_id in self._skipped_ids:
            return ""
        self._ids.append(token_id)
        new_text = self._decode_new_text()
        self._decoded_chars += len(new_text)
        if not new_text:
            return ""
        return self._release(new_text, final=False)

    @property
    def stopped(self) -> bool:
        """True once a stop string was hit (the caller finishes with reason "stop")."""
        return self._stop_str is not None

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the output, if any."""
        return self._stop_str

    def flush(self) -> str:
        """Releases all held text at the end of generation.

        An incomplete UTF-8 sequence at the very end is decoded with replacement
        characters, as ``tokenizer.decode`` does.  Calling it again returns "".
        """
        if self._flushed or self._stop_str is not None:
            self._flushed = True
            return ""
        self._flushed = True
        rest = self._decode(self._ids[self._prefix :])[len(self._prefix_text) :]
        self._commit(len(self._ids))
        return self._release(rest, final=True)

    @property
    def decoded_chars(self) -> int:
        """Characters of output decoded so far, including text held back for stop strings but not an
        incomplete character: the offset in the output text where the next token's text starts."""
        return self._decoded_chars

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
        return self._text_cache

    # ------------------------------------------------------------- decoding

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=self._skip_special_tokens)

    def _commit(self, end: int) -> None:
        """Marks ids[:end] as handed out and slides the window."""
        self._prefix, self._read = self._read, end
        if self._prefix:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        self._prefix_text = self._decode(self._ids[: self._read])

    def _decode_new_text(self) -> str:
        ids = self._ids
        window_text = self._decode(ids[self._prefix :])
        if not window_text.endswith(_REPLACEMENT):
            new_text = window_text[len(self._prefix_text) :]
            self._commit(len(ids))
            return new_text
        if len(ids) - self._read <= _MAX_HELD_TOKENS:
            return ""  # most likely a character still being completed
        return self._release_final_part(window_text)

    def _release_final_part(self, window_text: str) -> str:
        """Many tokens held behind a trailing U+FFFD: emit the part that is final."""
        ids = self._ids
        end = len(ids)
        text_tokens_after = 0
        for split in range(end - 1, self._read, -1):
            if self._decode(ids[split : split + 1]):
                text_tokens_after += 1
            head = self._decode(ids[self._prefix : split])
            if head + self._decode(ids[split:end]) != window_text:
                continue  # the split cuts through a character (or invalid sequence)
            if not head.endswith(_REPLACEMENT) or text_tokens_after >= _SETTLING_TOKENS:
                new_text = head[len(self._prefix_text) :]
                self._commit(split)
                return new_text
        if end - self._read > _MAX_WINDOW_TOKENS:
            new_text = window_text[len(self._prefix_text) :]
            self._commit(end)
            return new_text
        return ""

    # ---------------------------------------------------------- stop strings

    def _release(self, new_text: str, final: bool) -> str:
        text = self._held + new_text
        self._held = ""
        if self._stop:
            hit = self._find_stop(text)
            if hit is not None:
                start, self._stop_str = hit
                text = text[:start]
            elif not final:
                keep = self._partial_stop_len(text)
                if keep:
                    text, self._held = text[:-keep], text[-keep:]
        if text:
            self._chunks.append(text)
            self._text_cache = None
        return text

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = text.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
