"""Absorbed sparse MLA == naive per-head MLA; indexer selection and the tail rule; mHC in float64."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.indexer.torch_ref import index_pool, index_select, top_pools
from engine.kernels.mhc.torch_ref import mhc_post, mhc_pre
from engine.kernels.sparse_mla.torch_ref import attended_tokens, sparse_mla


def unpaged(queries: int) -> torch.Tensor:
    """A page table whose one page holds the whole sequence, a row per query: rows are positions."""
    return torch.zeros(queries, 1, dtype=torch.long)


def attended(pool_ids: torch.Tensor, positions: torch.Tensor, kpool: int, with_tail: bool) -> list[list[int]]:
    tokens, valid = attended_tokens(pool_ids, positions, kpool, with_tail)
    return [sorted(row[ok].tolist()) for row, ok in zip(tokens, valid)]


def test_attended_tokens_pools_and_tail():
    # Query at position 10 (kpool 4): pool 2 (tokens 8..11) is not complete at 10, so it can't be chosen;
    # the tail is tokens 8, 9, 10.
    assert attended(torch.tensor([[0, -1]]), torch.tensor([10]), 4, with_tail=True) == [[0, 1, 2, 3, 8, 9, 10]]
    # Query at 11 completes pool 2: no tail; pool 2 appears only if selected.
    assert attended(torch.tensor([[2, 1]]), torch.tensor([11]), 4, with_tail=True) == [[4, 5, 6, 7, 8, 9, 10, 11]]
    # -1 entries never knock out a real selection of pool 0.
    assert attended(torch.tensor([[-1, 0, -1]]), torch.tensor([4]), 4, with_tail=False) == [[0, 1, 2, 3]]


def test_just_completed_pool_is_in_only_if_selected():
    """Query at 4p+3 completes pool p: no tail any more, so an unselected pool p is attended nowhere."""
    kpool, p = 4, 2
    position = torch.tensor([kpool * p + kpool - 1])
    # The indexer sees pools 0..p, all complete, but pool p scores lowest: the top 2 are pools 1 and 0.
    q, weights = torch.ones(1, 1, 1), torch.ones(1, 1)
    chosen = index_select(q, weights, torch.tensor([[2.0], [3.0], [1.0]]), unpaged(1), None, position, 3, 3,
                          kpool, select=2)
    assert sorted(chosen[0].tolist()) == [0, 1]
    assert attended(chosen, position, kpool, with_tail=True) == [list(range(kpool * p))]
    # sparse_mla: the latents of pool p do not reach the output.
    g = torch.Generator().manual_seed(4)
    n = kpool * (p + 1)
    q_latent, latents = torch.randn(1, 2, 8, generator=g), torch.randn(n, 8, generator=g)
    out = sparse_mla(q_latent, latents, chosen, position, unpaged(1), None, n, kpool, 0.5, True)
    changed = latents.clone()
    changed[kpool * p:] = torch.randn(kpool, 8, generator=g)
    assert torch.equal(out, sparse_mla(q_latent, changed, chosen, position, unpaged(1), None, n, kpool, 0.5, True))


def test_absorbed_equals_naive_mla():
    g = torch.Generator().manual_seed(0)
    t, h, dn, dv, r, n = 6, 3, 8, 5, 12, 30
    q = torch.randn(t, h, dn, generator=g, dtype=torch.float64)
    c = torch.randn(n, r, generator=g, dtype=torch.float64)
    w_uk = torch.randn(h, dn, r, generator=g, dtype=torch.float64)
    w_uv = torch.randn(h, dv, r, generator=g, dtype=torch.float64)
    positions = torch.arange(n - t, n)
    pools = torch.tensor([[0, 3, -1], [5, 1, 2], [6, -1, -1], [4, 0, 2], [1, 2, 3], [0, 6, 5]])
    o_lat = sparse_mla(torch.einsum("thd,hdr->thr", q, w_uk), c, pools, positions, unpaged(t), None, n, 4,
                       dn ** -0.5, True)
    ours = torch.einsum("thr,hvr->thv", o_lat, w_uv)
    keys, values = torch.einsum("nr,hdr->hnd", c, w_uk), torch.einsum("nr,hvr->hnv", c, w_uv)
    for i, sel in enumerate(attended(pools, positions, 4, True)):
        scores = torch.einsum("hd,hnd->hn", q[i], keys[:, sel]) * dn ** -0.5
        want = torch.einsum("hn,hnv->hv", scores.softmax(-1), values[:, sel])
        assert torch.allclose(ours[i], want, atol=1e-5)  # the op's softmax runs in fp32 by design


def test_index_select_picks_top_visible_pools():
    g = torch.Generator().manual_seed(1)
    t, heads, d, pools, kpool = 20, 4, 8, 12, 4
    q = torch.randn(t, heads, d, generator=g)
    w = torch.randn(t, heads, generator=g)
    keys = torch.randn(pools, d, generator=g)
    positions = torch.tensor([min(pools, i // 2) * kpool + i % kpool for i in range(t)])
    visible = (positions + 1) // kpool
    chosen = index_select(q, w, keys, unpaged(t), None, positions, pools, pools, kpool, select=5)
    assert chosen.shape == (t, 5)
    for i in range(t):
        scores = [(float((w[i] * torch.relu(q[i] @ keys[p] * d ** -0.5)).sum()), p) for p in range(int(visible[i]))]
        want = {p for _, p in sorted(scores, reverse=True)[:5]}
        got = {p for p in chosen[i].tolist() if p >= 0}
        assert got == want and (chosen[i] >= 0).sum() == min(5, int(visible[i]))


@pytest.mark.parametrize("select", [1, 7, 40])
def test_top_pools_is_a_stable_descending_sort(select):
    """The top-k over packed keys chooses, in order, what a stable descending sort of the scores chooses: exact ties
    (zeros of either sign, repeated values) break toward the earlier pool, negative, huge and infinite scores rank as
    floats do, and pools past a query's visible ones are never chosen."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(64, 40, generator=g)
    scores[scores.abs() < 0.6] = 0.0
    scores[:, ::5] = -0.0
    scores[:, 3::9] = 1.25
    scores[0, 4], scores[1, 6], scores[2, 8] = float("inf"), -1e30, torch.finfo(torch.float32).min
    visible = torch.randint(0, 41, (64,), generator=g)
    chosen = top_pools(scores, visible, select)
    for row, sees, got in zip(scores, visible.tolist(), chosen.tolist()):
        order = sorted(range(sees), key=lambda p: (-row[p].item(), p))[:select]
        assert got == order + [-1] * (min(select, 40) - len(order))


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
    norm = torch.rand(d, generator=g, dtype=torch.float64) + 0.5
    x, post, comb = mhc_pre(streams, fn, base, scale, norm, 1e-5, eps, 20)
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
    collapsed = (pre.unsqueeze(-1) * streams).sum(1)
    assert torch.allclose(x, norm * collapsed / torch.sqrt(collapsed.square().mean(-1, keepdim=True) + 1e-5), atol=tol)
    assert torch.allclose(post, want_post, atol=tol) and torch.allclose(comb, c, atol=tol)
    y = torch.randn(t, d, generator=g, dtype=torch.float64)
    out, partials = mhc_post(streams, y, post, comb, fn)
    assert partials is None  # the portable path's next mix reduces from the streams
    want = torch.stack([want_post[:, b, None] * y + sum(c[:, a, b, None] * streams[:, a] for a in range(s))
                        for b in range(s)], dim=1)
    assert torch.allclose(out, want, atol=tol)


@pytest.mark.parametrize("n_pools,select", [(5, 5), (3, 8)])
def test_a_row_that_may_choose_every_pool_chooses_each_complete_one_unscored(n_pools, select):
    """Where every pool fits the selection, index_select returns the pools complete before each query (the set the
    scores' top-k would choose, whatever the scores), -1 for the rest, without scoring them."""
    kpool, positions = 4, torch.tensor([0, 3, 6, 11, 19, 40])
    q, weights = torch.randn(6, 2, 8), torch.randn(6, 2)
    keys = torch.full((64, 8), float("nan"))  # never read: a scored row would carry NaN into its choice
    chosen = index_select(q, weights, keys, unpaged(6), None, positions, n_pools, n_pools, kpool, select=select)
    assert chosen.shape == (6, n_pools)
    visible = ((positions + 1) // kpool).clamp(max=n_pools)
    for row, sees in zip(chosen, visible.tolist()):
        want = top_pools(torch.randn(1, n_pools), torch.tensor([sees]), select)[0]
        assert sorted(row[row >= 0].tolist()) == sorted(want[want >= 0].tolist()) == list(range(sees))
        assert (row[sees:] == -1).all()
