"""DSA latent cache in fixed-size pages: the 512-d MLA latent per token and the indexer's pooled key per pool.

Pooled keys are computed once, when a pool's last token arrives, so decode never re-pools the past.
Pages are reference-counted: a full page of a cached prefix is read by every request that shares
that prefix (and held by the prefix cache), and returns to the free list when the last holder lets go.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig


class PagedLatents:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        if page_size % cfg.index_kpool:
            raise ValueError(f"page_size {page_size} must be a multiple of index_kpool {cfg.index_kpool}")
        n_dsa = len(cfg.dsa_layers)
        self.page_size, self.num_pages, self.kpool = page_size, num_pages, cfg.index_kpool
        # One page more than requests get: padding rows of a captured decode batch write there.
        self.scratch_page = num_pages
        rows = (num_pages + 1) * page_size
        self.latents = torch.zeros(n_dsa, rows, cfg.kv_lora_rank, dtype=dtype, device=device)
        self.pool_keys = torch.zeros(n_dsa, rows // cfg.index_kpool, cfg.index_head_dim, dtype=dtype, device=device)
        self._free = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def per_page_pools(self) -> int:
        return self.page_size // self.kpool

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"need {count} cache pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._refs[page] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """One more holder for each of these pages (they are not freed until it releases them too)."""
        for page in pages:
            self._refs[page] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one holder of each page; a page nobody holds any more is free."""
        for page in reversed(pages):
            self._refs[page] -= 1
            if not self._refs[page]:
                self._free.append(page)

    def holders(self, page: int) -> int:
        return self._refs[page]

    def page_latents(self, page: int) -> torch.Tensor:
        """View [n_dsa, page_size, kv_lora_rank] of one page's latents."""
        return self.latents[:, page * self.page_size:(page + 1) * self.page_size]

    def page_pool_keys(self, page: int) -> torch.Tensor:
        """View [n_dsa, page_size // kpool, index_head_dim] of one page's pooled keys."""
        per = self.per_page_pools
        return self.pool_keys[:, page * per:(page + 1) * per]

    def rows_at(self, page_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat row of each token position, batched: page_table [B, pages], positions [B, n] -> [B, n]."""
        return page_table.gather(1, positions // self.page_size) * self.page_size + positions % self.page_size

    def pool_rows_at(self, page_table: torch.Tensor, pools: torch.Tensor) -> torch.Tensor:
        """Flat row of each pool, batched: page_table [B, pages], pools [B, n] -> [B, n]."""
        per_page = self.per_page_pools
        return page_table.gather(1, pools // per_page) * per_page + pools % per_page
