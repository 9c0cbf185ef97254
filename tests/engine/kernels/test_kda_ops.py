"""KDA decode/prefill ops: the references equal the unfused paths; the Triton decode equals the reference.

The Triton kernels run in Triton's interpreter here. fla's chunk_kda (the CUDA prefill) cannot: its
autotuners need a GPU driver to benchmark, its token-parallel intra kernel takes Python `min` of
tensors and its safe-gate kernel calls a gather helper outside JIT; tests/gpu/test_kda_kernels.py
checks it on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.kda import torch_ref
from engine.kernels.kda.torch_ref import kda_chunk, kda_step, short_conv
from engine.kernels.kda.triton_conv import short_conv_varlen as triton_short_conv_varlen
from engine.kernels.kda.triton_decode import kda_decode as triton_kda_decode
from engine.kernels.kda.triton_gates import forget_gate as triton_forget_gate
from engine.kernels.linear.torch_ref import linear
from engine.quant import quantize_fp8_block
from engine.weights import DenseWeight, Fp8BlockWeight
from tests.engine.kernels.sm90 import assert_compiles_for_sm90

SLOTS = 6
CONV = 4
RANK = 40  # the gates' low-rank width: not a multiple of the kernels' 32-wide steps


def decode_inputs(b: int, h: int, d: int, dtype: torch.dtype, seed: int) -> dict:
    """One decode step's arguments; states for SLOTS requests, `b` of them (in shuffled order) stepping. q|k|v, the
    gates' low-rank inputs and beta are columns of one wider buffer, as the mixer's stacked projection hands them
    over (the kernels read them through their row strides)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    p = h * d
    stacked = rnd(b, 3 * p + 3 * RANK + h).to(dtype)  # q|k|v, forget, (unused), gate, beta side by side
    low = 3 * p
    return {"qkv": stacked[:, :low], "forget_low": stacked[:, low:low + RANK],
            "f_b": DenseWeight((rnd(p, RANK) * RANK ** -0.5).to(dtype)), "beta_logits": stacked[:, -h:],
            "gate_low": stacked[:, low + 2 * RANK:low + 3 * RANK],
            "g_b": DenseWeight((rnd(p, RANK) * RANK ** -0.5).to(dtype)),
            "conv_state": rnd(SLOTS, 3 * p, CONV - 1).to(dtype),
            "conv_weight": rnd(3 * p, CONV) * 0.5, "rec_state": rnd(SLOTS, h, d, d) * 0.1,
            "slots": torch.randperm(SLOTS, generator=gen)[:b], "decay_rate": rnd(h).exp(), "dt_bias": rnd(p),
            "o_norm": (1 + 0.1 * rnd(d)).to(dtype), "lower_bound": -5.0, "eps": 1e-5}


def with_gates(args: dict) -> dict:
    """Decode arguments with the gates up-projected ([B, P] f and gate_out, as kda_spans takes them)."""
    rest = {k: v for k, v in args.items() if k not in ("forget_low", "f_b", "gate_low", "g_b")}
    return {**rest, "f": linear(args["forget_low"], args["f_b"]), "gate_out": linear(args["gate_low"], args["g_b"])}


def unfused_decode(qkv, forget_low, f_b, beta_logits, gate_low, g_b, conv_state, conv_weight, rec_state, slots,
                   decay_rate, dt_bias, o_norm, lower_bound, eps):
    """The mixer's single-token path before the fused op: up-projections, conv, gate, beta, kda_step, gated norm,
    separately."""
    b, h, d = qkv.shape[0], decay_rate.shape[0], o_norm.shape[0]
    f, gate_out = forget_low @ f_b.data.t(), gate_low @ g_b.data.t()
    mixed, conv_state[slots] = short_conv(qkv.unsqueeze(1), conv_state[slots], conv_weight)
    q, k, v = mixed.squeeze(1).view(b, 3, h, d).unbind(1)
    gate = f.float() + dt_bias
    g = lower_bound * torch.sigmoid(decay_rate.view(h, 1) * gate.view(-1, h, d))
    out, rec_state[slots] = kda_step(q, k, v, g, torch.sigmoid(beta_logits), rec_state[slots])
    of = out.float()
    normed = o_norm.float() * (of * torch.rsqrt(of.square().mean(-1, keepdim=True) + eps))
    return (normed * torch.sigmoid(gate_out.view(b, h, d).float())).to(qkv.dtype).reshape(b, h * d)


