"""Per-request state: fixed-size slots (KDA state, indexer tail) and paged DSA latents."""

from engine.cache.paged_latents import PagedLatents
from engine.cache.slots import RequestSlots

__all__ = ["PagedLatents", "RequestSlots"]
