"""The engine's side of the prepared snapshot: weights as they sit in memory, described and rebuilt.

A cold start converts the checkpoint once (dequantization rules applied, experts stacked per layer,
dtypes final); `describe` lists every buffer with a key, and `allocate` rebuilds empty weights of
the same layout whose buffers the storage layer fills straight from disk. Non-expert weights are
grouped first so they can be resident before any expert.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
import time
from contextlib import nullcontext
from importlib import metadata
from pathlib import Path
from typing import Callable

import torch

from engine.checkpoint.layout import is_expert_stack, layer_of, unlike_expert_layers
from engine.checkpoint.loader import LoadedWeights
from engine.offload.host_memory import host_empty
from engine.memory_plan import WeightBytes, spare_entries
from engine.weights import DenseWeight, Fp8BlockWeight, Nvfp4Weight, SplitStack
from engine.checkpoint.availability import ExpertAvailability, ExpertUnit
from engine.checkpoint.prepared_store import (PIECE_BYTES, PreparedPlan, PreparedSnapshotError, ReadStats, Region,
                                              piece_regions, read_plan, read_regions, write_prepared)

log = logging.getLogger("glmflash.engine")

FORMAT_VERSION = 3  # 2: pieces checksummed with CRC-32 instead of BLAKE2b; 3: the vision tower kept too
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
    if isinstance(weight, SplitStack):
        return _kind(weight.host)
    return {DenseWeight: "dense", Fp8BlockWeight: "fp8_block", Nvfp4Weight: "nvfp4"}[type(weight)]


def _fields(weight) -> tuple[str, ...]:
    return FIELDS[_kind(weight)]


def _tensor(weight, field: str) -> torch.Tensor:
    return weight if isinstance(weight, torch.Tensor) else getattr(weight, field)


def _layer(name: str) -> int:
    """The layer index of a `layers.N.*` weight name."""
    return int(name.split(".")[1])


def below_layer(meta: dict, layers: int | None) -> dict:
    """The recorded layout less every `layers.N.*` weight with N >= `layers`: a snapshot's MTP layers, for a load
    that runs none (None: the whole layout)."""
    if layers is None:
        return meta
    return {**meta, "weights": {name: record for name, record in meta["weights"].items()
                                if (layer := layer_of(name)) is None or layer < layers}}


def holds_layer(meta: dict, layer: int) -> bool:
    """Whether the recorded layout has weights of layer `layer` (an MTP layer: the snapshot was written with
    drafts on)."""
    return any(layer_of(name) == layer for name in meta["weights"])


def describe(weights: LoadedWeights) -> dict:
    """JSON-able record of every weight: kind, block size, and each buffer's dtype and shape."""
    records = {}
    for name, weight in sorted(weights.items()):  # by name: a resumed write meets the same layout
        buffers = {}
        for f in _fields(weight):
            part = _tensor(weight.host if isinstance(weight, SplitStack) else weight, f)
            shape = list(weight.shape[:1]) + list(part.shape[1:]) if isinstance(weight, SplitStack) else list(part.shape)
            buffers[f] = {"dtype": str(part.dtype).removeprefix("torch."), "shape": shape}
        record = {"kind": _kind(weight), "buffers": buffers}
        block = getattr(weight.host if isinstance(weight, SplitStack) else weight, "block", None)
        if block is not None:
            record["block"] = list(block)
        records[name] = record
    return {"weights": records}


def file_groups(weights: LoadedWeights) -> list[tuple[str, list[tuple[str, object, str]]]]:
    """(file name, [(key, weight, field)]) in load order: everything but routed experts, then one file per
    MoE layer; by name within a file, whatever order the load filled the weights in (a resumed write must
    meet the same layout)."""
    dense: list[tuple[str, object, str]] = []
    experts: dict[str, list[tuple[str, object, str]]] = {}
    for name, weight in sorted(weights.items()):
        items = [(f"{name}#{f}", weight, f) for f in _fields(weight)]
        if is_expert_stack(name):
            experts.setdefault(f"experts-{_layer(name):03d}.bin", []).extend(items)
        else:
            dense.extend(items)
    return [("dense.bin", dense)] + sorted(experts.items())


def _byte_parts(weight, field: str) -> list[torch.Tensor]:
    """A buffer's bytes in order, as flat uint8 tensors: one, or a split expert stack's device then host part."""
    if isinstance(weight, SplitStack):
        tensors = [getattr(weight.device, field), getattr(weight.hosted, field)]
    else:
        tensors = [_tensor(weight, field)]
    return [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]


