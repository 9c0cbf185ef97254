"""Small building blocks shared by every block: dispatched linear, RMSNorm, clamped SwiGLU."""

from __future__ import annotations

import torch

from engine.kernels import kernel
from engine.weights import Weight, row_slice, stack_rows


def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    return kernel("linear", x.device.type)(x, weight)


class FusedLinear:
    """Linears that read the same input, run as one matmul over their weights stacked along N.

    At decode every linear is a GEMV bound by launch latency and by how well a small weight fills the
    GPU; one wide weight pays each once. Each part's entry in `w` is rebound to a view of the stack, so
    the originals are freed as the loader's dict lets go of them and memory is not doubled. Parts whose
    formats cannot stack (see `stack_rows`) run one by one. `groups` name the outputs: a group of
    several parts (q, k, v) comes back as one tensor of their outputs side by side.
    """

    def __init__(self, w: dict, *groups: str | tuple[str, ...]) -> None:
        named = [(g,) if isinstance(g, str) else tuple(g) for g in groups]
        names = [n for g in named for n in g]
        self.sizes = [sum(w[n].shape[-2] for n in g) for g in named]
        self.stacked = stack_rows([w[n] for n in names])
        self.parts = [[w[n] for n in g] for g in named] if self.stacked is None else []
        if self.stacked is not None:
            start = 0
            for name in names:
                size = w[name].shape[-2]
                w[name] = row_slice(self.stacked, start, start + size)
                start += size

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """One output per group, in order (views of one buffer when stacked)."""
        if self.stacked is None:
            return [torch.cat([linear(x, p) for p in g], dim=-1) if len(g) > 1 else linear(x, g[0])
                    for g in self.parts]
        return list(linear(x, self.stacked).split(self.sizes, dim=-1))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return kernel("rms_norm", x.device.type)(x, weight, eps)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, L)) * clamp(up, -L, L): the clamped gate feeds both factors of silu."""
    return kernel("clamped_swiglu", gate.device.type)(gate, up, limit)
