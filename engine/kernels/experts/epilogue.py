"""The clamped SwiGLU of engine.model.layers, in registers, fused into the gate/up kernels' stores."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def clamped_swiglu(gate, up, limit):
    """silu(min(gate, L)) * clamp(up, -L, L), in float32."""
    g = tl.minimum(gate, limit)
    return g * tl.sigmoid(g) * tl.minimum(tl.maximum(up, -limit), limit)
