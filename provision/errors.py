"""Provisioning failures; every message names the file or source involved.

A message always names what it is about: the file (with the expected and the found size or hash)
or the source (its URI), so a failed cold start says what to fix without a traceback.
"""

from __future__ import annotations


class ProvisionError(RuntimeError):
    """A snapshot could not be listed, fetched, verified or read; the message names the file or source.

    Optional, for callers that want to act on it: `path` is the snapshot-relative file the error is
    about (None when it is about the source or the cache as a whole); `source` is the source URI.
    """

    def __init__(self, message: str, *, path: str | None = None, source: str | None = None):
        super().__init__(message)
        self.message = message
        self.path = path
        self.source = source

    def __str__(self) -> str:
        return self.message
