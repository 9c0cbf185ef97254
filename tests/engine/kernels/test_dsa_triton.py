"""Triton sparse MLA and indexer scores (run by Triton's interpreter on CPU) against the torch reference ops, on
a paged cache shared by several sequences: decode rows (one table row per query) and the spans of a step."""

from __future__ import annotations


import pytest
import torch

from engine.kernels.indexer import torch_ref as indexer_ref
from engine.kernels.indexer import triton_indexer
from engine.kernels.sparse_mla import torch_ref as mla_ref
from engine.kernels.sparse_mla import triton_sparse_mla
from engine.quant import quantize_fp8_groups
from tests.engine.kernels.sm90 import assert_compiles_for_sm90

KPOOL, PAGE = 4, 8


def paged_case(lengths: list[int], dtype: torch.dtype, heads: int, rank: int, select: int, seed: int):
    """Sequences of `lengths` tokens on shuffled pages of one cache; queries at each sequence's last few
    positions. -> latents, pool keys, page table, seqs, positions, q_latent, index q, index weights."""
    g = torch.Generator().manual_seed(seed)
    pages_each = [-(-n // PAGE) for n in lengths]
    order = torch.randperm(sum(pages_each) + 2, generator=g)  # two pages nobody holds
    width, tables, used = max(pages_each), [], 0
    for n_pages in pages_each:
        own = order[used:used + n_pages].tolist()
        used += n_pages
        tables.append(own + own[-1:] * (width - n_pages))
    rows = (len(order)) * PAGE
    latents = torch.randn(rows, rank, generator=g).to(dtype)
    pool_keys = torch.randn(rows // KPOOL, 32, generator=g).to(dtype)
    seqs = torch.cat([torch.full((min(n, 5),), i) for i, n in enumerate(lengths)])
    positions = torch.cat([torch.arange(max(0, n - 5), n) for n in lengths])
    q_latent = torch.randn(len(seqs), heads, rank, generator=g).to(dtype)
    iq = torch.randn(len(seqs), 8, 32, generator=g).to(dtype)
    iw = torch.randn(len(seqs), 8, generator=g)
    return latents, pool_keys, torch.tensor(tables), seqs, positions, q_latent, iq, iw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("as_decode", [False, True])
def test_index_select_matches_reference(dtype, as_decode):
    lengths = [3, 37, 70, 12]
    _, pool_keys, table, seqs, positions, _, iq, iw = paged_case(lengths, dtype, 4, 64, 8, seed=1)
    if as_decode:  # one page-table row per query, every pool of the row scored
        table, seqs, n_pools = table[seqs], None, table.shape[1] * PAGE // KPOOL
    else:
        n_pools = max(lengths) // KPOOL
    args = (iq, iw, pool_keys, table, seqs, positions, n_pools, PAGE // KPOOL, KPOOL, 6)
    got, want = triton_indexer.index_select(*args), indexer_ref.index_select(*args)
    assert got.shape == want.shape == (len(positions), 6)
    assert torch.equal(got, want)
    assert (got[positions < KPOOL - 1] == -1).all() and (got >= 0).any()


@pytest.mark.parametrize("as_decode", [False, True])
def test_index_select_skips_pool_blocks_a_query_cannot_see(as_decode):
    """Past 64 pools a short sequence's queries skip the blocks after their position (left unwritten, masked by the
    top-k): the same choice as the reference."""
    lengths = [300, 20]
    _, pool_keys, table, seqs, positions, _, iq, iw = paged_case(lengths, torch.float32, 4, 64, 8, seed=2)
    if as_decode:
        table, seqs, n_pools = table[seqs], None, table.shape[1] * PAGE // KPOOL
    else:
        n_pools = max(lengths) // KPOOL
    assert n_pools > triton_indexer.BLOCK_P
    args = (iq, iw, pool_keys, table, seqs, positions, n_pools, PAGE // KPOOL, KPOOL, 6)
    assert torch.equal(triton_indexer.index_select(*args), indexer_ref.index_select(*args))


def reference_inputs(dtype: torch.dtype, heads: int, select: int, seed: int, as_decode: bool):
    lengths = [3, 37, 70, 12]
    latents, pool_keys, table, seqs, positions, q_latent, iq, iw = paged_case(lengths, dtype, heads, 64, select,
                                                                            seed)
    n_pools = max(lengths) // KPOOL
    pool_ids = indexer_ref.index_select(iq, iw, pool_keys, table, seqs, positions, n_pools, PAGE // KPOOL, KPOOL,
                                        select)
    if as_decode:
        table, seqs = table[seqs], None
    return q_latent, latents, pool_ids, positions, table, seqs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("as_decode", [False, True])
@pytest.mark.parametrize("with_tail", [True, False])
@pytest.mark.parametrize("heads,select", [(4, 8), (40, 3)])
def test_sparse_mla_matches_reference(dtype, as_decode, with_tail, heads, select):
    q_latent, latents, pool_ids, positions, table, seqs = reference_inputs(dtype, heads, select, heads, as_decode)
    if not with_tail:  # every query must see something: keep those past their first pool
        keep = (positions + 1) // KPOOL > 0
        q_latent, pool_ids, positions = q_latent[keep], pool_ids[keep], positions[keep]
        table, seqs = (table[keep], None) if seqs is None else (table, seqs[keep])
    if as_decode:  # as the decode path's einsum leaves it: heads outermost in memory
        q_latent = q_latent.transpose(0, 1).contiguous().transpose(0, 1)
    args = (q_latent, latents, pool_ids, positions, table, seqs, PAGE, KPOOL, 0.125, with_tail)
    got, want = triton_sparse_mla.sparse_mla(*args), mla_ref.sparse_mla(*args)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # the reference rounds its scores to bf16 before the softmax; the kernel keeps them in fp32
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("block_h,block_n", [(64, 16), (16, 64)])
def test_sparse_mla_tilings_agree(block_h, block_n):
    """A launch's tiling (heads a program, tokens an iteration) changes the order of the sums, not the result:
    40 heads leave a part-filled head block, 16- and 64-token iterations cross pools and the tail."""
    q_latent, latents, pool_ids, positions, table, seqs = reference_inputs(torch.float32, 40, 3, 7, False)
    args = (q_latent, latents, pool_ids, positions, table, seqs, PAGE, KPOOL, 0.125, True)
    launch = triton_sparse_mla.MlaLaunch(block_h=block_h, block_n=block_n)
    got = triton_sparse_mla.sparse_mla(*args, launch=launch)
    torch.testing.assert_close(got, mla_ref.sparse_mla(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("as_decode", [False, True])
def test_index_select_over_an_fp8_cache_matches_reference(dtype, as_decode):
    """Pooled keys in e4m3 with a scale per 16 elements (two a key): the kernel dequantizes as it reads, scoring
    exactly as the reference over the dequantized keys, which are not the unquantized keys' choice everywhere."""
    lengths = [3, 37, 70, 12]
    _, pool_keys, table, seqs, positions, _, iq, iw = paged_case(lengths, dtype, 4, 64, 8, seed=1)
    codes, scales = quantize_fp8_groups(pool_keys, 16)
    if as_decode:
        table, seqs, n_pools = table[seqs], None, table.shape[1] * PAGE // KPOOL
    else:
        n_pools = max(lengths) // KPOOL
    args = (iq, iw, codes, table, seqs, positions, n_pools, PAGE // KPOOL, KPOOL, 6)
    got = triton_indexer.index_select(*args, key_scales=scales)
    want = indexer_ref.index_select(*args, key_scales=scales)
    assert torch.equal(got, want)
    dequantized = (codes.float().unflatten(-1, (2, 16)) * scales.unsqueeze(-1)).flatten(-2).to(dtype)
    assert torch.equal(want, indexer_ref.index_select(iq, iw, dequantized, *args[3:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("as_decode", [False, True])
def test_sparse_mla_over_an_fp8_cache_matches_reference(dtype, as_decode):
    """Latents in e4m3 with a scale per 16 of their 64 elements: the kernel against the reference over the same
    codes, and the reference against itself over the dequantized latents (the scales applied per group)."""
    q_latent, latents, pool_ids, positions, table, seqs = reference_inputs(dtype, 4, 8, 3, as_decode)
    codes, scales = quantize_fp8_groups(latents, 16)
    args = (q_latent, codes, pool_ids, positions, table, seqs, PAGE, KPOOL, 0.125, True)
    got = triton_sparse_mla.sparse_mla(*args, latent_scales=scales)
    want = mla_ref.sparse_mla(*args, latent_scales=scales)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    dequantized = (codes.float().unflatten(-1, (4, 16)) * scales.unsqueeze(-1)).flatten(-2).to(dtype)
    assert torch.equal(want, mla_ref.sparse_mla(q_latent, dequantized, *args[2:]))
    assert not torch.equal(want, mla_ref.sparse_mla(q_latent, latents, *args[2:]))  # the codes are not the values


def test_sparse_mla_split_and_whole_agree(monkeypatch):
    """Few queries spread their selected tokens over programs and combine; many queries run each whole."""
    q_latent, latents, pool_ids, positions, table, seqs = reference_inputs(torch.float32, 4, 8, 7, False)
    args = (q_latent, latents, pool_ids, positions, table, seqs, PAGE, KPOOL, 0.125, True)
    assert triton_sparse_mla._splits(len(positions), 1, 35, 32) > 1
    split = triton_sparse_mla.sparse_mla(*args)
    monkeypatch.setattr(triton_sparse_mla, "MAX_SPLITS", 1)
    whole = triton_sparse_mla.sparse_mla(*args)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)


COMPILE_FOR_SM90 = """
import itertools
from engine.kernels.indexer.triton_indexer import _pool_scores_kernel
from engine.kernels.sparse_mla.triton_sparse_mla import _combine_kernel, _sparse_mla_kernel

index = dict(q_ptr="*bf16", pool_ptr="*i64", pos_ptr="*i64", table_ptr="*i64", seq_ptr="*i64")
for seqs, split, fp8 in itertools.product((True, False), repeat=3):  # fp8: the cache in e4m3 with fp32 scales
    out = "*fp32" if split else "*bf16"
    cache = dict(lat_ptr="*fp8e4nv", lat_scale_ptr="*fp32") if fp8 else dict(lat_ptr="*bf16", lat_scale_ptr="*bf16")
    compile_for_sm90(_sparse_mla_kernel, {**index, **cache, "out_ptr": out, "m_ptr": "*fp32", "l_ptr": "*fp32"},
                     dict(R=512, KPOOL=4, BLOCK_H=32, BLOCK_N=32, HAS_SEQS=seqs, SPLIT=split, DOT_F32=False,
                          SCALE_GROUPS=4 if fp8 else 0, PIPELINED=True), 8, dict(scale="fp32"))
    keys = dict(keys_ptr="*fp8e4nv", key_scale_ptr="*fp32") if fp8 else dict(keys_ptr="*bf16", key_scale_ptr="*bf16")
    compile_for_sm90(_pool_scores_kernel, {**index, **keys, "w_ptr": "*fp32", "out_ptr": "*fp32"},
                     dict(D=128, KPOOL=4, BLOCK_HI=32, BLOCK_P=64, HAS_SEQS=seqs, DOT_F32=False,
                          SCALE_GROUPS=1 if fp8 else 0), 4, dict(scale="fp32"))
compile_for_sm90(_combine_kernel, {"part_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "out_ptr": "*bf16"},
                 dict(R=512, SPLITS=32), 4)
print("compiled")
"""


def test_the_kernels_compile_for_sm90_at_the_release_shapes(tmp_path):
    """The interpreter takes code the compiler rejects (a tl.where between two boolean tensors broke a layout
    pass): every build the release serves (spans and decode rows, split or whole) compiles for sm_90, no GPU."""
    assert_compiles_for_sm90(COMPILE_FOR_SM90, tmp_path)
