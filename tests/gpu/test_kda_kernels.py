"""KDA decode (Triton) and prefill (fla chunk_kda) at the release shapes, 64 heads of 128, against the
torch references on the same GPU: bf16 and fp32, ragged batches, shuffled slots, never NaN."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.kda import fla_prefill, torch_ref, triton_decode
from engine.weights import DenseWeight

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]

H, D, CONV, RANK = 64, 128, 4, 128
DEVICE = "cuda"
DECODE_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
PREFILL_TOL = {torch.float32: 5e-3, torch.bfloat16: 1e-2}  # fla's fp32 matmuls may run in TF32


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def decode_args(b: int, num_slots: int, dtype: torch.dtype, seed: int) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=DEVICE)

    p = H * D
    # the gates' low-rank inputs as the mixer hands them over: columns of its stacked projection's output
    stacked = rnd(b, 3 * RANK).to(dtype)
    return {"qkv": rnd(b, 3 * p).to(dtype), "forget_low": stacked[:, :RANK],
            "f_b": DenseWeight((rnd(p, RANK) * RANK ** -0.5).to(dtype)), "beta_logits": rnd(b, H).to(dtype),
            "gate_low": stacked[:, 2 * RANK:], "g_b": DenseWeight((rnd(p, RANK) * RANK ** -0.5).to(dtype)),
            "conv_state": rnd(num_slots, 3 * p, CONV - 1).to(dtype),
            "conv_weight": rnd(3 * p, CONV) * 0.5, "rec_state": rnd(num_slots, H, D, D) * 0.3,
            "slots": torch.randperm(num_slots, generator=gen, device=DEVICE)[:b], "decay_rate": rnd(H).exp(),
            "dt_bias": rnd(p), "o_norm": (1 + 0.1 * rnd(D)).to(dtype), "lower_bound": -5.0, "eps": 1e-5}


def spans_gates(args: dict) -> dict:
    """Decode arguments as kda_spans takes them: the gates up-projected ([N, P] f and gate_out)."""
    rest = {k: v for k, v in args.items() if k not in ("forget_low", "f_b", "gate_low", "g_b")}
    return {**rest, "f": args["forget_low"] @ args["f_b"].data.t(), "gate_out": args["gate_low"] @ args["g_b"].data.t()}


def check_decode(b: int, dtype: torch.dtype, steps: int, **launch) -> None:
    """`steps` decode steps through both paths on separate copies of the same states."""
    first = decode_args(b, 2 * b + 1, dtype, seed=0)
    states = {"triton": (first["conv_state"].clone(), first["rec_state"].clone()),
              "torch": (first["conv_state"].clone(), first["rec_state"].clone())}
    for step in range(steps):
        args = {**decode_args(b, 2 * b + 1, dtype, seed=step + 1), "slots": first["slots"]}
        outs = {}
        for name, fn in (("triton", lambda **a: triton_decode.kda_decode(**a, **launch)),
                         ("torch", torch_ref.kda_decode)):
            conv, rec = states[name]
            outs[name] = fn(**{**args, "conv_state": conv, "rec_state": rec})
        assert not outs["triton"].isnan().any()
        assert rel(outs["triton"], outs["torch"]) < DECODE_TOL[dtype], step
    (conv, rec), (want_conv, want_rec) = states["triton"], states["torch"]
    assert torch.equal(conv, want_conv)
    assert rel(rec, want_rec) < DECODE_TOL[dtype]
    untouched = torch.ones(len(rec), dtype=torch.bool, device=DEVICE)
    untouched[first["slots"]] = False
    assert torch.equal(rec[untouched], first["rec_state"][untouched])
    assert torch.equal(conv[untouched], first["conv_state"][untouched])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b", [1, 2, 8, 16])
def test_decode_matches_reference(b, dtype):
    check_decode(b, dtype, steps=4)


@pytest.mark.parametrize("block_v,num_warps", [(16, 4), (32, 4), (64, 4), (64, 8), (128, 8), (128, 4)])
def test_decode_every_tile(block_v, num_warps):
    check_decode(2, torch.float32, steps=2, block_v=block_v, num_warps=num_warps)


def test_decode_replays_in_a_cuda_graph():
    """Captured once, replayed on new inputs: the same result as eager on copies of the states."""
    b, dtype = 4, torch.bfloat16
    static = decode_args(b, 9, dtype, seed=0)
    eager_conv, eager_rec = static["conv_state"].clone(), static["rec_state"].clone()
    triton_decode.kda_decode(**decode_args(b, 9, dtype, seed=5))  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = triton_decode.kda_decode(**static)
    torch.cuda.current_stream().wait_stream(stream)
    for step in range(1, 4):
        new = decode_args(b, 9, dtype, seed=step)
        for name in ("qkv", "forget_low", "beta_logits", "gate_low"):
            static[name].copy_(new[name])
        graph.replay()
        want = triton_decode.kda_decode(**{**static, "conv_state": eager_conv, "rec_state": eager_rec})
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    assert torch.equal(static["rec_state"], eager_rec) and torch.equal(static["conv_state"], eager_conv)


def prefill_args(lengths: list[int], num_slots: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    n = sum(lengths)
    q, k, v = (torch.randn(n, H, D, generator=gen, device=DEVICE).to(dtype) for _ in range(3))
    g = -5.0 * torch.sigmoid(torch.randn(n, H, D, generator=gen, device=DEVICE))
    beta = torch.sigmoid(torch.randn(n, H, generator=gen, device=DEVICE)).to(dtype)
    state = torch.randn(num_slots, H, D, D, generator=gen, device=DEVICE) * 0.3
    slots = torch.randperm(num_slots, generator=gen, device=DEVICE)[:len(lengths)]
    cu = torch.tensor([0] + lengths, device=DEVICE).cumsum(0)
    return q, k, v, g, beta, state, slots, cu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lengths", [[1, 7, 64, 65, 1000], [8192, 3]])
def test_prefill_matches_reference(lengths, dtype):
    fla_prefill.warm_up_kda_prefill(DEVICE, H, D, dtype)
    q, k, v, g, beta, state, slots, cu = prefill_args(lengths, len(lengths) + 2, dtype, seed=len(lengths))
    rec, want_rec = state.clone(), state.clone()
    out = fla_prefill.kda_prefill(q, k, v, g, beta, rec, slots, cu)
    want = torch_ref.kda_prefill(q, k, v, g, beta, want_rec, slots, cu)
    assert out.dtype == dtype and out.shape == want.shape
    assert not out.isnan().any() and not rec.isnan().any()
    for i, slot in enumerate(slots.tolist()):  # per sequence, so a short one cannot hide behind a long one
        sl = slice(cu[i].item(), cu[i + 1].item())
        assert rel(out[sl], want[sl]) < PREFILL_TOL[dtype], lengths[i]
        assert rel(rec[slot], want_rec[slot]) < PREFILL_TOL[dtype], lengths[i]
    untouched = torch.ones(len(state), dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(rec[untouched], state[untouched])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lengths", [[2, 50, 17], [128], [3, 3, 3, 3, 3, 3, 3, 3], [300, 1, 40]])
def test_spans_match_reference(lengths, dtype, monkeypatch):
    """The Triton recurrence over short spans, and past SHORT_SPAN_TOKENS the chunked form on CUDA (the ragged
    conv, forget gate and q/k norm kernels, fla's chunk_kda, the gated norm kernel), against the torch reference
    (conv, gates, chunked KDA, norm)."""
    from engine.kernels.kda import triton_spans

    first = spans_gates(decode_args(sum(lengths), 2 * len(lengths) + 1, dtype, seed=0))
    slots = first["slots"][:len(lengths)]
    layout = {"slots": slots, "cu_seqlens": torch.tensor([0] + lengths, device=DEVICE).cumsum(0),
              "conv_rows": torch_ref.ConvRows.of(lengths, CONV - 1, torch.device(DEVICE)), "longest": max(lengths)}
    got_args = {**first, **layout, "conv_state": first["conv_state"].clone(), "rec_state": first["rec_state"].clone()}
    want_args = {**first, **layout, "conv_state": first["conv_state"].clone(), "rec_state": first["rec_state"].clone()}
    got = triton_spans.kda_spans(**got_args)
    monkeypatch.setenv("GLMFLASH_KERNELS", "torch")  # the reference's chunked KDA, not fla's
    want = torch_ref.kda_spans(**want_args)
    assert not got.isnan().any()
    assert rel(got, want) < PREFILL_TOL[dtype]
    assert rel(got_args["rec_state"], want_args["rec_state"]) < PREFILL_TOL[dtype]
    assert torch.equal(got_args["conv_state"], want_args["conv_state"])
    untouched = torch.ones(len(first["rec_state"]), dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(got_args["rec_state"][untouched], first["rec_state"][untouched])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ragged_conv_matches_reference(dtype):
    """The chunked path's ragged short conv at the release's channels (3 x 64 x 128): a one-token span (its window
    in the held inputs), a long one and a short one, against torch's conv1d on the same GPU."""
    from engine.kernels.kda import triton_conv

    gen = torch.Generator(device=DEVICE).manual_seed(5)
    lengths, channels = [1, 3000, 17], 3 * H * D
    x = torch.randn(sum(lengths), channels, generator=gen, device=DEVICE).to(dtype)
    state = torch.randn(len(lengths), channels, CONV - 1, generator=gen, device=DEVICE).to(dtype)
    weight = torch.randn(channels, CONV, generator=gen, device=DEVICE) * 0.5
    rows = torch_ref.ConvRows.of(lengths, CONV - 1, torch.device(DEVICE))
    got, got_state = triton_conv.short_conv_varlen(x, state, weight, rows)
    with torch.backends.cudnn.flags(allow_tf32=False):
        want, want_state = torch_ref.short_conv_varlen(x, state, weight, rows)
    assert torch.equal(got_state, want_state) and not got.isnan().any()
    assert rel(got, want) < DECODE_TOL[dtype]
