"""mHC (manifold-constrained hyper-connections): stream mixing weights, collapse and combine."""

from __future__ import annotations

from typing import NamedTuple

import torch


class MhcPartials(NamedTuple):
    """A site's reduction over its streams, per D chunk, as a kernel path hands it from a combine to the next
    site's mix: x @ fn^T [chunks, T, NP] and the upper triangle of the streams' Gram matrix [chunks, T, GP]
    (entry a * S + b, a <= b)."""
    dots: torch.Tensor
    gram: torch.Tensor
