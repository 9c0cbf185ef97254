"""Triton routed-expert kernels (run by Triton's interpreter on CPU) against the reference TorchExperts."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from engine.experts import TorchExperts, TritonExperts
from engine.kernels.experts import DecodeTiles, PrefillTiles, align_by_expert, moe_decode, moe_prefill, prefill
from engine.kernels.experts.dequant import E2M1_UNIT, e2m1_values, to_code_order
from engine.quant import quantize_fp8_block, quantize_nvfp4, unpack_e2m1
from engine.weights import DenseWeight, Fp8BlockWeight, Nvfp4Weight
from tests.engine.kernels.sm90 import assert_compiles_for_sm90

D, I, E, LIMIT = 64, 32, 6, 10.0
SHAPES = ((I, D), (I, D), (D, I))  # gate, up, down
# The interpreter's cost is per program, so most tests run one row tile per pair (gate/up) or token (down) ...
WIDE_DECODE = DecodeTiles(gate_up_n=I, down_n=D)
# ... and these run several row tiles and K steps per launch (the defaults clamp to one K step here).
SPLIT_DECODE = DecodeTiles(gate_up_n=16, gate_up_k=32, down_n=32, down_k=16)
SPLIT_PREFILL = PrefillTiles(block_m=16, block_n=16, block_k=16)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def nvfp4_stack(rows: int, cols: int, g: torch.Generator) -> Nvfp4Weight:
    """Each expert quantized on its own (one global per expert), then stacked as the loader does."""
    parts = [quantize_nvfp4(torch.randn(rows, cols, generator=g)) for _ in range(E)]
    return Nvfp4Weight(*(torch.stack(t) for t in zip(*parts)))


def all_bytes_stack(rows: int, cols: int, g: torch.Generator) -> Nvfp4Weight:
    """Every byte value, hence every code in both nibbles, in every expert; random scales, one global per row."""
    per_expert = rows * cols // 2
    assert per_expert % 256 == 0
    every = torch.arange(256, dtype=torch.uint8).repeat(per_expert // 256)
    packed = torch.stack([every[torch.randperm(per_expert, generator=g)] for _ in range(E)]).view(E, rows, cols // 2)
    scale = (torch.rand(E, rows, cols // 16, generator=g) * 3 + 0.01).to(torch.float8_e4m3fn)
    glob = torch.rand(E, rows, generator=g) * 0.2 + 0.05
    return Nvfp4Weight(packed, scale, glob)


def nvfp4_layer(seed: int = 0) -> tuple[Nvfp4Weight, Nvfp4Weight, Nvfp4Weight]:
    g = gen(seed)
    return nvfp4_stack(I, D, g), nvfp4_stack(I, D, g), nvfp4_stack(D, I, g)


def routes(tokens: int, topk: int, g: torch.Generator,
           experts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token, drawn from `experts` (all by default), and positive routing weights."""
    pool = torch.tensor(experts if experts is not None else range(E))
    ids = pool[torch.rand(tokens, len(pool), generator=g).argsort(1)[:, :topk]]
    return ids, torch.rand(tokens, topk, generator=g) + 0.1


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.dtype == want.dtype and got.shape == want.shape and not got.isnan().any()
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


# The interpreter truncates to bf16 where the GPU rounds, so bf16 gets twice the usual 1e-2.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def check(layer: tuple, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, run=None) -> torch.Tensor:
    """run(x, ids, w, gate, up, down, limit) (default: TritonExperts) against TorchExperts; returns the reference."""
    want = TorchExperts({0: layer}, LIMIT)(0, x, ids, w)
    executor = TritonExperts({0: layer}, LIMIT, decode_tiles=WIDE_DECODE)
    got = run(x, ids, w, *layer, LIMIT) if run else executor(0, x, ids, w)
    assert rel(got, want) < TOL[x.dtype]
    return want


