"""The engine's side of the prepared snapshot: weights as they sit in memory, described and rebuilt.

A cold start converts the checkpoint once (dequantization rules applied, experts stacked per layer,
dtypes final); `describe` lists every buffer with a key, and `allocate` rebuilds empty weights of
the same layout whose buffers the storage layer fills straight from disk. Non-expert weights are
grouped first so they can be resident before any expert.
"""

from __future__ import annotations

import threading
from importlib import metadata
from pathlib import Path

import torch

from engine.checkpoint.layout import is_expert_stack
from engine.checkpoint.loader import LoadedWeights
from engine.weights import DenseWeight, Fp8BlockWeight, Nvfp4Weight
from engine.checkpoint.prepared_store import PIECE_BYTES, PreparedPlan, ReadStats, read_plan, read_regions, write_prepared

FORMAT_VERSION = 2  # 2: pieces checksummed with CRC-32 instead of BLAKE2b
FIELDS = {"tensor": ("data",), "dense": ("data",), "fp8_block": ("data", "scale_inv"),
          "nvfp4": ("packed", "scale", "global_scale")}
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.uint8,
                                                     torch.float8_e4m3fn, torch.int64)}


def engine_version() -> str:
    try:
        return metadata.version("glmflash")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _kind(weight) -> str:
    if isinstance(weight, torch.Tensor):
        return "tensor"
    return {DenseWeight: "dense", Fp8BlockWeight: "fp8_block", Nvfp4Weight: "nvfp4"}[type(weight)]


def _buffers(weight) -> dict[str, torch.Tensor]:
    if isinstance(weight, torch.Tensor):
        return {"data": weight}
    return {f: getattr(weight, f) for f in FIELDS[_kind(weight)]}


def describe(weights: LoadedWeights) -> dict:
    """JSON-able record of every weight: kind, block size, and each buffer's dtype and shape."""
    records = {}
    for name, weight in weights.items():
        record = {"kind": _kind(weight), "buffers": {
            f: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for f, t in _buffers(weight).items()}}
        if isinstance(weight, Fp8BlockWeight):
            record["block"] = list(weight.block)
        records[name] = record
    return {"weights": records}


def file_groups(weights: LoadedWeights) -> list[tuple[str, list[tuple[str, torch.Tensor]]]]:
    """(file name, [(key, buffer)]) in load order: everything but routed experts, then one file per MoE layer."""
    dense: list[tuple[str, torch.Tensor]] = []
    experts: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, weight in weights.items():
        items = [(f"{name}#{f}", t) for f, t in _buffers(weight).items()]
        if is_expert_stack(name):
            layer = int(name.split(".")[1])
            experts.setdefault(f"experts-{layer:03d}.bin", []).extend(items)
        else:
            dense.extend(items)
    return [("dense.bin", dense)] + sorted(experts.items())


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy)."""
    return memoryview(tensor.contiguous().view(torch.uint8).reshape(-1).numpy())


def allocate(meta: dict, device: torch.device | str = "cpu",
             expert_device: torch.device | str | None = None) -> tuple[LoadedWeights, dict[str, torch.Tensor]]:
    """Empty weights of the recorded layout on `device` (routed experts on `expert_device` when given:
    host RAM, pinned when a GPU is present), and their buffers by key (to be filled from disk)."""
    device = torch.device(device)
    experts_at = torch.device(expert_device) if expert_device is not None else device
    pin = experts_at.type == "cpu" and device.type == "cuda"
    weights: LoadedWeights = {}
    buffers: dict[str, torch.Tensor] = {}
    for name, record in meta["weights"].items():
        expert = is_expert_stack(name)
        made = {f: torch.empty(b["shape"], dtype=DTYPES[b["dtype"]], device=experts_at if expert else device,
                               pin_memory=pin and expert)
                for f, b in record["buffers"].items()}
        buffers.update({f"{name}#{f}": t for f, t in made.items()})
        kind = record["kind"]
        if kind == "tensor":
            weights[name] = made["data"]
        elif kind == "dense":
            weights[name] = DenseWeight(made["data"])
        elif kind == "fp8_block":
            weights[name] = Fp8BlockWeight(made["data"], made["scale_inv"], tuple(record["block"]))
        else:
            weights[name] = Nvfp4Weight(made["packed"], made["scale"], made["global_scale"])
    return weights, buffers


def save_prepared(weights: LoadedWeights, directory: Path, extra_meta: dict | None = None, workers: int = 8,
                  stop: threading.Event | None = None) -> PreparedPlan:
    """Write the weights as a prepared snapshot, `workers` pieces at a time: host buffers are written from
    their own memory, GPU buffers through one pinned PIECE_BYTES staging buffer per worker.

    `extra_meta` is stored with the layout (the provisioning layer records what it was prepared for);
    setting `stop` abandons the write (see `write_prepared`).
    """
    groups = file_groups(weights)
    flat = {key: t.contiguous().reshape(-1).view(torch.uint8) for _, items in groups for key, t in items}
    on_gpu = any(t.device.type == "cuda" for t in flat.values())
    staging = [torch.empty(PIECE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(workers)] if on_gpu else []
    streams: dict[int, torch.cuda.Stream] = {}

    def piece(key: str, start: int, size: int, buffer: torch.Tensor | None) -> memoryview:
        source = flat[key][start:start + size]
        if source.device.type == "cpu":
            return as_bytes(source)
        stream = streams.setdefault(threading.get_ident(), torch.cuda.Stream(source.device))
        with torch.cuda.stream(stream):
            buffer[:size].copy_(source, non_blocking=True)  # type: ignore[index]
        stream.synchronize()  # the piece is hashed and written from the buffer as soon as this returns
        return as_bytes(buffer[:size])  # type: ignore[index]

    files = [(name, [(key, flat[key].numel()) for key, _ in items]) for name, items in groups]
    meta = {**describe(weights), **(extra_meta or {})}
    return write_prepared(directory, files, piece, FORMAT_VERSION, engine_version(), meta, workers, staging, stop)


def load_prepared(directory: Path, device: torch.device | str = "cpu", workers: int = 8,
                  verify: bool = True, expert_device: torch.device | str | None = None
                  ) -> tuple[LoadedWeights, ReadStats]:
    """Read a prepared snapshot into its final buffers: host memory directly, or GPU memory through one
    pinned 64 MiB staging buffer per reader thread (the host never holds more than those). With
    `expert_device` the routed experts go straight to their place there (see `allocate`)."""
    plan = read_plan(directory)
    if plan is None:
        raise FileNotFoundError(f"{directory}: no prepared snapshot")
    device = torch.device(device)
    weights, buffers = allocate(plan.meta, device, expert_device)
    if device.type != "cuda":
        return weights, read_regions(directory, plan, {k: as_bytes(t) for k, t in buffers.items()}, workers, verify)
    flat = {key: t.view(torch.uint8).reshape(-1) for key, t in buffers.items()}
    staging = [torch.empty(PIECE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(workers)]
    streams: dict[int, torch.cuda.Stream] = {}

    def to_buffer(key: str, offset: int, piece: memoryview) -> None:
        """Into a GPU buffer through the stream, or a host (expert) buffer by a plain copy."""
        stream = streams.setdefault(threading.get_ident(), torch.cuda.Stream(device))
        with torch.cuda.stream(stream):
            flat[key][offset:offset + len(piece)].copy_(torch.frombuffer(piece, dtype=torch.uint8), non_blocking=True)
        stream.synchronize()  # the staging buffer is reused as soon as this returns

    stats = read_regions(directory, plan, None, workers, verify, sink=to_buffer, staging=[as_bytes(t) for t in staging])
    return weights, stats
