"""DSA attention speed on CUDA: the indexer's selection and the sparse MLA, Triton against the torch path, at the
release's shapes (64 heads x 512 latent, indexer 32 x 128, kpool 4, 512 pools selected) on a paged cache.

Each case is one step of one DSA layer: a decode batch (one token per sequence, its page-table row per query),
or the spans of a prefill step (several sequences continuing at once, as a cached agent turn does). The time is
the median of one call (triton.testing.do_bench: the launches and the host work between them included, which
is what a prefill step pays). The roofline is the bytes a query must read once (its selected latent rows and
its sequence's pooled keys), over the measured device copy rate.

    python -m ops.bench_dsa                        # decode B=1, 8, 64; spans 8 x 50 on 3,000; 1 x 2,048
    python -m ops.bench_dsa --json /tmp/dsa.json
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
from ops.bench_engine import copy_bandwidth

HEADS, RANK, INDEX_HEADS, INDEX_DIM, KPOOL, SELECT, PAGE = 64, 512, 32, 128, 4, 512, 64
INDEXERS = {"triton": triton_indexer.index_select, "torch": indexer_ref.index_select}
ATTENTION = {"triton": triton_sparse_mla.sparse_mla, "torch": mla_ref.sparse_mla}


def release_case(spans: list[tuple[int, int]], decode: bool, dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0) -> dict[str, Any]:
    """Inputs of one DSA layer's step for sequences of (cached, new) tokens on shuffled pages of one cache, at
    the release's shapes; `decode`: one page-table row per query (new = 1 each)."""
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
    return case


def select(impl: str, c: dict[str, Any]) -> torch.Tensor:
    return INDEXERS[impl](c["iq"], c["iw"], c["pool_keys"], c["table"], c["seqs"], c["positions"], c["n_pools"],
                          PAGE // KPOOL, KPOOL, SELECT)


def attend(impl: str, c: dict[str, Any], pool_ids: torch.Tensor) -> torch.Tensor:
    return ATTENTION[impl](c["q_latent"], c["latents"], pool_ids, c["positions"], c["table"], c["seqs"], PAGE,
                           KPOOL, 256 ** -0.5, True)


def step_bytes(spans: list[tuple[int, int]], itemsize: int) -> int:
    """What the step must read once: each sequence's selected latent rows (at most its context) and pooled keys;
    queries and outputs."""
    total = 0
    for cached, new in spans:
        context = cached + new
        total += min(context, SELECT * KPOOL + KPOOL - 1) * RANK * itemsize + context // KPOOL * INDEX_DIM * itemsize
        total += 2 * new * HEADS * RANK * itemsize
    return total


CASES = {
    "decode B=1 at 3,000": ([(3000, 1)], True),
    "decode B=8 at 3,000": ([(3000, 1)] * 8, True),
    "decode B=64 at 3,000": ([(3000, 1)] * 64, True),
    "spans 8 x 50 after 3,000": ([(3000, 50)] * 8, False),
    "span 1 x 2,048 fresh": ([(0, 2048)], False),
    "span 1 x 2,048 after 30,000": ([(30000, 2048)], False),
}


def bench(copy_gbps: float) -> list[dict[str, Any]]:
    rows = []
    for name, (spans, decode) in CASES.items():
        c = release_case(spans, decode)
        pool_ids = select("torch", c)
        for impl in ("triton", "torch"):
            select_us = triton.testing.do_bench(lambda: select(impl, c), return_mode="median") * 1e3
            attend_us = triton.testing.do_bench(lambda: attend(impl, c, pool_ids), return_mode="median") * 1e3
            roof_us = step_bytes(spans, 2) / copy_gbps / 1e3
            rows.append({"case": name, "impl": impl, "select_us": round(select_us, 1),
                         "attend_us": round(attend_us, 1), "roofline_us": round(roof_us, 1),
                         "ratio": round((select_us + attend_us) / roof_us, 1)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    copy_gbps = copy_bandwidth(torch.device("cuda"), 1 << 30)
    print(json.dumps({"copy_GBps": round(copy_gbps, 1)}), flush=True)
    rows = bench(copy_gbps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_GBps": copy_gbps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
