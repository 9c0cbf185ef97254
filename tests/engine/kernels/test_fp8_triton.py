"""FP8 block Triton kernels (routed experts, linear) against the torch references, in Triton's interpreter.

Error bounds, each with the error it admits:
  - fp32 activations: the kernels multiply the same e4m3 values in fp32 (3xTF32 on a GPU, ~2^-22),
    so mostly the summation order differs from the reference: ~1e-7 relative, bound 1e-5.
  - bf16 activations, decode (W8A16): computed in fp32 and rounded once to bf16 (the interpreter
    truncates: <= 2^-8 relative); the fp32 reference has no rounding at all: bound 1e-2.
  - bf16 activations, prefill (W8A8): against the same reference with the activations fake-quantized
    per token per 128 columns (the scheme itself), only bf16 output rounding and rare ties of an
    fp8 rounding remain: bound 1e-2. Against the exact reference the scheme's own error shows:
    e4m3 keeps 3 mantissa bits, so rounding a Gaussian-like activation costs ulp/sqrt(12) of the
    x^2-weighted magnitude, ~2.5% relative; one quantized input (linear) -> bound 3e-2; the experts
    quantize x and the SwiGLU output (heavier-tailed, so more of it sits far below its block's
    amax), measured ~4.7% (the same at the release shapes) -> bound 6e-2.
"""

from __future__ import annotations

import pytest
import torch

from engine.experts.torch_experts import TorchExperts
from engine.kernels.experts.fp8_block import DECODE_MAX_TOKENS, fp8_block_moe
from engine.kernels.linear import torch_ref
from engine.kernels.linear.triton_linear import DECODE_MAX_ROWS, linear, quantize_activations
from engine.quant import dequantize_fp8_block, quantize_fp8_block, quantize_nvfp4
from engine.weights import DenseWeight, Fp8BlockWeight, Nvfp4Weight
from tests.engine.kernels.sm90 import assert_compiles_for_sm90

E, D, I = 5, 192, 96  # D is 1.5 blocks, I 0.75 of one: both ragged
LIMIT = 1.0  # gate and up are ~N(0, 1): the clamps cut a sixth of the gates and a third of the ups
TOKEN_GROUP = (1, 128)  # activations: one scale per token per 128 columns


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def fake_quant(v: torch.Tensor) -> torch.Tensor:
    """The activation scheme in torch: quantize per token per 128 columns, then expand back to fp32."""
    return dequantize_fp8_block(*quantize_fp8_block(v, TOKEN_GROUP), TOKEN_GROUP)


def fp8_weight(shape: tuple[int, ...], seed: int) -> Fp8BlockWeight:
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) / shape[-1] ** 0.5
    return Fp8BlockWeight(*quantize_fp8_block(w))


@pytest.fixture(scope="module")
def stacks() -> tuple[Fp8BlockWeight, Fp8BlockWeight, Fp8BlockWeight]:
    return fp8_weight((E, I, D), 1), fp8_weight((E, I, D), 2), fp8_weight((E, D, I), 3)


def routing(t: int, k: int, seed: int, choices: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token (drawn from `choices`, default all) and softmax weights."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(choices if choices is not None else list(range(E)))
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(t)])
    return ids, torch.softmax(torch.randn(t, k, generator=g), -1)


def inputs(t: int, k: int, dtype: torch.dtype, seed: int, choices: list[int] | None = None):
    x = torch.randn(t, D, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return (x, *routing(t, k, seed, choices))


def reference(stacks, x, ids, w) -> torch.Tensor:
    return TorchExperts({0: stacks}, LIMIT)(0, x.float(), ids, w)


def quantized_reference(stacks, x, ids, w, monkeypatch) -> torch.Tensor:
    """TorchExperts whose linears see fake-quantized inputs: x for gate/up, the SwiGLU output for down."""
    monkeypatch.setattr("engine.experts.torch_experts.linear",
                        lambda a, weight: fake_quant(a) @ weight.dequantize(torch.float32).t())
    return reference(stacks, x, ids, w)


@pytest.mark.parametrize("t,k", [(1, 4), (3, 3), (16, 2)])
def test_moe_decode_fp32(stacks, t, k):
    x, ids, w = inputs(t, k, torch.float32, seed=t)
    assert rel_err(fp8_block_moe(x, ids, w, *stacks, LIMIT), reference(stacks, x, ids, w)) < 1e-5


@pytest.mark.parametrize("t,k", [(1, 2), (3, 4)])
def test_moe_decode_bf16(stacks, t, k):
    x, ids, w = inputs(t, k, torch.bfloat16, seed=t)
    out = fp8_block_moe(x, ids, w, *stacks, LIMIT)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, reference(stacks, x, ids, w)) < 1e-2


def test_moe_decode_one_expert_for_all(stacks):
    x, _, w = inputs(3, 2, torch.float32, seed=5)
    ids = torch.tensor([[1, 3]] * 3)
    assert rel_err(fp8_block_moe(x, ids, w, *stacks, LIMIT), reference(stacks, x, ids, w)) < 1e-5


def test_moe_decode_skips_pairs_of_weight_zero(stacks):
    """A pair of routing weight zero (a hybrid step's miss) reads nothing: expert 0, NaN here, only takes such
    pairs; the last token has no live pair and gets zeros."""
    x, ids, w = inputs(3, 3, torch.float32, seed=7, choices=[1, 2, 3, 4])
    ids[0, 1] = ids[2, 0] = 0
    w[ids == 0] = 0
    w[2] = 0
    gate, up, down = stacks
    nan = Fp8BlockWeight(gate.data, gate.scale_inv.clone())
    nan.scale_inv[0] = float("nan")
    out = fp8_block_moe(x, ids, w, nan, up, down, LIMIT)
    assert rel_err(out, reference(stacks, x, ids, w)) < 1e-5 and torch.equal(out[2], torch.zeros(D))


