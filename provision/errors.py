"""Provisioning failures; every message names the file or source involved."""


class ProvisionError(RuntimeError):
    """A snapshot could not be fetched, verified or read; the message names the file or source."""
