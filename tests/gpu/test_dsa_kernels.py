"""The indexer's selection and the sparse MLA on CUDA at the release's shapes against the torch path: decode
batches and the spans of a prefill step, bf16, and a decode step captured in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from ops.bench_dsa import attend, release_case, select

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]

CASES = {"decode 1": ([(3000, 1)], True), "decode 16": ([(100 * i + 7, 1) for i in range(16)], True),
         "spans": ([(3000, 50), (0, 37), (1203, 9), (64, 300)], False), "long span": ([(5000, 2048)], False)}


@pytest.mark.parametrize("name", CASES)
def test_selection_and_attention_match_the_torch_path(name):
    spans, decode = CASES[name]
    c = release_case(spans, decode, seed=len(name))
    got, want = select("triton", c), select("torch", c)
    assert got.shape == want.shape
    # fp32 sums in another order: a pool at the cut may swap with its neighbour in score, nothing more.
    same = [len(set(a.tolist()) & set(b.tolist())) / max(1, (b >= 0).sum().item()) for a, b in zip(got, want)]
    assert min(same) > 0.99 and torch.equal(got < 0, want < 0)
    out, ref = attend("triton", c, want), attend("torch", c, want)
    exact = attend("torch", {**c, "q_latent": c["q_latent"].float(), "latents": c["latents"].float()}, want)
    # bf16 outputs: the kernel's error against the fp32 result is at most the torch path's (which rounds its
    # scores to bf16 before the softmax; the kernel keeps them in fp32).
    error, ref_error = (out.float() - exact).abs().max(), (ref.float() - exact).abs().max()
    assert error <= 1.5 * ref_error and error < 2e-2 * exact.abs().max(), (error, ref_error)


@pytest.mark.parametrize("name", ["decode 16", "spans"])
def test_over_an_fp8_cache_selection_and_attention_match_the_torch_path(name):
    """The same codes and scales through both paths; against the unquantized cache the fp8 rounding moves the
    output by a few percent of its size at most."""
    spans, decode = CASES[name]
    c, plain = release_case(spans, decode, seed=len(name), fp8=True), release_case(spans, decode, seed=len(name))
    got, want = select("triton", c), select("torch", c)
    same = [len(set(a.tolist()) & set(b.tolist())) / max(1, (b >= 0).sum().item()) for a, b in zip(got, want)]
    assert min(same) > 0.99 and torch.equal(got < 0, want < 0)
    out, ref = attend("triton", c, want), attend("torch", c, want)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    unquantized = attend("torch", {**plain, "q_latent": plain["q_latent"].float(),
                                   "latents": plain["latents"].float()}, want)
    assert (out.float() - unquantized).abs().max() < 0.1 * unquantized.abs().max()


def test_decode_step_replays_in_a_graph():
    c = release_case([(700 + 300 * i, 1) for i in range(4)], True, seed=3)
    pool_ids = select("triton", c)
    eager = attend("triton", c, pool_ids)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        select("triton", c), attend("triton", c, pool_ids)  # compiled before capture
        with torch.cuda.graph(graph, stream=side):
            ids = select("triton", c)
            out = attend("triton", c, ids)
    c["q_latent"].mul_(2)  # new inputs in the same buffers
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(ids, pool_ids)
    torch.testing.assert_close(out, attend("triton", c, pool_ids))
    assert not torch.equal(out, eager)
