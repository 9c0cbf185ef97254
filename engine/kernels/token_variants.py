"""Which kernel builds a step's token count picks, so the start can build them all before any request.

A Triton launcher whose compile-time parameters depend on the step's token count (a tile height, a K
split) registers a function of that count naming the build it picks, over the shapes it has been called
with so far. After one long prefill has run every launcher once, `covering_lengths` gives one token
count per distinct combination of builds: prefilling each of them once (engine/warm_up.py)
leaves no compile to requests, whatever their lengths and however a step batches them.
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterable

_VARIANTS: list[Callable[[int], Hashable]] = []


def token_variants(pick: Callable[[int], Hashable]) -> Callable[[int], Hashable]:
    """Register `pick(tokens)` -> the builds a step of that many tokens takes (decorator)."""
    _VARIANTS.append(pick)
    return pick


def variant_key(tokens: int) -> tuple[Hashable, ...]:
    """The builds a step of `tokens` tokens takes, over every registered launcher."""
    return tuple(pick(tokens) for pick in _VARIANTS)


def covering_lengths(longest: int, done: Iterable[int] = ()) -> list[int]:
    """Token counts up to `longest`, one per combination of builds no count in `done` took (the longest count
    of each), longest first."""
    by_key = {variant_key(tokens): tokens for tokens in range(1, longest + 1)}
    taken = {variant_key(tokens) for tokens in done}
    return sorted((tokens for key, tokens in by_key.items() if key not in taken), reverse=True)