def _byte_range(parts: list[torch.Tensor], start: int, size: int) -> list[torch.Tensor]:
    """The slices of `parts` (bytes laid end to end) that cover [start, start + size)."""
    out, at = [], 0
    for part in parts:
        lo, hi = max(start, at), min(start + size, at + part.numel())
        if lo < hi:
            out.append(part[lo - at:hi - at])
        at += part.numel()
    return out


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy)."""
    return memoryview(tensor.contiguous().view(torch.uint8).reshape(-1).numpy())


def _build(kind: str, made: dict[str, torch.Tensor], record: dict):
    if kind == "tensor":
        return made["data"]
    if kind == "dense":
        return DenseWeight(made["data"])
    if kind == "fp8_block":
        return Fp8BlockWeight(made["data"], made["scale_inv"], tuple(record["block"]))
    return Nvfp4Weight(made["packed"], made["scale"], made["global_scale"])


def whole_stack_layers(meta: dict) -> frozenset[int]:
    """MoE layers whose expert stacks stay whole on the device under a split (see `unlike_expert_layers`)."""
    return unlike_expert_layers({_layer(name): record["kind"] for name, record in meta["weights"].items()
                                 if is_expert_stack(name)})


def allocate(meta: dict, device: torch.device | str = "cpu", expert_slots: int | None = None,
             zero_device_experts: bool = False) -> tuple[LoadedWeights, dict[str, list[torch.Tensor]]]:
    """Empty weights of the recorded layout on `device`, and by key the buffers its bytes fill, in order.

    With `expert_slots`, each routed expert stack but those of `whole_stack_layers` is a `SplitStack`: its
    first `expert_slots` experts on `device`, the others in host RAM (pinned, with a GPU). A split key fills two
    buffers (the device part, then the host part), but on the CPU the parts are views of one buffer. `zero_device_experts`: the device
    parts start zeroed, for executors that may run a slot with weight zero before it is filled."""
    device = torch.device(device)
    weights: LoadedWeights = {}
    buffers: dict[str, list[torch.Tensor]] = {}

    def empty(b: dict, shape: list[int], at: torch.device) -> torch.Tensor:
        return torch.empty(shape, dtype=DTYPES[b["dtype"]], device=at)

    unsplit = whole_stack_layers(meta)
    for name, record in meta["weights"].items():
        kind, specs = record["kind"], record["buffers"]
        if expert_slots is None or not is_expert_stack(name) or _layer(name) in unsplit:
            made = {f: empty(b, b["shape"], device) for f, b in specs.items()}
            weights[name] = _build(kind, made, record)
            buffers.update({f"{name}#{f}": [t] for f, t in made.items()})
            continue
        count = next(iter(specs.values()))["shape"][0]
        slots = min(expert_slots, count)
        spare = spare_entries(count - slots)  # read into by no region: room for swaps
        if device.type != "cpu":
            on_device = {f: empty(b, [slots, *b["shape"][1:]], device) for f, b in specs.items()}
            if zero_device_experts:
                for t in on_device.values():
                    t.zero_()
            on_host = {f: host_empty([count - slots + spare, *b["shape"][1:]], DTYPES[b["dtype"]],
                                     pin=device.type == "cuda")
                       for f, b in specs.items()}
            buffers.update({f"{name}#{f}": [on_device[f], on_host[f][:count - slots]] for f in specs})
        else:
            whole = {f: empty(b, [count + spare, *b["shape"][1:]], device) for f, b in specs.items()}
            on_device, on_host = {f: t[:slots] for f, t in whole.items()}, {f: t[slots:] for f, t in whole.items()}
            if zero_device_experts:
                for t in on_device.values():
                    t.zero_()
            buffers.update({f"{name}#{f}": [t[:count]] for f, t in whole.items()})
        weights[name] = SplitStack(_build(kind, on_device, record), _build(kind, on_host, record), spare)
    return weights, buffers


def prepared_sizes(meta: dict) -> WeightBytes:
    """Bytes of a prepared snapshot's weights and of its placed routed experts, from its recorded layout."""
    total = experts = 0
    whole = whole_stack_layers(meta)
    layers = set()
    for name, record in meta["weights"].items():
        size = sum(math.prod(b["shape"]) * DTYPES[b["dtype"]].itemsize for b in record["buffers"].values())
        total += size
        if is_expert_stack(name) and _layer(name) not in whole:
            experts += size
            layers.add(_layer(name))
    return WeightBytes(total, experts, len(layers))


