"""Triton routed-expert kernels at GLM-5.3-Flash shapes on CUDA against TorchExperts (runs only where a GPU is)."""

from __future__ import annotations

import pytest
import torch

from engine.experts import TorchExperts, TritonExperts
from engine.kernels.experts import moe_decode
from engine.weights import DenseWeight, Nvfp4Weight

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]

D, I, E, K, LIMIT = 4096, 2048, 288, 8, 10.0
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}


def nvfp4_stack(rows: int, cols: int, g: torch.Generator, per_row_global: bool = False) -> Nvfp4Weight:
    """Random codes (every code present), e4m3 scales in [0.5, 4), globals around 1e-3."""
    packed = torch.randint(0, 256, (E, rows, cols // 2), dtype=torch.uint8, device="cuda", generator=g)
    scale = torch.randint(0x30, 0x48, (E, rows, cols // 16), dtype=torch.uint8, device="cuda", generator=g)
    glob = torch.rand(E, rows if per_row_global else 1, device="cuda", generator=g) * 1e-3 + 5e-4
    return Nvfp4Weight(packed, scale.view(torch.float8_e4m3fn), glob)


@pytest.fixture(scope="module")
def nvfp4_layers():
    g = torch.Generator(device="cuda").manual_seed(0)
    return {0: (nvfp4_stack(I, D, g), nvfp4_stack(I, D, g), nvfp4_stack(D, I, g)),
            1: (nvfp4_stack(I, D, g, True), nvfp4_stack(I, D, g, True), nvfp4_stack(D, I, g, True))}


def routes(tokens: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    weights, ids = torch.rand(tokens, experts, device="cuda", generator=g).topk(K, dim=1)
    return ids, weights / weights.sum(1, keepdim=True)


def poison_allocator() -> None:
    """Fill freed cached blocks with NaN, so any output element a kernel fails to write shows up."""
    torch.empty(3 << 28, dtype=torch.float32, device="cuda").fill_(float("nan"))


def check(layers: dict, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> None:
    want = TorchExperts(layers, LIMIT)(layer, x, ids, w)
    poison_allocator()
    got = TritonExperts(layers, LIMIT)(layer, x, ids, w)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert not got.isnan().any()
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < TOL[x.dtype]


@pytest.mark.parametrize("layer", [0, 1], ids=["global-per-expert", "global-per-row"])
# 16 x 8 pairs is the last decode size; 8,192 tokens (227 pairs an expert) take 128-row blocks, the weights first
@pytest.mark.parametrize("tokens", [1, 2, 4, 8, 16, 64, 2048, 8192])
def test_nvfp4_bf16(nvfp4_layers, tokens, layer):
    ids, w = routes(tokens, E, tokens)
    x = torch.randn(tokens, D, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)).bfloat16()
    check(nvfp4_layers, layer, x, ids, w)


@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_nvfp4_fp32_and_saturated_clamp(nvfp4_layers, tokens):
    ids, w = routes(tokens, E, tokens)
    x = torch.randn(tokens, D, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    gate_rows = nvfp4_layers[0][0][ids[0]].dequantize(torch.float32)
    x *= 3 * LIMIT / (gate_rows @ x[0]).std()  # gate spread 3x the limit: about a third of it saturates
    assert ((gate_rows @ x[0]) > LIMIT).float().mean() > 0.2
    check(nvfp4_layers, 0, x, ids, w)


@pytest.mark.parametrize("tokens", [16, 2048])
def test_one_expert_for_all_tokens_and_empty_experts(nvfp4_layers, tokens):
    ids, w = routes(tokens, 11, tokens)
    ids += 1  # experts 1..11 only
    ids[:, 1:][ids[:, 1:] == 11] = 0
    ids[:, 0] = 11  # every token on expert 11, in slot 0; each row's experts stay distinct
    x = torch.randn(tokens, D, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3)).bfloat16()
    check(nvfp4_layers, 0, x, ids, w)


@pytest.mark.parametrize("tokens", [1, 16, 64, 2048])
def test_dense_bf16(tokens):
    g = torch.Generator(device="cuda").manual_seed(4)
    experts = 32
    layers = {0: tuple(DenseWeight((torch.randn(experts, n, k, device="cuda", generator=g) / k**0.5).bfloat16())
                       for n, k in ((I, D), (I, D), (D, I)))}
    ids, w = routes(tokens, experts, tokens)
    check(layers, 0, torch.randn(tokens, D, device="cuda", generator=g).bfloat16(), ids, w)


def test_decode_replays_from_a_cuda_graph(nvfp4_layers):
    gate, up, down = nvfp4_layers[0]
    x = torch.randn(4, D, device="cuda").bfloat16()
    ids, w = routes(4, E, 5)
    eager = moe_decode(x, ids, w, gate, up, down, LIMIT)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_decode(x, ids, w, gate, up, down, LIMIT)
    new_ids, new_w = routes(4, E, 6)
    x.copy_(torch.randn_like(x))
    ids.copy_(new_ids)
    w.copy_(new_w)
    graph.replay()
    assert torch.equal(captured, moe_decode(x, ids, w, gate, up, down, LIMIT))
    assert not torch.equal(captured, eager)


@pytest.mark.parametrize("tokens", [1, 4])
def test_pairs_of_weight_zero_read_nothing_and_replay(nvfp4_layers, tokens):
    """A hybrid step's shape: about a quarter of the pairs weighted zero (their experts elsewhere), pointed at an
    expert whose global is NaN here: they add nothing and read nothing, eagerly and replayed from a graph whose
    dead pairs move; a token without a live pair (the last of four) gets zeros."""
    gate, up, down = nvfp4_layers[0]
    nan = down.global_scale.clone()
    nan[0] = float("nan")
    poisoned = Nvfp4Weight(down.packed, down.scale, nan)

    def dead(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, w = routes(tokens, E - 1, seed)
        ids += 1  # expert 0 only where the pair is dead
        drop = torch.rand(ids.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)) < 0.3
        drop[-1] |= tokens > 1  # the last of several tokens has no live pair
        ids[drop], w[drop] = 0, 0
        return ids, w

    x = torch.randn(tokens, D, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7)).bfloat16()
    ids, w = dead(8)
    want = TorchExperts({0: (gate, up, down)}, LIMIT)(0, x, ids, w)
    got = moe_decode(x, ids, w, gate, up, poisoned, LIMIT)
    assert not got.isnan().any() and (tokens == 1 or not got[-1].any())
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < TOL[x.dtype]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_decode(x, ids, w, gate, up, poisoned, LIMIT)
    new_ids, new_w = dead(9)
    ids.copy_(new_ids)
    w.copy_(new_w)
    graph.replay()
    assert torch.equal(captured, moe_decode(x, ids, w, gate, up, poisoned, LIMIT))
    want = TorchExperts({0: (gate, up, down)}, LIMIT)(0, x, ids, w)
    assert ((captured.float() - want.float()).norm() / want.float().norm()).item() < TOL[x.dtype]