def run_steps(fn, b: int, h: int, d: int, dtype: torch.dtype, steps: int, **launch) -> tuple:
    """`steps` consecutive decode steps on the same states (so the conv state shift is exercised)."""
    first = decode_inputs(b, h, d, dtype, seed=0)
    conv, rec = first["conv_state"], first["rec_state"]
    outs = []
    for step in range(steps):
        args = {**decode_inputs(b, h, d, dtype, seed=step), "conv_state": conv, "rec_state": rec,
                "slots": first["slots"]}
        outs.append(fn(**args, **launch))
    return torch.stack(outs), conv, rec, first["slots"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("b", [1, 2, 3, 4, 5])
def test_decode_reference_equals_unfused(b):
    got, conv, rec, slots = run_steps(torch_ref.kda_decode, b, 3, 16, torch.float32, steps=2)
    want, want_conv, want_rec, _ = run_steps(unfused_decode, b, 3, 16, torch.float32, steps=2)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(conv, want_conv) and torch.allclose(rec, want_rec, rtol=1e-6, atol=1e-7)
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[slots] = False
    start = decode_inputs(b, 3, 16, torch.float32, seed=0)
    assert torch.equal(conv[untouched], start["conv_state"][untouched])
    assert torch.equal(rec[untouched], start["rec_state"][untouched])
    assert not torch.equal(rec[slots], start["rec_state"][slots])


# Triton's interpreter truncates fp32 -> bf16 where the GPU (and torch) round to nearest; that alone
# gives ~6e-3 here, hence bf16's 1.5e-2. fp32 checks the logic tightly.
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1.5e-2)])
@pytest.mark.parametrize("b,h,d,block_v", [(1, 2, 16, None), (3, 3, 32, 16), (5, 2, 32, 32)])
def test_triton_decode_matches_reference(dtype, tol, b, h, d, block_v):
    got, conv, rec, slots = run_steps(triton_kda_decode, b, h, d, dtype, steps=2, block_v=block_v)
    want, want_conv, want_rec, _ = run_steps(torch_ref.kda_decode, b, h, d, dtype, steps=2)
    assert not got.isnan().any()
    assert rel(got, want) < tol
    assert rel(rec, want_rec) < tol
    assert torch.equal(conv, want_conv)  # the conv state is copied values, never rounded
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(rec[untouched], decode_inputs(b, h, d, dtype, seed=0)["rec_state"][untouched])


def test_triton_decode_takes_quantized_up_projections_through_the_linear_op():
    """Gates whose up-projections the kernels do not read in registers (FP8 blocks) are projected by the linear
    op first: the same result as the reference given the same weights."""
    def fp8(args: dict) -> dict:
        quantized = {k: Fp8BlockWeight(*quantize_fp8_block(args[k].data)) for k in ("f_b", "g_b")}
        return {**args, **quantized}

    first = fp8(decode_inputs(3, 2, 16, torch.float32, seed=0))
    got = triton_kda_decode(**{**first, "conv_state": first["conv_state"].clone(),
                               "rec_state": first["rec_state"].clone()})
    want = torch_ref.kda_decode(**first)
    assert rel(got, want) < 1e-5
    dense = decode_inputs(3, 2, 16, torch.float32, seed=0)
    assert rel(want, torch_ref.kda_decode(**dense)) > 1e-3  # the FP8 weights differ: the test sees which it ran