def test_moe_prefill_fp32_with_empty_experts(stacks):
    x, ids, w = inputs(40, 3, torch.float32, seed=40, choices=[1, 2, 3])  # experts 0 and 4 get no rows
    assert 40 > DECODE_MAX_TOKENS
    assert rel_err(fp8_block_moe(x, ids, w, *stacks, LIMIT), reference(stacks, x, ids, w)) < 1e-5


def test_moe_prefill_bf16(stacks, monkeypatch):
    x, ids, w = inputs(40, 4, torch.bfloat16, seed=41)
    out = fp8_block_moe(x, ids, w, *stacks, LIMIT)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, reference(stacks, x, ids, w)) < 6e-2
    assert rel_err(out, quantized_reference(stacks, x, ids, w, monkeypatch)) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_prefill_all_tokens_on_two_experts(stacks, dtype, monkeypatch):
    """70 rows on each of experts 2 and 4: two row blocks each (the second partial), the other experts empty."""
    x, _, w = inputs(70, 2, dtype, seed=70)
    ids = torch.tensor([[2, 4]] * 70)
    out = fp8_block_moe(x, ids, w, *stacks, LIMIT)
    if dtype == torch.float32:
        assert rel_err(out, reference(stacks, x, ids, w)) < 1e-5
    else:
        assert rel_err(out, quantized_reference(stacks, x, ids, w, monkeypatch)) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_activations_matches_codec(dtype):
    x = torch.randn(37, 300, generator=torch.Generator().manual_seed(0)) * 3
    x[5] = 0.0  # an all-zero group keeps scale 1
    x[6, :128] *= 1e-4  # codes in the e4m3 subnormal range
    x = x.to(dtype)
    q, s = quantize_activations(x)
    want_q, want_s = quantize_fp8_block(x, TOKEN_GROUP)
    assert torch.equal(s, want_s)
    assert torch.equal(q.float(), want_q.float())


LINEAR_SHAPES = [(200, 192), (64, 330)]  # ragged N and K; (64, 330) at T=1 splits K over programs


@pytest.mark.parametrize("n,k", LINEAR_SHAPES)
@pytest.mark.parametrize("t", [1, 5, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_fp8(n, k, t, dtype):
    weight = fp8_weight((n, k), seed=n + k)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t)).to(dtype)
    out = linear(x, weight)
    assert out.dtype == dtype and out.shape == (t, n)
    exact = x.float() @ weight.dequantize(torch.float32).t()
    if dtype == torch.float32:
        assert rel_err(out, exact) < 1e-5
    elif t <= DECODE_MAX_ROWS:
        assert rel_err(out, exact) < 1e-2
    else:
        assert rel_err(out, exact) < 3e-2
        assert rel_err(out, fake_quant(x) @ weight.dequantize(torch.float32).t()) < 1e-2


@pytest.mark.parametrize("k,t,dtype", [(640, 1, torch.bfloat16), (1408, 70, torch.bfloat16), (640, 1, torch.float32)])
def test_a_k_split_past_k_reads_no_scale_beyond_the_weights(k, t, dtype):
    """When K's 128-wide steps do not divide evenly over the programs of a split K, the last program's steps run
    past K: they must read no block scale there (past a row's last, or the tensor's end: NaN here, garbage or an
    illegal address on a GPU) and add nothing. Shapes whose split overshoots with the interpreter's 4 SMs: decode
    (W8A16) and prefill (fp8 activations)."""
    weight = fp8_weight((128, k), seed=k)
    rows, cols = weight.scale_inv.shape
    padded = torch.full((rows, cols + 2), float("nan"))
    padded[:, :cols] = weight.scale_inv
    fenced = Fp8BlockWeight(weight.data, padded[:, :cols])
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    out = linear(x, fenced)
    assert torch.isfinite(out).all()
    assert torch.equal(out, linear(x, weight))


@pytest.mark.parametrize("a_fp8", [True, False])
def test_the_linear_kernel_compiles_for_sm90(a_fp8, tmp_path):
    """Both builds (fp8 activations for prefill, W8A16 for decode) compile for the GPU: the interpreter takes code
    the compiler would reject."""
    a = "*fp8e4nv" if a_fp8 else "*bf16"
    assert_compiles_for_sm90(f"""
from engine.kernels.linear.triton_linear import _fp8_linear_kernel
compile_for_sm90(_fp8_linear_kernel, dict(a_ptr="{a}", a_s_ptr="*fp32", w_ptr="*fp8e4nv", w_s_ptr="*fp32",
                 out_ptr="*bf16"), dict(K=16384, K_SPLIT=5504, A_FP8={a_fp8}, DOT_F32=False, BM=128, BN=128), 8)
print("compiled")
""", tmp_path)


def test_linear_keeps_leading_dims():
    weight = fp8_weight((64, 130), seed=1)
    x = torch.randn(2, 3, 130)
    assert torch.allclose(linear(x, weight), torch_ref.linear(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t", [1, 70])
def test_linear_dense_and_nvfp4_take_the_torch_path(t):
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, 64, generator=g)
    dense = DenseWeight(torch.randn(48, 64, generator=g))
    nvfp4 = Nvfp4Weight(*quantize_nvfp4(torch.randn(48, 64, generator=g)))
    for weight in (dense, nvfp4):
        assert torch.equal(linear(x, weight), torch_ref.linear(x, weight))
