"""How close the compiled CPU expert kernels come to the float64 and torch references, by code path."""

from __future__ import annotations

import torch

from engine.kernels.experts import cpu_gemv


def assert_expert_close(got: torch.Tensor, want: torch.Tensor, fmt: str) -> None:
    """A whole expert pass against the reference: within 1e-5, or where NVFP4 runs with x in 16-bit integers
    (AVX2, AVX-512 VNNI) within 1e-4 of the output's scale (its largest |value|): both projections' inputs are
    rounded to 1/65278 of each 16 columns' largest value, measured ~4e-5 of the scale after the two; a wrong
    scale, group or row is off by O(1) of it."""
    if fmt.startswith("nvfp4") and cpu_gemv.available() and cpu_gemv.simd_path() in cpu_gemv.X16_PATHS:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
