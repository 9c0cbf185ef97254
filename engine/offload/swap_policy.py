"""Which host experts move into which device slots: decayed routing counts and the moves they ask for.

The steps add each (token, expert) pair to its layer's counts on the device; between steps the counts are read
back and a layer's hottest outside expert takes its coldest resident's slot when it is routed clearly more
often (SWAP_MARGIN and SWAP_Z), one move at a time per layer while it has a spare host entry. Performing a move
(the copies, the maps) is experts/hybrid.py's.
"""

from __future__ import annotations

import math

import torch

# An outside expert takes a resident's slot only when its decayed count beats the resident's by this factor:
# near the cut of the hottest, counts trade places all the time, and each swap moves two experts (over PCIe
# and through host memory, beside the CPU experts' reads) for a gain of noise.
SWAP_MARGIN = 1.25
# ... and by this many standard deviations of the difference two equally routed experts' counts would show
# (counts of routing events: variance ~ count). Under uniform routing the hottest outside expert always beat the
# coldest resident by the margin on noise alone: 4 swaps a step of churn, each moving two experts over the link
# and costing the host its commit between steps. The extremes of ~90 outside and ~200 resident counts sit ~5
# standard deviations apart by chance, so it takes 3 here, and counts that decay slowly (COUNT_DECAY) so that real
# differences, which grow with the counts faster than the noise, pass it (simulated: ops/sim_swaps.py).
SWAP_Z = 3.0
COUNT_DECAY = 0.998  # per step: routing counts remember ~500 steps

Move = tuple[int, int, int]  # (layer row of the counts, incoming expert, outgoing expert)


def pick_moves(counts: torch.Tensor, hosted: torch.Tensor, busy: torch.Tensor, open_layers: torch.Tensor,
               margin: float, z: float) -> list[Move]:
    """counts: [L, E] on the CPU; hosted: [L, E] whether the expert is in the host bank (else in a slot); busy:
    [L, E] experts in a move under way (neither moves again until it is committed); open_layers: [L] whether
    the layer has a spare host entry -> per open layer, its hottest outside expert for its coldest resident where
    the first beats the second by `margin` and by `z` standard deviations, largest count gain first (ties in
    layer order). Tensor ops over every layer at once: a sort per layer took ~0.6 ms at 45 layers, between two
    steps."""
    on_host = counts.masked_fill(~hosted | busy, -math.inf)
    on_device = counts.masked_fill(hosted | busy, math.inf)
    incoming, outgoing = on_host.argmax(1), on_device.argmin(1)  # (max(dim) took ~8 ms on 2 threads)
    c_in, c_out = on_host.gather(1, incoming[:, None])[:, 0], on_device.gather(1, outgoing[:, None])[:, 0]
    gain = c_in - c_out
    worth = open_layers & (c_in > c_out * margin) & (gain * gain > z * z * (c_in + c_out))
    chosen = worth.nonzero().flatten()
    chosen = chosen[torch.argsort(gain[chosen], descending=True, stable=True)].tolist()
    return [(i, int(incoming[i]), int(outgoing[i])) for i in chosen]


class SwapPolicy:
    """The routing counts of every MoE layer (on the device, where the steps add to them in place) and the
    moves they ask for, decided on a CPU copy between steps."""

    def __init__(self, layers: int, experts: int, device: torch.device, decay: float = COUNT_DECAY,
                 margin: float = SWAP_MARGIN, z: float = SWAP_Z) -> None:
        self.counts = torch.zeros(layers, experts, device=device)
        self.decay, self.margin, self.z = decay, margin, z

    def age(self) -> None:
        """One step's decay, with nothing read back from the device (swaps off)."""
        self.counts *= self.decay

    def read(self) -> torch.Tensor:
        """The counts on the CPU (the copy waits for the steps queued so far), then aged one step. Without a GPU
        `.cpu()` hands back the live tensor itself, aged with it (no copy made)."""
        counts = self.counts.cpu()
        self.age()
        return counts

    def moves(self, counts: torch.Tensor, hosted: torch.Tensor, busy: torch.Tensor, open_layers: torch.Tensor,
              limit: int) -> list[Move]:
        """Up to `limit` of the moves worth their copies (`pick_moves` under the margin and z)."""
        return pick_moves(counts, hosted, busy, open_layers, self.margin, self.z)[:limit]

    @staticmethod
    def every_move(counts: torch.Tensor, hosted: torch.Tensor, busy: torch.Tensor,
                   open_layers: torch.Tensor) -> list[Move]:
        """Every move towards the counts' hottest experts, however small its gain: a calibration's placement,
        settled exactly while no step runs."""
        return pick_moves(counts, hosted, busy, open_layers, 1.0, 0.0)