def prefill_inputs(lengths: list[int], h: int = 3, d: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    q, k, v = (torch.randn(n, h, d, generator=gen) for _ in range(3))
    g = -5.0 * torch.sigmoid(torch.randn(n, h, d, generator=gen))
    beta = torch.sigmoid(torch.randn(n, h, generator=gen))
    state = torch.randn(SLOTS, h, d, d, generator=gen) * 0.1
    slots = torch.randperm(SLOTS, generator=gen)[:len(lengths)]
    cu = torch.tensor([0] + lengths).cumsum(0)
    return q, k, v, g, beta, state, slots, cu


def test_prefill_reference_equals_per_sequence_chunk():
    lengths = [1, 7, 64, 65]
    q, k, v, g, beta, state, slots, cu = prefill_inputs(lengths)
    rec = state.clone()
    out = torch_ref.kda_prefill(q, k, v, g, beta, rec, slots, cu)
    for i, slot in enumerate(slots.tolist()):
        sl = slice(cu[i].item(), cu[i + 1].item())
        want_o, want_s = kda_chunk(q[sl], k[sl], v[sl], g[sl], beta[sl], state[slot])
        assert torch.equal(out[sl], want_o) and torch.equal(rec[slot], want_s)
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(rec[untouched], state[untouched])


def test_prefill_reference_equals_token_steps():
    """Independent of kda_chunk: the same sequences fed one token at a time through kda_step."""
    lengths = [5, 70, 1]
    q, k, v, g, beta, state, slots, cu = prefill_inputs(lengths, seed=1)
    rec = state.clone()
    out = torch_ref.kda_prefill(q, k, v, g, beta, rec, slots, cu)
    for i, slot in enumerate(slots.tolist()):
        s = state[slot:slot + 1]
        for t in range(cu[i].item(), cu[i + 1].item()):
            o, s = kda_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s)
            assert torch.allclose(out[t], o[0], rtol=1e-4, atol=1e-5)
        assert torch.allclose(rec[slot], s[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_normalized_matches_float64(dtype):
    """The q/k norm the CUDA prefill hands fla: x / sqrt(sum x^2 + 1e-6) per head, stored in x's dtype."""
    from engine.kernels.kda.fla_prefill import l2_normalized

    # q as the conv's output holds it: a strided view of [N, 3, H, d]; 5 heads fill part of a power-of-two tile
    x = (torch.randn(37, 3, 5, 128, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)[:, 1]
    x[0, 0] = 0  # an all-zero head: eps keeps it finite (zero)
    x64 = x.double()
    want = x64 / torch.sqrt(x64.square().sum(-1, keepdim=True) + 1e-6)
    got = l2_normalized(x)
    assert got.dtype == dtype and got.is_contiguous() and torch.equal(got[0, 0], torch.zeros(128, dtype=dtype))
    tol = 1e-6 if dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def spans_inputs(lengths: list[int], h: int, d: int, dtype: torch.dtype, seed: int = 0) -> dict:
    """`kda_spans` arguments: multi-token spans of these lengths, one after another, on shuffled slots."""
    first = with_gates(decode_inputs(sum(lengths), h, d, dtype, seed))
    slots = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(seed + 1))[:len(lengths)]
    rows = torch_ref.ConvRows.of(lengths, CONV - 1, torch.device("cpu"))
    return {**first, "slots": slots, "cu_seqlens": torch.tensor([0] + lengths).cumsum(0), "conv_rows": rows,
            "longest": max(lengths)}


@pytest.mark.parametrize("lengths", [[2, 5, 9], [70], [3, 2]])
def test_spans_reference_equals_decode_steps(lengths):
    """Independent of the chunked form: each span fed one token at a time through the fused decode reference."""
    args = spans_inputs(lengths, 3, 16, torch.float32)
    conv, rec = args["conv_state"].clone(), args["rec_state"].clone()
    got = torch_ref.kda_spans(**args)
    bounds = args["cu_seqlens"].tolist()
    for i, slot in enumerate(args["slots"].tolist()):
        for t in range(bounds[i], bounds[i + 1]):
            one = {k: args[k][t:t + 1] for k in ("qkv", "beta_logits")}
            # an identity up-projection hands the decode op the span's own gates
            identity = DenseWeight(torch.eye(args["f"].shape[1]))
            want = torch_ref.kda_decode(**one, forget_low=args["f"][t:t + 1], f_b=identity,
                                        gate_low=args["gate_out"][t:t + 1], g_b=identity, conv_state=conv,
                                        conv_weight=args["conv_weight"], rec_state=rec,
                                        slots=torch.tensor([slot]), decay_rate=args["decay_rate"],
                                        dt_bias=args["dt_bias"], o_norm=args["o_norm"],
                                        lower_bound=args["lower_bound"], eps=args["eps"])
            torch.testing.assert_close(got[t:t + 1], want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(args["rec_state"], rec, rtol=1e-4, atol=1e-5)
    assert torch.equal(args["conv_state"], conv)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1.5e-2)])
