"""Grammar specs -> llguidance matchers over the model's vocabulary.

llguidance (the grammar engine behind vLLM's and SGLang's `guidance` backends and llama.cpp's) builds
token masks lazily from the tokenizer's byte trie: no per-grammar precompilation, a mask in tens of
microseconds, and the broadest JSON Schema coverage of the libraries measured by JSONSchemaBench.
It is one abi3 wheel with no Python dependencies (README, "Structured output", says why it was
picked over xgrammar).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

import llguidance
from tokenizers import Tokenizer

from engine.structured.spec import JSON_FORMAT, GrammarSpec

_MAX_ERROR_CHARS = 600  # a compile error is quoted back to the client; llguidance may append its state


class GrammarError(ValueError):
    """The grammar library cannot compile this spec; the message says why."""


class GrammarCompiler:
    """Compiles specs for one tokenizer; the vocabulary trie is built on first use (about a second for a
    150k vocabulary) and shared by every matcher."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, list(eos_token_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        # Agents resend the same schemas and tools every turn: compile each once, copy per request.
        self._compiled = functools.lru_cache(maxsize=128)(self._compile)

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer.to_str(), n_vocab=self.vocab_size,
                                                            eos_token=self._eos)
            return self._ll_tokenizer

    def matcher(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `spec`'s language; GrammarError if it does not compile."""
        return self._compiled(spec).deep_copy()

    def _compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.ll_tokenizer, _grammar(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(_short(matcher.get_error()))
        return matcher


def _grammar(spec: GrammarSpec) -> str:
    try:
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.source, overrides=JSON_FORMAT)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.source)
        if spec.kind == "choice":
            return llguidance.grammar_from("choice", spec.source)
        if spec.kind == "grammar":  # Lark, or GBNF converted to Lark
            return llguidance.grammar_from("grammar", spec.source)
    except ValueError as exc:
        raise GrammarError(_short(str(exc))) from None
    raise GrammarError(f"unknown grammar kind {spec.kind!r}")


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= _MAX_ERROR_CHARS else message[:_MAX_ERROR_CHARS - 3] + "..."
