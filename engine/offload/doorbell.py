"""A device stream rings a CPU thread for each MoE layer's host step, without the driver's host-function thread.

cuLaunchHostFunc hands a host step to the driver's own thread, which sleeps between calls: ~46 us a layer
on the H200 host. Here the stream writes a word of pinned memory, a listener thread (doorbell.c) that spins
between a step's layers runs the host step that word names and writes the answer the stream waits on. Both
are stream memory operations, captured into a decode graph like kernels (see kernels/experts/doorbell.c for
the protocol).
"""

from __future__ import annotations

import weakref

import torch

from engine.kernels.experts.cpu_gemv import arm_doorbell, close_doorbell, open_doorbell
from engine.offload.cuda_driver import wait_value, write_value

RING_WORD, DONE_WORD = 0, 16  # int32 offsets in `words`: each word on a cache line of its own


class Doorbell:
    def __init__(self, capacity: int, spin_ns: int, device: torch.device) -> None:
        """capacity: host steps it can name (indexes 0..capacity-1); spin_ns: how long the listener stays
        awake after a step."""
        self.capacity = capacity
        self.words = torch.zeros(32, dtype=torch.int32)
        if device.type == "cuda":  # device-mapped, for the stream's memory operations
            self.words = self.words.pin_memory()
        self.table = torch.zeros(capacity, dtype=torch.int64)  # host_step_args addresses, read by the listener
        self._ring, self._done = self.words[RING_WORD:].data_ptr(), self.words[DONE_WORD:].data_ptr()
        self._handle = open_doorbell(self._ring, self._done, self.table.data_ptr(), spin_ns)
        # Closed once nothing can ring it any more: the device work queued before has finished.
        self._closer = weakref.finalize(self, _close, self._handle, device, self.words, self.table)
        self._closer.atexit = False  # at exit the process takes the thread with it; CUDA may be gone already

    def name(self, index: int, args_address: int) -> None:
        """Host step `index` is the host_step_args at this address from now on."""
        if not 0 <= index < self.capacity:
            raise IndexError(f"doorbell: host step {index} outside 0..{self.capacity - 1}")
        self.table[index] = args_address

    def ring(self, stream: torch.cuda.Stream, index: int) -> None:
        """Queue on `stream`: run host step `index` on the listener, and wait until it has (the step's output
        is in place when the stream goes on)."""
        write_value(stream, self._done, 0)
        write_value(stream, self._ring, index + 1)
        wait_value(stream, self._done, index + 1)

    def arm(self) -> None:
        """A step that rings is about to run: the listener stops napping."""
        arm_doorbell(self._handle)

    def close(self) -> None:
        self._closer()


def _close(handle: int, device: torch.device, *keep: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    close_doorbell(handle)