@pytest.mark.parametrize("lengths,h,d,block_v", [([2, 5, 9], 2, 16, None), ([3, 2], 3, 32, 16), ([2], 2, 32, 32)])
def test_triton_spans_match_reference(dtype, tol, lengths, h, d, block_v):
    from engine.kernels.kda.triton_spans import kda_spans as triton_kda_spans

    got_args, want_args = spans_inputs(lengths, h, d, dtype), spans_inputs(lengths, h, d, dtype)
    got = triton_kda_spans(**got_args, block_v=block_v)
    want = torch_ref.kda_spans(**want_args)
    assert not got.isnan().any()
    assert rel(got, want) < tol
    assert rel(got_args["rec_state"], want_args["rec_state"]) < tol
    assert torch.equal(got_args["conv_state"], want_args["conv_state"])  # copied values, never rounded
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[got_args["slots"]] = False
    assert torch.equal(got_args["rec_state"][untouched], spans_inputs(lengths, h, d, dtype)["rec_state"][untouched])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_triton_spans_past_the_short_limit_take_the_chunked_path(monkeypatch, dtype, tol):
    """The chunked form (the same states as the reference's, bit for bit), then the gated norm in one launch."""
    from engine.kernels.kda import triton_spans

    monkeypatch.setattr(triton_spans, "SHORT_SPAN_TOKENS", 4)
    got_args, want_args = spans_inputs([3, 6], 2, 16, dtype), spans_inputs([3, 6], 2, 16, dtype)
    got, want = triton_spans.kda_spans(**got_args), torch_ref.kda_spans(**want_args)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(got_args["rec_state"], want_args["rec_state"])
    assert torch.equal(got_args["conv_state"], want_args["conv_state"])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_triton_ragged_conv_matches_reference(dtype, tol):
    """Sequences shorter than the conv's history (their windows reach into the held inputs), longer ones and a
    token block and channel block left part-filled (19 tokens, 300 channels)."""
    gen = torch.Generator().manual_seed(3)
    lengths, channels = [1, 2, 9, 7], 300
    x = torch.randn(sum(lengths), channels, generator=gen).to(dtype)
    state = torch.randn(len(lengths), channels, CONV - 1, generator=gen).to(dtype)
    weight = torch.randn(channels, CONV, generator=gen)
    rows = torch_ref.ConvRows.of(lengths, CONV - 1, torch.device("cpu"))
    got, got_state = triton_short_conv_varlen(x, state, weight, rows)
    want, want_state = torch_ref.short_conv_varlen(x, state, weight, rows)
    assert got.dtype == dtype and torch.equal(got_state, want_state)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_forget_gate_matches_reference(dtype):
    """From a strided view of the up-projection (a column block of a wider output), 3 heads of 16 over 45 rows:
    2,160 gate values, the last program part-filled."""
    gen = torch.Generator().manual_seed(4)
    f = torch.randn(45, 80, generator=gen).to(dtype)[:, 16:64]
    dt_bias, decay_rate = torch.randn(48, generator=gen), torch.randn(3, generator=gen).exp()
    got = triton_forget_gate(f, dt_bias, decay_rate, -5.0)
    want = torch_ref.forget_gate(f, dt_bias, decay_rate, -5.0)
    assert got.dtype == torch.float32 and got.shape == want.shape == (45, 3, 16)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("low_rank", [True, False])
