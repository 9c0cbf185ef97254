"""The CPU's share of hybrid decode steps, queued in the device's stream so a step stays one CUDA graph.

Per MoE layer the device writes the step's rows, top-k ids and routing weights into pinned buffers (one kernel),
rings a listener thread (offload/doorbell.py; a CUDA host function where the driver lacks stream memory
operations) that runs cpu_gemv.c's `host_step`, the pairs whose experts live in the host bank, on CPU
threads, and the sum comes back. All of it is queued on a side stream that forks from the device
stream after the router and joins before the layer's output is used, so the device's resident
experts run while the CPU works, and neither Python nor a device synchronization sits inside the
step. The same code runs eagerly and under capture; on a machine without a GPU the host step simply
runs in place.

Layers run one after another (each waits for the previous one's output), so one set of pinned
buffers and one workspace serve every layer: a layer's inputs are written only after the previous
layer's host step has finished and its output has been copied back.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from engine.kernels import kernel
from engine.kernels.experts.cpu_gemv import ExpertStacks, HostStepArgs, fp8_table, host_step_function, run_host_step, \
    simd_level
from engine.offload.cuda_driver import copy_async, launch_host_func, memory_operations_available
from engine.offload.doorbell import Doorbell

SPIN_NS = 2_000_000  # longer than the device's share of a layer, shorter than a pause between requests
HANDSHAKES = ("doorbell", "host_function")


@dataclass
class HostStepTotals:
    """Since start: steps, (token, expert) pairs seen, missed (in the host bank) and run on the CPU (the rest
    of the missed went over PCIe), experts the CPU read (whole or in part), parts of those the device ran (of a
    split expert), seconds it spent."""

    steps: int = 0
    pairs_seen: int = 0
    pairs_missed: int = 0
    pairs_run: int = 0
    experts_run: int = 0
    units_left: int = 0
    seconds: float = 0.0


class HostSteps:
    def __init__(self, stacks: dict[int, ExpertStacks], cpu_entry: dict[int, torch.Tensor], topk: int,
                 limit: float, threads: int, device: torch.device, max_rows: int,
                 pcie: tuple[int, int, int] = (0, 0, 1), handshake: str = "doorbell") -> None:
        """stacks: each layer's host bank; cpu_entry: each layer's expert -> bank entry map ([E] int64 on the
        CPU, -1 for experts on the device), read at every step (changed in place between steps); pcie:
        (percent, capacity, split units) of the misses the device takes over PCIe (cpu_gemv.c's rule, the parts
        of kernels/experts/pcie_pick.py), which these skip;
        handshake: how the device hands a layer to the CPU (HANDSHAKES; the doorbell falls back to a host
        function where the driver lacks stream memory operations)."""
        if handshake not in HANDSHAKES:
            raise ValueError(f"handshake must be one of {HANDSHAKES}, got {handshake!r}")
        self.stacks, self.cpu_entry = stacks, cpu_entry
        self.topk, self.limit, self.threads, self.device, self.max_rows = topk, limit, threads, device, max_rows
        self.pcie = pcie
        first = next(iter(stacks.values()))
        hidden, inter = first.hidden, first.inter
        pin = device.type == "cuda"
        pairs = max_rows * topk

        def host(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            t = torch.zeros(shape, dtype=dtype)
            return t.pin_memory() if pin else t

        with torch.inference_mode(False):  # written in place later, also outside inference mode
            self.x, self.out = host(max_rows, hidden), host(max_rows, hidden)
            self.ids, self.weights = host(max_rows, topk, dtype=torch.int64), host(max_rows, topk)
            self.workspace = torch.empty(pairs * (1 + 3 * hidden + 3 * inter) + 1, dtype=torch.float32)
            self.scratch = torch.empty(6 * pairs + 1, dtype=torch.int64)
            self.device_out = torch.zeros(max_rows, hidden, dtype=torch.float32, device=device) if pin else None
        self.live_rows = ctypes.c_int64(0)
        self.stream = torch.cuda.Stream(device) if pin else None
        # With a GPU the CPU threads have nothing else to do between a step's layers: they wait awake for
        # the next one. Without, torch runs the rest of the model on the same cores: they sleep at once.
        self.spin_ns = SPIN_NS if pin else 0
        self._args: dict[tuple[int, int], HostStepArgs] = {}
        self._function = host_step_function()
        self._position = {layer: i for i, layer in enumerate(stacks)}
        self.bell = Doorbell(len(stacks) * max_rows, self.spin_ns, device) \
            if pin and handshake == "doorbell" and memory_operations_available() else None

    def split(self, percent: int) -> None:
        """The PCIe share of the misses from the next step on (each layer's host step reads it at run time)."""
        self.pcie = (percent, *self.pcie[1:])
        for args in self._args.values():
            args.pcie_percent = percent

    def use_rows(self, rows: int) -> None:
        """Rows in use in the next replayed step (a graph's padding rows past them are skipped)."""
        self.live_rows.value = rows
        if self.bell is not None:
            self.bell.arm()

    def run(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> "PendingSum":
        """Queue (or, without a GPU, run) the CPU's pairs of this layer -> their weighted sum, once waited for."""
        rows = x.shape[0]
        if rows > self.max_rows:
            raise ValueError(f"host step: {rows} rows, more than the {self.max_rows} it was sized for")
        args = self._arguments(layer, rows)
        kernel("stage_host_rows", x.device.type)(x, expert_ids, weights, self.x, self.ids, self.weights)
        if self.stream is None:
            self.live_rows.value = rows
            run_host_step(args)
            return PendingSum(self.out[:rows], None)
        main = torch.cuda.current_stream(self.device)
        if not torch.cuda.is_current_stream_capturing():
            self.live_rows.value = rows  # a captured step takes the rows its replay is given (use_rows)
        self.stream.wait_stream(main)
        if self.bell is None:
            launch_host_func(self.stream, self._function, ctypes.addressof(args))
        else:
            self.bell.arm()
            self.bell.ring(self.stream, self._bell_index(layer, rows))
        copy_async(self.device_out[:rows], self.out[:rows], self.stream)
        return PendingSum(self.device_out[:rows], self.stream)

    def _arguments(self, layer: int, rows: int) -> HostStepArgs:
        key = (layer, rows)
        if key not in self._args:
            m = self.stacks[layer].matrices
            self._args[key] = HostStepArgs(
                ctypes.pointer(m[0]), ctypes.pointer(m[1]), ctypes.pointer(m[2]), self.x.data_ptr(),
                self.ids.data_ptr(), self.weights.data_ptr(), self.cpu_entry[layer].data_ptr(),
                ctypes.addressof(self.live_rows), rows, self.topk, self.cpu_entry[layer].numel(), *self.pcie,
                self.limit, self.out.data_ptr(), self.workspace.data_ptr(), self.scratch.data_ptr(),
                fp8_table().data_ptr(),
                self.threads, simd_level(), self.spin_ns, 0, 0, 0, 0, 0, 0, 0, 0)
            if self.bell is not None:
                self.bell.name(self._bell_index(layer, rows), ctypes.addressof(self._args[key]))
        return self._args[key]

    def _bell_index(self, layer: int, rows: int) -> int:
        return self._position[layer] * self.max_rows + rows - 1

    def totals(self) -> HostStepTotals:
        """Summed over layers and batch sizes; raises if a step ever failed (a shape the kernel rejected)."""
        t = HostStepTotals()
        for (layer, rows), a in self._args.items():
            if a.status:
                raise RuntimeError(f"host step of MoE layer {layer} at {rows} rows failed: shapes the CPU kernel "
                                   "cannot take")
            t.steps += a.steps
            t.pairs_seen += a.pairs_seen
            t.pairs_missed += a.pairs_missed
            t.pairs_run += a.pairs_run
            t.experts_run += a.experts_run
            t.units_left += a.units_left
            t.seconds += a.nanoseconds / 1e9
        return t


@dataclass
class PendingSum:
    """A sum a side stream computes (a host step's, the PCIe share's), joined to the current stream when used."""

    out: torch.Tensor  # [rows, D]
    stream: torch.cuda.Stream | None

    def wait(self) -> torch.Tensor:
        """The sum, ordered after the side stream's work on the current stream."""
        if self.stream is not None:
            torch.cuda.current_stream(self.out.device).wait_stream(self.stream)
        return self.out