@triton.jit
def _decode_words(words_ptr, out_ptr, ROWS: tl.constexpr, WORDS: tl.constexpr):
    rows = tl.arange(0, ROWS)[:, None]
    values = e2m1_values(tl.load(words_ptr + rows * WORDS + tl.arange(0, WORDS)[None, :]))
    tl.store(out_ptr + rows * WORDS * 8 + tl.arange(0, WORDS * 8)[None, :], values)


def test_e2m1_values_decode_every_byte_exactly_in_code_order():
    packed = torch.arange(256, dtype=torch.uint8).view(4, 64)
    out = torch.empty(4, 128)
    _decode_words[(1,)](packed.view(torch.int32), out, 4, 16)
    assert torch.equal(out * E2M1_UNIT.value, to_code_order(unpack_e2m1(packed), torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,topk", [(1, 4), (3, 3), (16, 2), (40, 4)])  # 40 x 4 pairs take the prefill path
def test_nvfp4_matches_reference(tokens, topk, dtype):
    g = gen(tokens)
    ids, w = routes(tokens, topk, g)
    check(nvfp4_layer(tokens), torch.randn(tokens, D, generator=g).to(dtype), ids, w)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [3, 40])
def test_dense_matches_reference(tokens, dtype, weight_dtype):
    g = gen(1)
    layer = tuple(DenseWeight((torch.randn(E, n, k, generator=g) / k**0.5).to(weight_dtype)) for n, k in SHAPES)
    ids, w = routes(tokens, 4, g)
    check(layer, torch.randn(tokens, D, generator=g).to(dtype), ids, w)


def wide_decode(*args) -> torch.Tensor:
    return moe_decode(*args, tiles=WIDE_DECODE)


@pytest.mark.parametrize("run", [wide_decode, moe_prefill])
def test_every_code_and_per_row_globals(run):
    g = gen(2)
    layer = (all_bytes_stack(I, D, g), all_bytes_stack(I, D, g), all_bytes_stack(D, I, g))
    ids, w = routes(5, 3, g)
    check(layer, torch.randn(5, D, generator=g), ids, w, run)


@pytest.mark.parametrize("run,tokens", [(wide_decode, 4), (moe_prefill, 20)])  # 20 pairs on one expert: 2 blocks
def test_empty_experts_and_one_expert_for_all(run, tokens):
    g = gen(3)
    layer = nvfp4_layer(3)
    x = torch.randn(tokens, D, generator=g)
    ids, w = routes(tokens, 3, g, experts=[1, 3, 4, 5])  # experts 0 and 2 get nothing
    check(layer, x, ids, w, run)
    ids[:, 1:][ids[:, 1:] == 5] = 0  # every token on expert 5, in slot 0; the other slots stay distinct
    ids[:, 0] = 5
    check(layer, x, ids, w, run)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's sigmoid(-100) is exactly 0
@pytest.mark.parametrize("run", [wide_decode, moe_prefill])
def test_gate_and_up_saturate_the_clamp(run):
    g = gen(4)
    layer = nvfp4_layer(4)
    x = 8 * torch.randn(4, D, generator=g)
    ids, w = routes(4, 4, g)
    gate = torch.einsum("td,tkid->tki", x, layer[0].dequantize(torch.float32)[ids])
    up = torch.einsum("td,tkid->tki", x, layer[1].dequantize(torch.float32)[ids])
    assert (gate > LIMIT).float().mean() > 0.2 and (up.abs() > LIMIT).float().mean() > 0.3
    check(layer, x, ids, w, run)


@pytest.mark.parametrize("run,tokens,dtype", [(lambda *a: moe_decode(*a, tiles=SPLIT_DECODE), 3, torch.float32),
                                              (lambda *a: moe_prefill(*a, tiles=SPLIT_PREFILL), 12, torch.bfloat16)],
                         ids=["decode", "prefill"])
def test_several_row_tiles_and_k_steps(run, tokens, dtype):
    g = gen(5)
    ids, w = routes(tokens, 2, g)
    check(nvfp4_layer(5), torch.randn(tokens, D, generator=g).to(dtype), ids, w, run)


@pytest.mark.parametrize("tiles", [PrefillTiles(), PrefillTiles(weights_first=False)], ids=["default", "rows-first"])
def test_long_prompts_take_128_row_blocks_in_bf16_and_match_the_reference(tiles):
    """From 128 pairs an expert on, bf16 takes 128-row blocks over 64-wide K with the weights first in the MMA
    (halving the dequantization per FLOP); fp32 keeps 32 rows; the result still matches the reference."""
    tokens, topk = 200, 4  # 800 pairs over 6 experts: 133 an expert
    assert prefill._tile(tokens * topk, E, PrefillTiles(), False) == (128, 64, 4, 3, True)
    assert prefill._tile(tokens * topk, E, PrefillTiles(), True) == (32, 32, 4, 3, False)
    assert prefill._tile(100 * topk, E, PrefillTiles(), False) == (64, 128, 4, 3, False)
    g = gen(6)
    ids, w = routes(tokens, topk, g)
    check(nvfp4_layer(6), torch.randn(tokens, D, generator=g).to(torch.bfloat16), ids, w,
          lambda *a: moe_prefill(*a, tiles=tiles))


@pytest.mark.parametrize("tiles", [PrefillTiles(weights_first=True),
                                   PrefillTiles(block_m=16, block_n=32, block_k=16, weights_first=True)],
                         ids=["default-shape", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_first_in_the_mma_matches_the_reference(tiles, dtype):
    """The accumulator transposed ([N, M]: the dequantized tile as the MMA's first operand), for NVFP4 and dense
    stacks, rows short of a block, several row blocks and K steps."""
    g = gen(7)
    ids, w = routes(40, 4, g)
    x = torch.randn(40, D, generator=g).to(dtype)
    dense = tuple(DenseWeight((torch.randn(E, n, k, generator=g) / k**0.5).to(dtype)) for n, k in SHAPES)
    for layer in (nvfp4_layer(7), dense):
        check(layer, x, ids, w, lambda *a: moe_prefill(*a, tiles=tiles))


def dead_pairs(tokens: int, topk: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Routes where expert 0 takes only pairs of weight zero (a hybrid step's misses): at the start, in the
    middle and at the end of a token's pairs, and every pair of the last token."""
    ids, w = routes(tokens, topk, g, experts=list(range(1, E)))
    ids[0, 0] = ids[1, topk // 2] = ids[2, topk - 1] = 0
    ids[tokens - 1, 0] = 0
    w[ids == 0] = 0
    w[tokens - 1] = 0
    return ids, w


def poisoned(stack: Nvfp4Weight | DenseWeight) -> Nvfp4Weight | DenseWeight:
    """A copy of the stack whose expert 0 computes NaN wherever it is read."""
    if isinstance(stack, Nvfp4Weight):
        glob = stack.global_scale.clone()
        glob[0] = float("nan")
        return Nvfp4Weight(stack.packed, stack.scale, glob)
    data = stack.data.clone()
    data[0] = float("nan")
    return DenseWeight(data)


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_pairs_of_weight_zero_read_nothing(fmt):
    """A pair of routing weight zero is skipped: its expert (NaN here) is never read, the live pairs add up as
    they would alone, and a token with no live pair gets zeros."""
    g = gen(6)
    layer = nvfp4_layer(6) if fmt == "nvfp4" else \
        tuple(DenseWeight((torch.randn(E, n, k, generator=g) / k**0.5).to(torch.bfloat16)) for n, k in SHAPES)
    x = torch.randn(4, D, generator=g)
    ids, w = dead_pairs(4, 4, g)
    want = TorchExperts({0: layer}, LIMIT)(0, x, ids, w)
    got = moe_decode(x, ids, w, *(poisoned(s) for s in layer), LIMIT, tiles=WIDE_DECODE)
    assert rel(got, want) < TOL[x.dtype]
    assert torch.equal(got[3], torch.zeros(D))


def test_the_decode_kernels_compile_for_sm90(tmp_path):
    """The GPU builds (NVFP4, dense and FP8 blocks; the live pairs' count as the NVFP4 and dense down loop's bound,
    which the interpreter cannot take)."""
    assert_compiles_for_sm90("""
from engine.kernels.experts.decode import _down_kernel, _gate_up_kernel
for fp4 in (True, False):
    weights = "*i32" if fp4 else "*bf16"
    stack = dict(gw_ptr=weights, gs_ptr="*fp8e4nv", gg_ptr="*fp32", uw_ptr=weights, us_ptr="*fp8e4nv",
                 ug_ptr="*fp32")
    compile_for_sm90(_gate_up_kernel, dict(x_ptr="*fp32", ids_ptr="*i64", route_ptr="*fp32", h_ptr="*fp32",
                                           live_ids_ptr="*i64", live_route_ptr="*fp32", live_count_ptr="*i32",
                                           **stack),
                     dict(K=4096, TOPK=8, TOPK_BLOCK=8, FP4=fp4, H_CODE_ORDER=fp4, BLOCK_N=32, BLOCK_K=512,
                          NUM_STAGES=3), 4, dict(limit="fp32"))
    compile_for_sm90(_down_kernel, dict(h_ptr="*fp32", live_ids_ptr="*i64", live_route_ptr="*fp32",
                                        live_count_ptr="*i32", out_ptr="*bf16", w_ptr=weights, s_ptr="*fp8e4nv",
                                        g_ptr="*fp32"),
                     dict(K=2048, TOPK=8, FP4=fp4, BLOCK_N=16, BLOCK_K=1024, NUM_STAGES=3, RUNTIME_BOUND=True), 4)
from engine.kernels.experts.fp8_block import _down_gemv, _gate_up_gemv
fp8 = dict(gw_ptr="*fp8e4nv", gs_ptr="*fp32", uw_ptr="*fp8e4nv", us_ptr="*fp32")
compile_for_sm90(_gate_up_gemv, dict(x_ptr="*bf16", ids_ptr="*i64", rw_ptr="*fp32", h_ptr="*fp32", **fp8),
                 dict(D=4096, TOPK=8, BN=32, BK=256), 4, dict(limit="fp32"))
compile_for_sm90(_down_gemv, dict(h_ptr="*fp32", ids_ptr="*i64", rw_ptr="*fp32", dw_ptr="*fp8e4nv", ds_ptr="*fp32",
                                  out_ptr="*bf16"), dict(I=2048, TOPK=8, BN=16, BK=512), 4)
print("compiled")
""", tmp_path)


def test_the_prefill_kernels_compile_for_sm90_in_both_launch_shapes(tmp_path):
    """NVFP4 in bf16 at the release's widths, in the launch shape of up to 64 rows and in the 128-row one, with the
    rows or the weights first in the MMA."""
    assert_compiles_for_sm90("""
from engine.kernels.experts.prefill import PrefillTiles, _down_kernel, _gate_up_kernel, _tile
stack = dict(w_ptr="*i32", s_ptr="*fp8e4nv", g_ptr="*fp32")
for pairs, weights_first in ((16384, False), (65536, False), (16384, True), (65536, True)):  # 57 and 228 an expert
    rows, block_k, warps, stages, _ = _tile(pairs, 288, PrefillTiles(), False)
    common = dict(FP4=True, BLOCK_M=rows, BLOCK_N=64, BLOCK_K=block_k, NUM_STAGES=stages, DOT_F32=False,
                  WEIGHTS_FIRST=weights_first)
    compile_for_sm90(_gate_up_kernel, dict(x_ptr="*bf16", rows_ptr="*i32", block_expert_ptr="*i32", h_ptr="*bf16",
                                           **{"g" + k[0] + "_ptr": v for k, v in stack.items()},
                                           **{"u" + k[0] + "_ptr": v for k, v in stack.items()}),
                     dict(K=4096, N_TILES=32, TOPK=8, H_CODE_ORDER=True, **common), warps, dict(limit="fp32"))
    compile_for_sm90(_down_kernel, dict(h_ptr="*bf16", rows_ptr="*i32", block_expert_ptr="*i32", route_ptr="*fp32",
                                        y_ptr="*bf16", **stack), dict(K=2048, N_TILES=64, **common), warps)
print("compiled")
""", tmp_path)


def check_alignment(ids: torch.Tensor, experts: int, block_m: int) -> list[tuple[int, list[int]]]:
    """align_by_expert's layout, checked: each pair once, in a block of its expert; blocks in expert order, each
    expert's run as short as its pairs allow; padding rows and trailing blocks marked. -> (expert, pairs) by block."""
    rows, block_expert = align_by_expert(ids, experts, block_m)
    pairs = ids.numel()
    assert len(block_expert) == -(-pairs // block_m) + min(experts, pairs)
    assert rows.shape == (block_m * len(block_expert),)
    live = [(int(b), [int(p) for p in blk if p < pairs]) for b, blk in zip(block_expert, rows.view(-1, block_m))]
    assert sorted(p for _, ps in live for p in ps) == list(range(pairs))  # each pair exactly once
    for expert, ps in live:
        assert all(ids.flatten()[p] == expert for p in ps)
    counts = torch.bincount(ids.flatten(), minlength=experts).tolist()
    want = [e for e in range(experts) for _ in range(-(-counts[e] // block_m))]
    assert [e for e, _ in live] == want + [experts] * (len(live) - len(want))
    for (e, ps), (after, _) in zip(live, live[1:]):
        assert len(ps) == block_m or after != e or e == experts  # an expert's blocks are full but its last
    return live


def test_align_by_expert_groups_pairs_in_padded_blocks():
    ids = torch.tensor([[4, 1], [4, 2], [1, 4], [4, 0], [4, 1]])
    live = check_alignment(ids, 8, 4)
    assert [e for e, _ in live] == [0, 1, 2, 4, 4] + [8] * 6  # sorted by expert; 5 pairs on expert 4 take 2 blocks


def test_align_by_expert_at_the_release_width():
    """288 experts (a padded count of 512 in the kernel), more pairs and blocks than one pass of its loops."""
    g = gen(11)
    ids = torch.multinomial(torch.rand(288, generator=g) ** 4, 300 * 8, replacement=True, generator=g).view(300, 8)
    check_alignment(ids, 288, 16)


def test_other_formats_go_to_their_kernel_or_the_reference():
    g = gen(6)
    layer = tuple(Fp8BlockWeight(*quantize_fp8_block(torch.randn(E, n, k, generator=g))) for n, k in SHAPES)
    x, (ids, w) = torch.randn(3, D, generator=g), routes(3, 2, g)
    want = TorchExperts({0: layer}, LIMIT)(0, x, ids, w)
    assert torch.equal(TritonExperts({0: layer}, LIMIT, delegates={})(0, x, ids, w), want)
    calls = []

    def fake(*args):
        calls.append(args)
        return want

    assert TritonExperts({0: layer}, LIMIT, delegates={Fp8BlockWeight: fake})(0, x, ids, w) is want
    assert calls[0][3:] == (*layer, LIMIT)


def test_prefill_sized_batches_of_delegated_formats_take_the_reference():
    g = gen(7)
    layer = tuple(Fp8BlockWeight(*quantize_fp8_block(torch.randn(E, n, k, generator=g))) for n, k in SHAPES)
    x, (ids, w) = torch.randn(70, D, generator=g), routes(70, 2, g)  # 140 pairs: past the decode size

    def fake(*args):
        raise AssertionError("the FP8 grouped prefill is not used until it passes on the GPU")

    want = TorchExperts({0: layer}, LIMIT)(0, x, ids, w)
    assert torch.equal(TritonExperts({0: layer}, LIMIT, delegates={Fp8BlockWeight: fake})(0, x, ids, w), want)
