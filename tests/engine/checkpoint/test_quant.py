"""engine.quant against an independent implementation: the compressed-tensors package.

compressed-tensors stores the NVFP4 global scale as a divisor; our functions take a multiplier, so
every comparison passes 1/global to ours. Everything runs on CPU in float32.
"""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.nvfp4.helpers import (
    pack_fp4_to_uint8,
    quantize_and_pack_fp4,
    unpack_fp4_from_uint8,
)
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from compressed_tensors.quantization.quant_scheme import FP8_BLOCK as CT_FP8_BLOCK
from compressed_tensors.quantization.quant_scheme import NVFP4 as CT_NVFP4
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

from engine.quant import (
    FP8_BLOCK,
    NVFP4_GROUP,
    dequantize_fp8_block,
    dequantize_nvfp4,
    e2m1_codes,
    pack_e2m1,
    quantize_fp8_block,
    quantize_nvfp4,
    unpack_e2m1,
)

NVFP4_ARGS: QuantizationArgs = CT_NVFP4["weights"]
FP8_BLOCK_ARGS: QuantizationArgs = CT_FP8_BLOCK["weights"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_codes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(0, 16, shape, generator=_gen(seed), dtype=torch.uint8)


def _random_fp8_scale(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Positive e4m3 scales spread over several binades, as real group scales are."""
    return torch.exp2(torch.empty(shape).uniform_(-6, 8, generator=_gen(seed))).to(torch.float8_e4m3fn)


def _ct_dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' NVFP4PackedCompressor.decompress, in float32 instead of bfloat16."""
    m, half_k = packed.shape
    unpacked = unpack_fp4_from_uint8(packed, m, half_k * 2, dtype=torch.float32)
    return dequantize(
        x_q=unpacked, scale=scale.float(), args=NVFP4_ARGS, global_scale=divisor, dtype=torch.float32
    )


def test_nibble_order_and_sign() -> None:
    byte = torch.tensor([[0x71]], dtype=torch.uint8)
    assert unpack_e2m1(byte).tolist() == [[0.5, 6.0]]
    assert pack_e2m1(torch.tensor([[1, 7]], dtype=torch.uint8)).tolist() == [[0x71]]

    # Every code in the low nibble (high nibble 0), read back in code order.
    values = unpack_e2m1(torch.arange(16, dtype=torch.uint8).unsqueeze(-1))[:, 0]
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert values[:8].tolist() == magnitudes
    assert values[8:].tolist() == [-m for m in magnitudes]
    assert torch.signbit(values[8]) and not torch.signbit(values[0])


def test_pack_unpack_match_compressed_tensors() -> None:
    codes = _random_codes((48, 96), seed=0)
    packed = pack_e2m1(codes)
    ours = unpack_e2m1(packed)
    theirs = unpack_fp4_from_uint8(packed, 48, 96, dtype=torch.float32)
    assert torch.equal(ours, theirs)
    assert torch.equal(torch.signbit(ours), torch.signbit(theirs))  # -0.0 (code 8) survives
    assert torch.equal(pack_fp4_to_uint8(ours), packed)

    # Leading (expert) dims: each slice unpacks like the 2-D case.
    stacked = pack_e2m1(_random_codes((3, 8, 32), seed=1))
    for e in range(3):
        assert torch.equal(unpack_e2m1(stacked)[e], unpack_fp4_from_uint8(stacked[e], 8, 32, dtype=torch.float32))


def test_e2m1_codes_match_cast_to_fp4() -> None:
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    nudged = torch.cat([midpoints, torch.nextafter(midpoints, midpoints + 1), torch.nextafter(midpoints, midpoints - 1)])
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 7.0, 100.0])
    random = torch.empty(4096).uniform_(-8, 8, generator=_gen(2))
    values = torch.cat([nudged, -nudged, grid, -grid, random])
    values = values[: values.numel() // 2 * 2].reshape(1, -1)

    codes = e2m1_codes(values)
    assert codes.dtype == torch.uint8 and codes.shape == values.shape
    expected = pack_fp4_to_uint8(cast_to_fp4(values.clone()))
    assert torch.equal(pack_e2m1(codes), expected)


@pytest.mark.parametrize("experts", [1, 3])
def test_dequantize_nvfp4_matches_compressed_tensors(experts: int) -> None:
    n, k = 40, 128
    packed = pack_e2m1(_random_codes((experts, n, k), seed=3))
    scale = _random_fp8_scale((experts, n, k // NVFP4_GROUP), seed=4)
    divisor = torch.empty(experts, 1).uniform_(100.0, 5000.0, generator=_gen(5))  # CT: ~2688/amax

    ours = dequantize_nvfp4(packed, scale, 1.0 / divisor)
    assert ours.shape == (experts, n, k) and ours.dtype == torch.float32
    theirs = torch.stack([_ct_dequantize_nvfp4(packed[e], scale[e], divisor[e]) for e in range(experts)])
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0.0)
    assert dequantize_nvfp4(packed, scale, 1.0 / divisor, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_dequantize_nvfp4_per_row_global() -> None:
    """gate and up quantized with different globals, stacked row-wise with one global per row."""
    n, k = 24, 64
    gate_packed, up_packed = pack_e2m1(_random_codes((n, k), seed=6)), pack_e2m1(_random_codes((n, k), seed=7))
    gate_scale, up_scale = _random_fp8_scale((n, k // 16), seed=8), _random_fp8_scale((n, k // 16), seed=9)
    gate_div, up_div = torch.tensor([300.0]), torch.tensor([4100.0])

    per_row = torch.cat([(1.0 / gate_div).expand(n), (1.0 / up_div).expand(n)])
    ours = dequantize_nvfp4(
        torch.cat([gate_packed, up_packed]), torch.cat([gate_scale, up_scale]), per_row
    )
    theirs = torch.cat(
        [_ct_dequantize_nvfp4(gate_packed, gate_scale, gate_div), _ct_dequantize_nvfp4(up_packed, up_scale, up_div)]
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0.0)


def _nvfp4_test_weight() -> torch.Tensor:
    g = _gen(10)
    w = torch.randn(64, 256, generator=g) * torch.exp2(torch.empty(64, 1).uniform_(-8, 2, generator=g))
    w[:, :16] *= 0.01  # tiny groups reach the fp8 subnormal scales
    w[3, 7] = 25.0  # an outlier sets the global
    return w


def test_quantize_nvfp4_round_trip_error_bound() -> None:
    w = _nvfp4_test_weight()
    packed, scale, global_scale = quantize_nvfp4(w)
    assert packed.shape == (64, 128) and packed.dtype == torch.uint8
    assert scale.shape == (64, 16) and scale.dtype == torch.float8_e4m3fn
    assert global_scale.shape == (1,) and global_scale.dtype == torch.float32
    torch.testing.assert_close(global_scale, w.abs().amax().reshape(1) / (448 * 6), rtol=0, atol=0)
    assert scale.float().max() == 448.0  # the outlier's group uses the top of the fp8 range

    deq = dequantize_nvfp4(packed, scale, global_scale)
    step = (scale.float() * global_scale).repeat_interleave(NVFP4_GROUP, dim=-1)
    x = (w / step).abs()
    # Half the gap between neighbouring E2M1 magnitudes around |x|, or the overshoot past 6.
    half_gap = torch.where(x < 2, 0.25, torch.where(x < 4, 0.5, 1.0))
    bound = torch.maximum(half_gap, x - 6) * step
    assert ((deq - w).abs() <= bound * (1 + 1e-5)).all()


def test_quantize_nvfp4_matches_compressed_tensors() -> None:
    w = _nvfp4_test_weight()
    packed, scale, global_scale = quantize_nvfp4(w)

    # compressed-tensors' own NVFP4 pipeline: global divisor, fp8 group scales, quantize + pack.
    divisor = generate_gparam(w.min(), w.max())
    groups = w.unflatten(-1, (-1, NVFP4_GROUP))
    ct_scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), NVFP4_ARGS, global_scale=divisor)
    ct_packed = quantize_and_pack_fp4(w, ct_scale, global_scale=divisor, group_size=NVFP4_GROUP)

    torch.testing.assert_close(global_scale, 1.0 / divisor, rtol=1e-6, atol=0.0)
    # The fp32 ratios are formed in a different order (x / global vs x * 1/global), so an exact tie
    # could in principle round apart by an ulp; on this data (and 200 random seeds tried) nothing does.
    assert torch.equal(scale.float(), ct_scale)
    assert torch.equal(packed, ct_packed)


def _ct_dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return dequantize(x_q=weight.float(), scale=scale_inv, args=FP8_BLOCK_ARGS, dtype=torch.float32)


@pytest.mark.parametrize("shape", [(300, 200), (256, 384), (2, 130, 260)])
def test_dequantize_fp8_block_matches_compressed_tensors(shape: tuple[int, ...]) -> None:
    *lead, n, k = shape
    bn, bk = FP8_BLOCK
    weight = (torch.randn(shape, generator=_gen(11)) * 100).to(torch.float8_e4m3fn)
    scale_inv = torch.exp2(torch.empty(*lead, -(-n // bn), -(-k // bk)).uniform_(-12, 4, generator=_gen(12)))

    ours = dequantize_fp8_block(weight, scale_inv)
    assert ours.shape == shape and ours.dtype == torch.float32
    theirs = (
        torch.stack([_ct_dequantize_fp8_block(weight[e], scale_inv[e]) for e in range(lead[0])])
        if lead
        else _ct_dequantize_fp8_block(weight, scale_inv)
    )
    assert torch.equal(ours, theirs)
    assert dequantize_fp8_block(weight, scale_inv, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_quantize_fp8_block_matches_compressed_tensors_and_round_trips() -> None:
    n, k = 300, 200
    bn, bk = FP8_BLOCK
    w = torch.randn(n, k, generator=_gen(13))
    w[:128, 128:] *= 1e-3  # blocks of very different magnitude
    w[256:, :] *= 50.0  # including the ragged last block row

    q, scale_inv = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (n, k)
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (3, 2)

    # Block amax written out plainly, then compressed-tensors' own qparams and quantize.
    amax = torch.tensor([[w[i : i + bn, j : j + bk].abs().max().item() for j in range(0, k, bk)] for i in range(0, n, bn)])
    ct_scale, _ = calculate_qparams(-amax, amax, FP8_BLOCK_ARGS)
    ct_q = quantize(x=w, scale=ct_scale, zero_point=None, args=FP8_BLOCK_ARGS, dtype=torch.float8_e4m3fn)
    assert torch.equal(scale_inv, ct_scale)
    assert torch.equal(q.float(), ct_q.float())

    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, plus half the smallest subnormal (2^-10 of scale).
    deq = dequantize_fp8_block(q, scale_inv)
    step = scale_inv.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    assert ((deq - w).abs() <= w.abs() * 2**-4 + step * 2**-10).all()


def test_quantize_fp8_block_zero_block() -> None:
    w = torch.zeros(200, 130)
    w[:128, :128] = torch.randn(128, 128, generator=_gen(14))
    q, scale_inv = quantize_fp8_block(w)
    assert torch.isfinite(scale_inv).all() and (scale_inv > 0).all()
    assert torch.equal(dequantize_fp8_block(q, scale_inv)[128:], torch.zeros(72, 130))
