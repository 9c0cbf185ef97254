"""KDA torch paths: chunked prefill == token recurrence == transformers' reference functions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.kda.torch_ref import ConvRows, kda_chunk, kda_step, short_conv, short_conv_varlen
from tests.engine.conftest import use_reference_kernels


def inputs(n: int, h: int = 3, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, d, generator=g, dtype=torch.float64) for _ in range(3))
    gate = -5.0 * torch.sigmoid(torch.randn(n, h, d, generator=g, dtype=torch.float64))
    beta = torch.sigmoid(torch.randn(n, h, generator=g, dtype=torch.float64))
    state = torch.randn(h, d, d, generator=g, dtype=torch.float64) * 0.1
    return q, k, v, gate, beta, state


def recurrence(q, k, v, g, beta, state):
    """The spec's per-token rule, written out plainly in float64."""
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    s, outs = state.clone(), []
    for t in range(q.shape[0]):
        s = s * g[t].exp().unsqueeze(-1)
        e = torch.einsum("hkv,hk->hv", s, k[t])
        s = s + k[t].unsqueeze(-1) * (beta[t].unsqueeze(-1) * (v[t] - e)).unsqueeze(-2)
        outs.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(outs), s


@pytest.mark.parametrize("n", [1, 5, 63, 64, 65, 150])
def test_chunk_equals_recurrence(n):
    q, k, v, g, beta, state = inputs(n, seed=n)
    want_o, want_s = recurrence(q, k, v, g, beta, state)
    o, s = kda_chunk(q, k, v, g, beta, state)
    assert torch.allclose(o.double(), want_o, rtol=1e-4, atol=1e-5)
    assert torch.allclose(s.double(), want_s, rtol=1e-4, atol=1e-5)


def test_step_equals_recurrence_batched():
    q, k, v, g, beta, state = inputs(4, seed=9)  # treat the 4 tokens as 4 requests
    states = torch.stack([state * (i + 1) for i in range(4)])
    o, s = kda_step(q, k, v, g, beta, states)
    for i in range(4):
        want_o, want_s = recurrence(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], states[i])
        assert torch.allclose(o[i].double(), want_o[0], rtol=1e-5, atol=1e-6)
        assert torch.allclose(s[i].double(), want_s, rtol=1e-5, atol=1e-6)


def test_chunk_matches_transformers_reference():
    from transformers.models.glm5_next import modeling_glm5_next as modeling

    use_reference_kernels()
    q, k, v, g, beta, state = (t.float() for t in inputs(100, seed=3))
    ref_o, ref_s = modeling.chunk_kimi_delta_attention(q[None], k[None], v[None], g[None], beta[None],
                                                       initial_state=state[None], output_final_state=True,
                                                       use_qk_l2norm_in_kernel=True)
    o, s = kda_chunk(q, k, v, g, beta, state)
    assert torch.allclose(o, ref_o[0], rtol=1e-4, atol=1e-5)
    assert torch.allclose(s, ref_s[0], rtol=1e-4, atol=1e-5)


def test_short_conv_prefill_then_steps():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 10, 6, generator=g)
    w = torch.randn(6, 4, generator=g)
    want = F.silu(F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), w.unsqueeze(1), groups=6)).transpose(1, 2)
    y, state = short_conv(x, torch.zeros(1, 6, 3), w)
    assert torch.allclose(y, want, atol=1e-6)
    y1, state1 = short_conv(x[:, :7], torch.zeros(1, 6, 3), w)
    pieces = [y1]
    for t in range(7, 10):
        yt, state1 = short_conv(x[:, t:t + 1], state1, w)
        pieces.append(yt)
    assert torch.allclose(torch.cat(pieces, 1), want, atol=1e-6)
    assert torch.equal(state1, state)


def test_short_conv_varlen_equals_each_sequence_alone():
    """A prefill step's spans in one conv: sequences shorter than the kernel (their new state still holds
    previous inputs) and a lone token among them."""
    g = torch.Generator().manual_seed(1)
    channels, width, lengths = 6, 4, [5, 1, 2, 9, 3]
    w = torch.randn(channels, width, generator=g)
    xs = [torch.randn(1, n, channels, generator=g) for n in lengths]
    states = torch.randn(len(lengths), channels, width - 1, generator=g)
    rows = ConvRows.of(lengths, width - 1, torch.device("cpu"))
    y, state = short_conv_varlen(torch.cat([x[0] for x in xs]), states, w, rows)
    alone = [short_conv(x, states[i:i + 1], w) for i, x in enumerate(xs)]
    assert torch.allclose(y, torch.cat([a[0][0] for a in alone]), atol=1e-6)
    assert torch.equal(state, torch.cat([a[1] for a in alone]))
