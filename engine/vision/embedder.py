"""Image embeddings for prefill steps: each image runs through the vision tower once, in the first step that
reaches its tokens (the step's new images packed into one tower call), and its embeddings are kept until the
step that runs its last token; a prompt chunked across steps takes each chunk's rows from them.

Kept per request, weakly: a request that leaves (finished, aborted) takes its images' embeddings with it. A
request that starts over (preempted) finds them dropped once used and runs the tower again.
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

import torch

from engine.model.vision import VisionTower
from engine.sequence import Sequence
from engine.vision.placement import PlacedImage


class ImageEmbedder:
    def __init__(self, tower: VisionTower, device: torch.device) -> None:
        self.tower, self.device = tower, device
        self._kept: WeakKeyDictionary[Sequence, dict[int, torch.Tensor]] = WeakKeyDictionary()  # by image start

    def rows(self, pieces: list[tuple[Sequence, int, int, int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`pieces`: (request, first position, tokens, flat row of the first) of a step. Returns the flat rows of
        the image tokens among them and their embeddings [rows, out_hidden]; None when there are none."""
        wanted = [(seq, start, count, offset, seq.images_in(start, start + count)) for seq, start, count, offset in pieces]
        self._encode([(seq, image) for seq, _, _, _, images in wanted for image in images
                      if image.start not in self._kept.get(seq, {})])
        rows: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for seq, start, count, offset, images in wanted:
            for image in images:
                lo, hi = max(start, image.start), min(start + count, image.end)
                kept = self._kept[seq]
                rows.append(torch.arange(offset + lo - start, offset + hi - start))
                values.append(kept[image.start][lo - image.start:hi - image.start])
                if hi == image.end:  # its last token runs in this step
                    del kept[image.start]
        if not rows:
            return None
        return torch.cat(rows).to(self.device), torch.cat(values)

    def _encode(self, images: list[tuple[Sequence, PlacedImage]]) -> None:
        if not images:
            return
        pixels = torch.cat([placed.image.pixel_values for _, placed in images]).to(self.device, non_blocking=True)
        out = self.tower(pixels, [placed.image.grid_thw for _, placed in images])
        for (seq, placed), embeds in zip(images, out.split([placed.image.num_tokens for _, placed in images])):
            self._kept.setdefault(seq, {})[placed.start] = embeds
