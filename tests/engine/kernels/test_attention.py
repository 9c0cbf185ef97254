"""Absorbed sparse MLA == naive per-head MLA; indexer selection and the tail rule; mHC in float64."""

from __future__ import annotations

import torch

from engine.kernels.indexer.torch_ref import index_pool, index_select
from engine.kernels.mhc.torch_ref import mhc_post, mhc_pre
from engine.kernels.sparse_mla.torch_ref import selection_mask, sparse_mla


def test_selection_mask_pools_and_tail():
    # Query at position 10 (kpool 4): pools 0 and 2 chosen -> tokens 0-3 and 8-10 (8 is tail start? no: pool 2
    # = tokens 8..11 is not complete at t=10, so it can't be chosen; tail = tokens 8, 9, 10).
    mask = selection_mask(torch.tensor([[0, -1]]), torch.tensor([10]), 4, 11, with_tail=True)
    assert mask[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 8, 9, 10]
    # Query at 11 completes pool 2: no tail; pool 2 appears only if selected.
    mask = selection_mask(torch.tensor([[2, 1]]), torch.tensor([11]), 4, 12, with_tail=True)
    assert mask[0].nonzero().flatten().tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # -1 entries never knock out a real selection of pool 0.
    mask = selection_mask(torch.tensor([[-1, 0, -1]]), torch.tensor([4]), 4, 5, with_tail=False)
    assert mask[0].nonzero().flatten().tolist() == [0, 1, 2, 3]


def test_just_completed_pool_is_in_only_if_selected():
    """Query at 4p+3 completes pool p: no tail any more, so an unselected pool p is attended nowhere."""
    kpool, p = 4, 2
    position = torch.tensor([kpool * p + kpool - 1])
    # The indexer sees pools 0..p, all complete, but pool p scores lowest: the top 2 are pools 1 and 0.
    q, weights, visible = torch.ones(1, 1, 1), torch.ones(1, 1), (position + 1) // kpool
    chosen = index_select(q, weights, torch.tensor([[2.0], [3.0], [1.0]]), visible, select=2)
    assert sorted(chosen[0].tolist()) == [0, 1]
    mask = selection_mask(chosen, position, kpool, kpool * (p + 1), with_tail=True)
    assert mask[0].nonzero().flatten().tolist() == list(range(kpool * p))
    # sparse_mla: the latents of pool p do not reach the output.
    g = torch.Generator().manual_seed(4)
    q_latent, latents = torch.randn(1, 2, 8, generator=g), torch.randn(kpool * (p + 1), 8, generator=g)
    out = sparse_mla(q_latent, latents, chosen, position, kpool, 0.5, True)
    changed = latents.clone()
    changed[kpool * p:] = torch.randn(kpool, 8, generator=g)
    assert torch.equal(out, sparse_mla(q_latent, changed, chosen, position, kpool, 0.5, True))


def test_absorbed_equals_naive_mla():
    g = torch.Generator().manual_seed(0)
    t, h, dn, dv, r, n = 6, 3, 8, 5, 12, 30
    q = torch.randn(t, h, dn, generator=g, dtype=torch.float64)
    c = torch.randn(n, r, generator=g, dtype=torch.float64)
    w_uk = torch.randn(h, dn, r, generator=g, dtype=torch.float64)
    w_uv = torch.randn(h, dv, r, generator=g, dtype=torch.float64)
    positions = torch.arange(n - t, n)
    pools = torch.tensor([[0, 3, -1], [5, 1, 2], [6, -1, -1], [4, 0, 2], [1, 2, 3], [0, 6, 5]])
    o_lat = sparse_mla(torch.einsum("thd,hdr->thr", q, w_uk), c, pools, positions, 4, dn ** -0.5, True)
    ours = torch.einsum("thr,hvr->thv", o_lat, w_uv)
    mask = selection_mask(pools, positions, 4, n, True)
    keys, values = torch.einsum("nr,hdr->hnd", c, w_uk), torch.einsum("nr,hvr->hnv", c, w_uv)
    for i in range(t):
        sel = mask[i].nonzero().flatten()
        scores = torch.einsum("hd,hnd->hn", q[i], keys[:, sel]) * dn ** -0.5
        want = torch.einsum("hn,hnv->hv", scores.softmax(-1), values[:, sel])
        assert torch.allclose(ours[i], want, atol=1e-5)  # the op's softmax runs in fp32 by design


