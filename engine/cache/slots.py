"""Fixed-size state per request, one slot each: KDA recurrent + conv state and the indexer's open pool.

A KDA layer's state does not grow with the sequence (4 MiB fp32 per layer on the real model), so
it lives in slots rather than pages; a request takes a slot on admission and frees it on exit.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig


class RequestSlots:
    def __init__(self, cfg: ModelConfig, num_slots: int, device: torch.device, dtype: torch.dtype) -> None:
        h, d, k = cfg.linear_num_heads, cfg.linear_head_dim, cfg.conv_kernel
        n_kda, n_dsa = len(cfg.kda_layers), len(cfg.dsa_layers)
        self.num_slots = num_slots
        # One slot more than requests get: the scratch slot that padding rows of a captured decode
        # batch write into, so a graph of batch 8 can serve 5 requests without touching theirs.
        self.scratch_slot = num_slots
        rows = num_slots + 1
        self.recurrent = torch.zeros(n_kda, rows, h, d, d, dtype=torch.float32, device=device)
        self.conv = torch.zeros(n_kda, rows, 3 * cfg.linear_dim, k - 1, dtype=dtype, device=device)
        # Keys and gate logits of the tokens of the pool that is not complete yet, per DSA layer.
        self.open_pool = torch.zeros(n_dsa, rows, cfg.index_kpool, 2 * cfg.index_head_dim, dtype=dtype,
                                     device=device)
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free request slot")
        slot = self._free.pop()
        self.recurrent[:, slot].zero_()
        self.conv[:, slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)
