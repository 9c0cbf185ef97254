"""DSA attention speed on CUDA: the indexer's selection and the sparse MLA, Triton against the torch path, at the
release's shapes (64 heads x 512 latent, indexer 32 x 128, kpool 4, 512 pools selected) on a paged cache.

Each case is one step of one DSA layer: a decode batch (one token per sequence, its page-table row per query),
or the spans of a prefill step (several sequences continuing at once, as a cached agent turn does). The time is
the median of one call (triton.testing.do_bench: the launches and the host work between them included, which
is what a prefill step pays). The roofline is the bytes a query must read once (its selected latent rows and
its sequence's pooled keys), over the measured device copy rate.

    python -m ops.bench_dsa       # decode B=1, 8, 64; spans 8 x 50 on 3,000; 1 x 2,048; B=1 at 32k, 128k; bf16, fp8
    python -m ops.bench_dsa --json /tmp/dsa.json
    python -m ops.bench_dsa --launches 32x32x8x3,64x16x8x3   # the prefill spans' attention at each tiling
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import triton

from engine.kernels.indexer import torch_ref as indexer_ref
from engine.kernels.indexer import triton_indexer
from engine.kernels.sparse_mla import torch_ref as mla_ref
from engine.kernels.sparse_mla import triton_sparse_mla
from engine.quant import FP8_CACHE_GROUP, quantize_fp8_groups
from ops.bench_engine import copy_bandwidth

HEADS, RANK, INDEX_HEADS, INDEX_DIM, KPOOL, SELECT, PAGE = 64, 512, 32, 128, 4, 512, 64
INDEXERS = {"triton": triton_indexer.index_select, "torch": indexer_ref.index_select}
ATTENTION = {"triton": triton_sparse_mla.sparse_mla, "torch": mla_ref.sparse_mla}


def release_case(spans: list[tuple[int, int]], decode: bool, dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0, fp8: bool = False) -> dict[str, Any]:
    """Inputs of one DSA layer's step for sequences of (cached, new) tokens on shuffled pages of one cache, at
    the release's shapes; `decode`: one page-table row per query (new = 1 each); `fp8`: the cache in e4m3 with
    its scales (as kv_cache_dtype="fp8" keeps it)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages_each = [-(-(cached + new) // PAGE) for cached, new in spans]
    order = torch.randperm(sum(pages_each) + 1, generator=g, device="cuda")
    width, tables, used = max(pages_each), [], 0
    for n_pages in pages_each:
        own = order[used:used + n_pages]
        used += n_pages
        tables.append(torch.cat([own, own[-1:].expand(width - n_pages)]))
    table = torch.stack(tables)
    rows = len(order) * PAGE
    seqs = torch.cat([torch.full((new,), i, device="cuda") for i, (_, new) in enumerate(spans)])
    positions = torch.cat([torch.arange(cached, cached + new, device="cuda") for cached, new in spans])
    n = len(positions)
    case = dict(
        latents=torch.randn(rows, RANK, generator=g, device="cuda").to(dtype),
        pool_keys=torch.randn(rows // KPOOL, INDEX_DIM, generator=g, device="cuda").to(dtype),
        q_latent=torch.randn(n, HEADS, RANK, generator=g, device="cuda").to(dtype),
        iq=torch.randn(n, INDEX_HEADS, INDEX_DIM, generator=g, device="cuda").to(dtype),
        iw=torch.randn(n, INDEX_HEADS, generator=g, device="cuda") * INDEX_HEADS ** -0.5,
        positions=positions, table=table[seqs] if decode else table, seqs=None if decode else seqs)
    case["n_pools"] = case["table"].shape[1] * PAGE // KPOOL if decode else max(c + w for c, w in spans) // KPOOL
    case["latent_scales"] = case["key_scales"] = None
    if fp8:
        case["latents"], case["latent_scales"] = quantize_fp8_groups(case["latents"])
        case["pool_keys"], case["key_scales"] = quantize_fp8_groups(case["pool_keys"])
    return case


def select(impl: str, c: dict[str, Any]) -> torch.Tensor:
    return INDEXERS[impl](c["iq"], c["iw"], c["pool_keys"], c["table"], c["seqs"], c["positions"], c["n_pools"],
                          PAGE // KPOOL, KPOOL, SELECT, key_scales=c["key_scales"])


def attend(impl: str, c: dict[str, Any], pool_ids: torch.Tensor, **launch: Any) -> torch.Tensor:
    return ATTENTION[impl](c["q_latent"], c["latents"], pool_ids, c["positions"], c["table"], c["seqs"], PAGE,
                           KPOOL, 256 ** -0.5, True, latent_scales=c["latent_scales"], **launch)


def step_bytes(spans: list[tuple[int, int]], itemsize: int, fp8: bool = False) -> int:
    """What the step must read once: each sequence's selected latent rows (at most its context) and pooled keys
    (in fp8: a byte an element and an fp32 scale a group); queries and outputs."""
    row, key = (RANK + 4 * RANK // FP8_CACHE_GROUP, INDEX_DIM + 4) if fp8 else (RANK * itemsize, INDEX_DIM * itemsize)
    total = 0
    for cached, new in spans:
        context = cached + new
        total += min(context, SELECT * KPOOL + KPOOL - 1) * row + context // KPOOL * key
        total += 2 * new * HEADS * RANK * itemsize
    return total


CASES = {
    "decode B=1 at 3,000": ([(3000, 1)], True),
    "decode B=8 at 3,000": ([(3000, 1)] * 8, True),
    "decode B=64 at 3,000": ([(3000, 1)] * 64, True),
    "spans 8 x 50 after 3,000": ([(3000, 50)] * 8, False),
    "span 1 x 2,048 fresh": ([(0, 2048)], False),
    "span 1 x 2,048 after 30,000": ([(30000, 2048)], False),
    "decode B=1 at 32,768": ([(32768, 1)], True),
    "decode B=1 at 131,072": ([(131072, 1)], True),
}


def bench(copy_gbps: float, caches: list[str]) -> list[dict[str, Any]]:
    """Each case with each cache (auto: bf16; fp8), Triton and, over the bf16 cache, the torch path."""
    rows = []
    for name, (spans, decode) in CASES.items():
        for cache in caches:
            fp8 = cache == "fp8"
            c = release_case(spans, decode, fp8=fp8)
            pool_ids = select("triton", c)
            for impl in ("triton",) if fp8 else ("triton", "torch"):
                select_us = triton.testing.do_bench(lambda: select(impl, c), return_mode="median") * 1e3
                attend_us = triton.testing.do_bench(lambda: attend(impl, c, pool_ids), return_mode="median") * 1e3
                roof_us = step_bytes(spans, 2, fp8) / copy_gbps / 1e3
                rows.append({"case": name, "cache": cache, "impl": impl, "select_us": round(select_us, 1),
                             "attend_us": round(attend_us, 1), "roofline_us": round(roof_us, 1),
                             "ratio": round((select_us + attend_us) / roof_us, 1)})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def parse_launch(text: str) -> triton_sparse_mla.MlaLaunch:
    """'HxNxWxS' -> heads a program, tokens an iteration, warps, stages."""
    block_h, block_n, warps, stages = (int(v) for v in text.split("x"))
    return triton_sparse_mla.MlaLaunch(block_h, block_n, warps, stages)


def sweep(copy_gbps: float, launches: list[triton_sparse_mla.MlaLaunch], caches: list[str]) -> list[dict[str, Any]]:
    """The spans cases' Triton attention at each tiling; `max_err` against the torch path's output."""
    rows = []
    for name, (spans, decode) in CASES.items():
        if decode:
            continue
        for cache in caches:
            c = release_case(spans, decode, fp8=cache == "fp8")
            pool_ids = select("triton", c)
            want = attend("torch", c, pool_ids).float()
            roof_us = step_bytes(spans, 2, cache == "fp8") / copy_gbps / 1e3
            for launch in launches:
                got = attend("triton", c, pool_ids, launch=launch).float()
                us = triton.testing.do_bench(lambda: attend("triton", c, pool_ids, launch=launch),
                                             return_mode="median") * 1e3
                rows.append({"case": name, "cache": cache, "launch": launch.__dict__, "attend_us": round(us, 1),
                             "roofline_us": round(roof_us, 1), "max_err": round((got - want).abs().max().item(), 4)})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows here too")
    parser.add_argument("--caches", type=lambda s: s.split(","), default=["auto", "fp8"])
    parser.add_argument("--launches", type=lambda s: [parse_launch(v) for v in s.split(",")],
                        help="time the spans cases' attention at these tilings (HxNxWxS, comma-separated) instead")
    args = parser.parse_args()
    copy_gbps = copy_bandwidth(torch.device("cuda"), 1 << 30)
    print(json.dumps({"copy_GBps": round(copy_gbps, 1)}), flush=True)
    rows = sweep(copy_gbps, args.launches, args.caches) if args.launches else bench(copy_gbps, args.caches)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_GBps": copy_gbps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