def save_prepared(weights: LoadedWeights, directory: Path, extra_meta: dict | None = None, workers: int = 8,
                  stop: threading.Event | None = None, pace: Callable[[int], None] | None = None) -> PreparedPlan:
    """Write the weights as a prepared snapshot, `workers` pieces at a time: host buffers are written from
    their own memory, GPU buffers (and a piece across a split expert stack's two parts) through one
    pinned PIECE_BYTES staging buffer per worker.

    `extra_meta` is stored with the layout (the provisioning layer records what it was prepared for);
    setting `stop` ends the write and `pace` slows it (see `write_prepared`).
    """
    groups = file_groups(weights)
    parts = {key: _byte_parts(weight, f) for _, items in groups for key, weight, f in items}
    on_gpu = any(t.device.type == "cuda" for ts in parts.values() for t in ts)
    staging = [torch.empty(PIECE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(workers)] if on_gpu else []
    streams: dict[int, torch.cuda.Stream] = {}

    def piece(key: str, start: int, size: int, buffer: torch.Tensor | None) -> memoryview:
        sources = _byte_range(parts[key], start, size)
        if len(sources) == 1 and sources[0].device.type == "cpu":
            return as_bytes(sources[0])
        out = buffer[:size] if buffer is not None else torch.empty(size, dtype=torch.uint8)
        gpu = next((t.device for t in sources if t.device.type == "cuda"), None)
        stream = streams.setdefault(threading.get_ident(), torch.cuda.Stream(gpu)) if gpu is not None else None
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            at = 0
            for source in sources:
                out[at:at + source.numel()].copy_(source, non_blocking=True)
                at += source.numel()
        if stream is not None:
            stream.synchronize()  # the piece is hashed and written from the buffer as soon as this returns
        return as_bytes(out)

    files = [(name, [(key, sum(t.numel() for t in parts[key])) for key, _, _ in items]) for name, items in groups]
    meta = {**describe(weights), **(extra_meta or {})}
    return write_prepared(directory, files, piece, FORMAT_VERSION, engine_version(), meta, workers, staging, stop,
                          pace)


def load_prepared(directory: Path, device: torch.device | str = "cpu", workers: int = 8,
                  verify: bool = True, expert_slots: int | None = None,
                  layers: int | None = None) -> tuple[LoadedWeights, ReadStats]:
    """Read a prepared snapshot into its final buffers: host memory directly, or GPU memory through one
    pinned 64 MiB staging buffer per reader thread (the host never holds more than those). With
    `expert_slots` each routed expert goes straight to its place, a device slot or the host bank (see
    `allocate`). With `layers`, the weights of layers from that index on (MTP layers) are left unread."""
    plan = _plan(directory, layers)
    start = time.perf_counter()
    weights, buffers = allocate(plan.meta, device, expert_slots)
    allocated = time.perf_counter()
    reader = _RegionReader(directory, plan, torch.device(device), buffers, verify)
    stats = reader.read(plan.regions, workers, reader.staging(workers))
    # where a load's time goes: the buffers (host banks pinned) before any byte is read, then the reads
    log.info("event=prepared_load allocate_s=%.2f read_s=%.2f read_gb_s=%.2f workers=%d", allocated - start,
             stats.seconds, stats.gb_per_s, workers)
    return weights, stats


def open_prepared(directory: Path, device: torch.device | str = "cpu", workers: int = 8, verify: bool = True,
                  expert_slots: int | None = None,
                  on_damaged: Callable[[PreparedSnapshotError], None] = lambda error: None, layers: int | None = None,
                  ) -> tuple[LoadedWeights, ReadStats, ExpertAvailability]:
    """`load_prepared` for early readiness: the non-expert weights are read now; the routed expert stacks are
    allocated in their places and left to fill, one checksummed piece a unit (`ExpertAvailability`).

    An expert piece found damaged then (by the fill or a step) is past the point where the load could fall
    back to the checkpoint: `on_damaged(error)` runs in the reading thread, before the error reaches the reader,
    so the snapshot's owner can keep later starts from trusting it. `layers` as for `load_prepared`."""
    plan = _plan(directory, layers)
    weights, buffers = allocate(plan.meta, device, expert_slots, zero_device_experts=True)
    reader = _RegionReader(directory, plan, torch.device(device), buffers, verify)
    is_expert = {r.key: is_expert_stack(r.key.partition("#")[0]) for r in plan.regions}
    stats = reader.read([r for r in plan.regions if not is_expert[r.key]], workers, reader.staging(workers))
    local = threading.local()

    def load(piece: Region) -> None:
        if getattr(local, "staging", None) is None:
            local.staging = reader.staging(1)
        try:
            reader.read([piece], 1, local.staging)
        except PreparedSnapshotError as error:
            on_damaged(error)
            raise

    units = []
    for region in (r for r in plan.regions if is_expert[r.key]):
        name, _, field = region.key.partition("#")
        layer, count = _layer(name), plan.meta["weights"][name]["buffers"][field]["shape"][0]
        per_expert = region.size // count
        for piece in piece_regions(region):
            start = int(piece.key.rpartition("@")[2])
            experts = tuple((layer, e) for e in range(start // per_expert, -(-(start + piece.size) // per_expert)))
            units.append(ExpertUnit(functools.partial(load, piece), experts, piece.size))
    layers = sorted({pair[0] for unit in units for pair in unit.experts})
    count = max((e for unit in units for _, e in unit.experts), default=-1) + 1
    return weights, stats, ExpertAvailability(units, layers, count)


def _plan(directory: Path, layers: int | None = None) -> PreparedPlan:
    """The snapshot's plan, less the weights of layers from `layers` on (their regions left unread)."""
    plan = read_plan(directory)
    if plan is None:
        raise FileNotFoundError(f"{directory}: no prepared snapshot")
    if layers is None:
        return plan
    meta = below_layer(plan.meta, layers)
    return dataclasses.replace(plan, meta=meta,
                               regions=[r for r in plan.regions if r.key.partition("#")[0] in meta["weights"]])


class _RegionReader:
    """Reads regions of a prepared snapshot (whole, or the pieces `piece_regions` cuts) into the buffers
    `allocate` made: host buffers directly, GPU ones through pinned staging buffers and a stream per thread."""

    def __init__(self, directory: Path, plan: PreparedPlan, device: torch.device,
                 buffers: dict[str, list[torch.Tensor]], verify: bool) -> None:
        self.directory, self.plan, self.device, self.verify = directory, plan, device, verify
        self.flat = {key: [t.view(torch.uint8).reshape(-1) for t in parts] for key, parts in buffers.items()}
        self.streams: dict[int, torch.cuda.Stream] = {}
        self.lock = threading.Lock()

    def staging(self, workers: int) -> list[memoryview]:
        """Staging buffers for `read` (none on the CPU, where pieces land in place)."""
        if self.device.type != "cuda":
            return []
        return [as_bytes(torch.empty(PIECE_BYTES, dtype=torch.uint8, pin_memory=True)) for _ in range(workers)]

    def read(self, regions: list[Region], workers: int, staging: list[memoryview]) -> ReadStats:
        files = {r.file: self.plan.files[r.file] for r in regions}
        sub = PreparedPlan(self.plan.format_version, self.plan.engine_version, self.plan.meta, files, regions, True)
        if self.device.type != "cuda":
            # On the CPU a key has one buffer (split stacks are views of it): pieces land in place.
            places = {r.key: self._place(r.key) for r in regions}
            views = {r.key: as_bytes(self.flat[key][0])[start:start + r.size] for r, (key, start) in
                     ((r, places[r.key]) for r in regions)}
            return read_regions(self.directory, sub, views, workers, self.verify)
        return read_regions(self.directory, sub, None, workers, self.verify, sink=self._to_buffer, staging=staging)

    @staticmethod
    def _place(key: str) -> tuple[str, int]:
        """(buffer key, first byte) of a region key: a piece's (`key@start`) or a whole region's."""
        base, _, start = key.partition("@")
        return base, int(start or 0)

    def _to_buffer(self, key: str, offset: int, piece: memoryview) -> None:
        """Into the key's buffers (a split expert stack has a device part, then a host part) through this
        thread's stream: GPU buffers by an asynchronous copy, host ones by a plain copy."""
        key, at = self._place(key)
        offset += at
        with self.lock:
            stream = self.streams.setdefault(threading.get_ident(), torch.cuda.Stream(self.device))
        source = torch.frombuffer(piece, dtype=torch.uint8)
        start = 0  # the first byte of the current buffer within the key
        with torch.cuda.stream(stream):
            for part in self.flat[key]:
                lo, hi = max(offset, start), min(offset + len(piece), start + part.numel())
                if lo < hi:
                    part[lo - start:hi - start].copy_(source[lo - offset:hi - offset], non_blocking=True)
                start += part.numel()
        stream.synchronize()  # the staging buffer is reused as soon as this returns