def test_the_decode_kernels_compile_for_sm90(low_rank, tmp_path):
    """Both decode builds, and the short spans' kernels, at the release's shapes (64 heads of 128, rank 128, bf16)
    compile for the GPU: the interpreter takes code the compiler would reject."""
    assert_compiles_for_sm90(f"""
from engine.kernels.kda.fla_prefill import _l2_normalized_kernel
from engine.kernels.kda.triton_conv import _conv_silu_kernel
from engine.kernels.kda.triton_gates import _forget_gate_kernel
from engine.kernels.kda.triton_decode import _norm_kernel, _step_kernel
from engine.kernels.kda.triton_spans import _spans_conv_state_kernel, _spans_step_kernel
compile_for_sm90(_step_kernel, dict(qkv="*bf16", f="*bf16", f_b="*bf16", beta_logits="*bf16", conv_state="*bf16",
                 conv_weight="*fp32", rec_state="*fp32", slots="*i64", decay_rate="*fp32", dt_bias="*fp32",
                 out="*bf16"), dict(P=8192, H=64, D=128, BV=32, CONV=4, R=128, LOW_RANK={low_rank}), 4,
                 dict(lower_bound="fp32", scale="fp32"))
compile_for_sm90(_norm_kernel, dict(qkv="*bf16", gate_in="*bf16", g_b="*bf16", conv_state="*bf16", slots="*i64",
                 o_norm="*bf16", out="*bf16"), dict(P=8192, H=64, D=128, CONV=4, CP2=4, R=128, LOW_RANK={low_rank}),
                 4, dict(eps="fp32"))
if {low_rank}:  # the short spans' kernels (verify steps), once
    compile_for_sm90(_spans_step_kernel, dict(qkv="*bf16", f="*bf16", beta_logits="*bf16", conv_state="*bf16",
                     conv_weight="*fp32", rec_state="*fp32", slots="*i64", cu_seqlens="*i64", decay_rate="*fp32",
                     dt_bias="*fp32", out="*bf16"), dict(P=8192, H=64, D=128, BV=32, CONV=4), 4,
                     dict(lower_bound="fp32", scale="fp32"))
    compile_for_sm90(_spans_conv_state_kernel, dict(qkv="*bf16", conv_state="*bf16", slots="*i64",
                     cu_seqlens="*i64"), dict(CHANNELS=24576, CONV=4, CP2=4, BLOCK_C=256), 4)
    compile_for_sm90(_conv_silu_kernel, dict(seq_ptr="*bf16", w_ptr="*fp32", windows_ptr="*i64", y_ptr="*bf16"),
                     dict(K=4, BLOCK_T=16, BLOCK_C=256), 4)
    compile_for_sm90(_l2_normalized_kernel, dict(x_ptr="*bf16", out_ptr="*bf16"), dict(H=64, D=128, BH=64), 4,
                     dict(eps="fp32"))
    compile_for_sm90(_forget_gate_kernel, dict(f_ptr="*bf16", bias_ptr="*fp32", rate_ptr="*fp32", out_ptr="*fp32"),
                     dict(P=8192, D=128, BLOCK=1024), 4, dict(lower_bound="fp32"))
print("compiled")
""", tmp_path)