def test_index_select_picks_top_visible_pools():
    g = torch.Generator().manual_seed(1)
    t, heads, d, pools = 20, 4, 8, 12
    q = torch.randn(t, heads, d, generator=g)
    w = torch.randn(t, heads, generator=g)
    keys = torch.randn(pools, d, generator=g)
    visible = torch.tensor([min(pools, i // 2) for i in range(t)])
    chosen = index_select(q, w, keys, visible, select=5)
    assert chosen.shape == (t, 5)
    for i in range(t):
        scores = [(float((w[i] * torch.relu(q[i] @ keys[p] * d ** -0.5)).sum()), p) for p in range(int(visible[i]))]
        want = {p for _, p in sorted(scores, reverse=True)[:5]}
        got = {p for p in chosen[i].tolist() if p >= 0}
        assert got == want and (chosen[i] >= 0).sum() == min(5, int(visible[i]))


def test_index_pool_is_softmax_weighted_mean():
    g = torch.Generator().manual_seed(2)
    keys, gates, ape = torch.randn(3, 4, 8, generator=g), torch.randn(3, 4, 8, generator=g), torch.randn(4, 8, generator=g)
    want = torch.stack([(torch.softmax(gates[p] + ape, dim=0) * keys[p]).sum(0) for p in range(3)])
    assert torch.allclose(index_pool(keys, gates, ape), want, atol=1e-6)


def test_mhc_matches_float64_spec():
    g = torch.Generator().manual_seed(3)
    t, s, d = 5, 4, 16
    streams = torch.randn(t, s, d, generator=g, dtype=torch.float64)
    fn = torch.randn((2 + s) * s, s * d, generator=g, dtype=torch.float64) * 0.2
    base, scale = torch.randn((2 + s) * s, generator=g, dtype=torch.float64), torch.rand(3, generator=g, dtype=torch.float64) + 0.5
    eps = 1e-6
    x, post, comb = mhc_pre(streams, fn, base, scale, 1e-5, eps, 20)
    flat = streams.reshape(t, -1)
    m = (flat / torch.sqrt(flat.square().mean(-1, keepdim=True) + 1e-5)) @ fn.t()
    pre = torch.sigmoid(m[:, :s] * scale[0] + base[:s]) + eps
    want_post = 2 * torch.sigmoid(m[:, s:2 * s] * scale[1] + base[s:2 * s])
    c = torch.softmax((m[:, 2 * s:] * scale[2] + base[2 * s:]).view(t, s, s), dim=-1) + eps
    c = c / (c.sum(1, keepdim=True) + eps)  # columns first, then 19 x (rows, columns)
    for _ in range(19):
        c = c / (c.sum(2, keepdim=True) + eps)
        c = c / (c.sum(1, keepdim=True) + eps)
    tol = 1e-5  # the op computes the mixing weights in fp32 by design
    assert torch.allclose(x, (pre.unsqueeze(-1) * streams).sum(1), atol=tol)
    assert torch.allclose(post, want_post, atol=tol) and torch.allclose(comb, c, atol=tol)
    y = torch.randn(t, d, generator=g, dtype=torch.float64)
    out = mhc_post(streams, y, post, comb)
    want = torch.stack([want_post[:, b, None] * y + sum(c[:, a, b, None] * streams[:, a] for a in range(s))
                        for b in range(s)], dim=1)
    assert torch.allclose(out, want, atol=tol)
