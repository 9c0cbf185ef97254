"""Routed-expert kernels in Triton for NVFP4 and dense (bf16/fp32) expert stacks, without expanding a stack.

Hopper has no FP4 tensor cores, so every kernel here decodes the packed weights in registers
(`dequant`), and the clamped SwiGLU, the globals, the routing weights and the sum over k are fused:
  - `moe_decode` (few tokens): two GEMV launches; each selected (token, expert) pair streams its
    expert's rows once. Memory-bound.
  - `moe_prefill` (many tokens): pairs sorted and padded per expert, then two grouped GEMMs on
    tl.dot with tiles dequantized in registers. Math- or decode-bound.
Launch shapes are compile-time constants in `DecodeTiles` / `PrefillTiles`, to tune on the GPU.

Expected on an H200 (132 SMs, 4.27 TB/s), GLM-5.3-Flash shapes (D 4096, I 2048, E 288, k 8):
  - bytes per expert: gate+up 2 x (4 MiB codes + 0.5 MiB scales) = 9.44 MB, down 4.72 MB, 14.16 MB in all.
  - batch 1: 8 experts = 113 MB per layer, 26.5 us at full bandwidth. The sm_90 build decodes a
    weight in about 5 (gate/up) to 6 (down) instructions, ~2.5 of them integer, which issue at 64
    per SM per clock: that caps the loops near 2.5-2.9 TB/s (60-70 %), so expect ~40-45 us per
    layer (gate/up about 60 % of it), ~1.7-1.9 ms for 42 layers.
  - T = 16: 128 pairs, up to 128 distinct experts (1.8 GB): ~0.6-0.7 ms per layer.
  - prefill T = 2048: 16,384 pairs reach every expert (4.08 GB, ~1 ms of reads) and 0.82 TFLOP
    (~1 ms at the bf16 peak); decoding each tile for only BLOCK_M = 64 rows likely makes it
    ~2-3 ms per layer. T = 512 (~14 pairs per expert, BLOCK_M 16) is read- and decode-bound, ~1-1.5 ms.
"""

from engine.kernels.experts.decode import DECODE_MAX_PAIRS, DecodeTiles, moe_decode
from engine.kernels.experts.prefill import PrefillTiles, align_by_expert, moe_prefill

__all__ = ["DECODE_MAX_PAIRS", "DecodeTiles", "PrefillTiles", "align_by_expert", "moe_decode", "moe_prefill"]
