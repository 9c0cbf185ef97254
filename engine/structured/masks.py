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

    def start(self, seqs: list[Sequence],
              drafts: list[tuple[Sequence, tuple[int, ...]]] | None = None) -> MaskFill | None:
        """Begin filling the masks of the rows (one per seq, in logits order) whose next token is constrained, and
        of a verify's draft rows (`drafts`: the verifying requests, in the order their rows follow the seqs'):
        each of those masks the token after the drafts before it were taken."""
        draft_rows: dict[Sequence, list[int]] = {}
        row = len(seqs)
        for seq, made in drafts or ():
            draft_rows[seq], row = list(range(row, row + len(made))), row + len(made)
        drafted = dict(drafts or ())
        blocks = [(seq, drafted.get(seq, ()), [i] + draft_rows.get(seq, [])) for i, seq in enumerate(seqs)
                  if seq.constraint is not None and (seq.constraint.active or seq in drafted)]
        if not blocks:
            return None
        return MaskFill([row for _, _, rows in blocks for row in rows], self._thread.submit(self._fill, blocks))

    def _fill(self, blocks: list[tuple[Sequence, tuple[int, ...], list[int]]]) -> None:
        plain, along_drafts = [], []  # (matcher, its first bitmask row[, the drafts it takes along])
        at = 0
        for seq, drafts, rows in blocks:
            fixed, matcher_from = seq.constraint.draft_rows(drafts)
            for i in range(len(rows)):  # free unless a reasoning mask or the matcher below writes it
                self.bitmask[at + i] = fixed[i] if i < len(fixed) and fixed[i] is not None else -1
            if matcher_from is not None and drafts[matcher_from:]:
                along_drafts.append((seq.constraint.matcher, at + matcher_from, list(drafts[matcher_from:])))
            elif matcher_from is not None:
                plain.append((seq.constraint.matcher, at + matcher_from))
            at += len(rows)
        if plain or along_drafts:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            rows = self.bitmask[:at]  # whole rows of a contiguous int32 tensor in host memory
            if plain:
                self._executor.unsafe_compute_mask_ptr(plain, rows.data_ptr(), rows.shape[1] * 4, rows.shape[0])
            if along_drafts:  # each matcher steps along its drafts (while its masks allow them), then back
                self._executor.unsafe_compute_mask_ptr_with_draft_token(along_drafts, rows.data_ptr(),
                                                                         rows.shape[1] * 4, rows.shape[0])

    @torch.inference_mode()  # the logits are an inference tensor, updated in place
    def apply(self, logits: torch.Tensor, fill: MaskFill) -> None:
        """Mask `logits` [rows, V] (the step's, draft rows included) in place once the fill is done."""
        fill.filled.result()
        count = len(fill.rows)
        words = self.bitmask[:count].to(logits.device, non_blocking=True)
        self.row_index[:count] = torch.tensor(fill.rows)
        rows = self.row_index[:count].to(logits.device, non_blocking=True)
        allowed = ((words.unsqueeze(-1) >> self._shifts) & 1).view(count, -1)[:, :logits.shape[-1]].bool()
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
