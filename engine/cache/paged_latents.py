"""DSA latent cache in fixed-size pages: the 512-d MLA latent per token and the indexer's pooled key per pool.

Pooled keys are computed once, when a pool's last token arrives, so decode never re-pools the past.
Pages are reference-counted: a full page of a cached prefix is read by every request that shares
that prefix (and held by the prefix cache), and returns to the free list when the last holder lets go.

In the activation dtype, or in fp8 (e4m3) with an fp32 scale per group of a vector's elements (`fp8`): a
512-wide latent then takes 528 bytes a token and layer instead of 1,024 in bf16, and a pooled key 132 bytes a
pool instead of 256, so the same memory holds about twice the context. Vectors are quantized as they are
written, each on its own, and dequantized where the kernels read them.
"""

from __future__ import annotations

import math

import torch

from engine.config import ModelConfig
from engine.quant import FP8_CACHE_GROUP, quantize_fp8_groups


def scale_groups(width: int) -> int:
    """fp32 scales of a cached fp8 vector of `width` elements (a group of FP8_CACHE_GROUP, or the whole vector
    where it is narrower, as in the tiny model)."""
    return width // math.gcd(FP8_CACHE_GROUP, width)


def page_parts(cfg: ModelConfig, page_size: int, dtype: torch.dtype,
               fp8: bool = False) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors of one cache page, by name: their shapes [n_dsa, rows of the page, width] and dtypes."""
    n_dsa, pools = len(cfg.dsa_layers), page_size // cfg.index_kpool
    r, d = cfg.kv_lora_rank, cfg.index_head_dim
    if not fp8:
        return {"latents": ((n_dsa, page_size, r), dtype), "pool_keys": ((n_dsa, pools, d), dtype)}
    codes, scales = torch.float8_e4m3fn, torch.float32
    return {"latents": ((n_dsa, page_size, r), codes), "latent_scales": ((n_dsa, page_size, scale_groups(r)), scales),
            "pool_keys": ((n_dsa, pools, d), codes), "pool_key_scales": ((n_dsa, pools, scale_groups(d)), scales)}


class PagedLatents:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, device: torch.device,
                 dtype: torch.dtype, fp8: bool = False) -> None:
        if page_size % cfg.index_kpool:
            raise ValueError(f"page_size {page_size} must be a multiple of index_kpool {cfg.index_kpool}")
        self.page_size, self.num_pages, self.kpool = page_size, num_pages, cfg.index_kpool
        self.dtype, self.fp8 = dtype, fp8  # the activations' dtype: what is written and read
        # One page more than requests get: padding rows of a captured decode batch write there.
        self.scratch_page = num_pages
        self.parts = page_parts(cfg, page_size, dtype, fp8)
        self.tensors = {name: torch.zeros(n_dsa, (num_pages + 1) * rows, width, dtype=part_dtype, device=device)
                        for name, ((n_dsa, rows, width), part_dtype) in self.parts.items()}
        self.latents, self.pool_keys = self.tensors["latents"], self.tensors["pool_keys"]
        self.latent_scales = self.tensors.get("latent_scales")
        self.pool_key_scales = self.tensors.get("pool_key_scales")
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

    def page_views(self, page: int) -> dict[str, torch.Tensor]:
        """Views of one page in each of the cache's tensors (`parts`' names): latents [n_dsa, page_size,
        kv_lora_rank], pooled keys [n_dsa, page_size // kpool, index_head_dim], and their scales in fp8."""
        return {name: self.tensors[name][:, page * rows:(page + 1) * rows]
                for name, ((_, rows, _), _) in self.parts.items()}

    def write_latents(self, layer: int, rows: torch.Tensor, latents: torch.Tensor) -> None:
        """Latents [n, kv_lora_rank] of the tokens at cache rows `rows` [n]."""
        _write(self.latents, self.latent_scales, layer, rows, latents)

    def write_pool_keys(self, layer: int, rows: torch.Tensor, keys: torch.Tensor) -> None:
        """Pooled keys [n, index_head_dim] of the pools at pooled-key rows `rows` [n]."""
        _write(self.pool_keys, self.pool_key_scales, layer, rows, keys)

    def layer_latents(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One layer's latents [rows, kv_lora_rank] as the kernels read them, with their scales (None unscaled)."""
        return self.latents[layer], None if self.latent_scales is None else self.latent_scales[layer]

    def layer_pool_keys(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One layer's pooled keys [pool rows, index_head_dim], with their scales (None unscaled)."""
        return self.pool_keys[layer], None if self.pool_key_scales is None else self.pool_key_scales[layer]

    def rows_at(self, page_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat row of each token position, batched: page_table [B, pages], positions [B, n] -> [B, n]."""
        return page_table.gather(1, positions // self.page_size) * self.page_size + positions % self.page_size

    def pool_rows_at(self, page_table: torch.Tensor, pools: torch.Tensor) -> torch.Tensor:
        """Flat row of each pool, batched: page_table [B, pages], pools [B, n] -> [B, n]."""
        per_page = self.per_page_pools
        return page_table.gather(1, pools // per_page) * per_page + pools % per_page


def _write(values: torch.Tensor, scales: torch.Tensor | None, layer: int, rows: torch.Tensor,
           new: torch.Tensor) -> None:
    """`new` [n, width] into `values` at (layer, rows): as they are, or quantized with their scales (fp8)."""
    if scales is None:
        values[layer, rows] = new
    else:
        values[layer, rows], scales[layer, rows] = quantize_fp8_groups(new, new.shape[-1] // scales.shape[-1])
