"""One step's token masks for the whole batch: filled on the CPU while the forward pass runs, applied
to the logits where they are.

`start()` hands the constrained rows to a helper thread before the forward is launched; llguidance
computes the grammar rows in its own thread pool with the GIL released, so the masks are ready, or
nearly, when the logits are. (Its executor is called directly, as `llguidance.torch` does: importing that
module compiles a torch function, ~5 s of every process start.) `apply()` waits for them, copies the one
bitmask and the rows' index (pinned on CUDA, so the copies queue behind the forward instead of waiting
for it) to the logits' device, unpacks it there and sets the disallowed logits of those rows to -inf.
Rows without a constraint are not touched, so they keep the sampler's on-device fast path.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch

from engine.sequence import Sequence
from engine.structured.constraint import mask_words


@dataclass
class MaskFill:
    rows: list[int]  # logits rows, in bitmask order
    filled: Future


class GrammarMasks:
    def __init__(self, vocab_size: int, max_rows: int, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self.bitmask = torch.full((max_rows, mask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pinned)
        self.row_index = torch.zeros(max_rows, dtype=torch.int64, pin_memory=pinned)
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)
        self._executor: llguidance.LLExecutor | None = None  # llguidance's thread pool, made on first use
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="glmflash-masks")

    def start(self, seqs: list[Sequence]) -> MaskFill | None:
        """Begin filling the masks of the rows (one per seq, in logits order) whose next token is constrained."""
        rows = [i for i, seq in enumerate(seqs) if seq.constraint is not None and seq.constraint.active]
        if not rows:
            return None
        return MaskFill(rows, self._thread.submit(self._fill, [seqs[i] for i in rows]))

    def _fill(self, seqs: list[Sequence]) -> None:
        matchers = []
        for index, seq in enumerate(seqs):
            fixed = seq.constraint.fixed_mask
            if fixed is not None:
                self.bitmask[index] = fixed
            else:
                matchers.append((seq.constraint.matcher, index))
        if matchers:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            rows = self.bitmask[:len(seqs)]  # whole rows of a contiguous int32 tensor in host memory
            self._executor.unsafe_compute_mask_ptr(matchers, rows.data_ptr(), rows.shape[1] * 4, rows.shape[0])

    @torch.inference_mode()  # the logits are an inference tensor, updated in place
    def apply(self, logits: torch.Tensor, fill: MaskFill) -> None:
        """Mask `logits` [B, V] in place once the fill is done."""
        fill.filled.result()
        count = len(fill.rows)
        words = self.bitmask[:count].to(logits.device, non_blocking=True)
        self.row_index[:count] = torch.tensor(fill.rows)
        rows = self.row_index[:count].to(logits.device, non_blocking=True)
        allowed = ((words.unsqueeze(-1) >> self._shifts) & 1).view(count, -1)[:, :logits.shape[-1]].bool()
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
