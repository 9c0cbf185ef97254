"""Compare per-layer activations against a reference run and name the first layer that diverges.

Used by the parity tests and when bringing up a real checkpoint: `LLM.layer_outputs(ids)` gives
our mHC streams after each layer; the reference gives its own (transformers: `hidden_states[1:]`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerDiff:
    layer: int
    max_abs: float
    rel: float  # max |ours - ref| / max |ref|
    cosine: float

    def __str__(self) -> str:
        return f"layer={self.layer} max_abs={self.max_abs:.3e} rel={self.rel:.3e} cosine={self.cosine:.6f}"


def diff(ours: torch.Tensor, ref: torch.Tensor, layer: int = -1) -> LayerDiff:
    a, b = ours.double().flatten(), ref.double().flatten()
    if a.shape != b.shape:
        raise ValueError(f"layer {layer}: shapes differ, ours {tuple(ours.shape)} vs reference {tuple(ref.shape)}")
    max_abs = float((a - b).abs().max())
    return LayerDiff(layer, max_abs, max_abs / max(float(b.abs().max()), 1e-30),
                     float(torch.nn.functional.cosine_similarity(a, b, dim=0)))


def compare_layers(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> list[LayerDiff]:
    if len(ours) != len(ref):
        raise ValueError(f"{len(ours)} layer outputs vs {len(ref)} in the reference")
    return [diff(a, b.reshape(a.shape), i) for i, (a, b) in enumerate(zip(ours, ref))]


def first_divergent_layer(ours: list[torch.Tensor], ref: list[torch.Tensor], rel_tol: float = 1e-3,
                          min_cosine: float = 0.9999) -> LayerDiff | None:
    """The earliest layer whose output is off by more than the tolerances, or None if all agree."""
    for d in compare_layers(ours, ref):
        if d.rel > rel_tol or d.cosine < min_cosine:
            return d
    return None
