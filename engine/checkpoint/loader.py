"""Read a glm5_next snapshot directory into the engine's weight objects, in one parallel pass.

Every key is first mapped to the layout table (engine.checkpoint.layout) from the safetensors
headers alone, so a missing, extra or malformed tensor fails before any data is read. The shards
are then read at disk speed (engine.checkpoint.shards: parallel reads into reused staging
buffers) and each weight, once all its parts have arrived, is converted and put in its place by a
consuming thread while the next chunks are read (GPU memory, or host RAM for routed experts under an expert budget); routed
experts are copied into per-layer stacks as they arrive, so the host never holds more than the
staging buffers besides the weights themselves. The vision tower is loaded where the checkpoint and its config
have one; the MTP layer only when asked (`mtp=True`: speculative decoding), else skipped unread.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch

from engine.checkpoint.layout import (EXPERT_KEY, TEXT_PREFIX, VISION_PREFIX, TensorSpec, checkpoint_key,
                                     expert_formats, layer_of, mtp_layer_indices, mtp_specs, stacked_expert_name,
                                     text_specs, unlike_expert_layers, vision_specs)
from engine.checkpoint.availability import ExpertAvailability, ExpertUnit
from engine.checkpoint.shards import (CheckpointError, Chunk, ReadTiming, StoredTensor, plan_chunks, read_chunk,
                                      read_chunks, read_header, staging_buffer)
from engine.config import ModelConfig
from engine.offload.host_memory import host_empty
from engine.memory_plan import WeightBytes, spare_entries
from engine.weights import (DenseWeight, Fp8BlockWeight, Nvfp4Weight, SplitStack, Weight, map_tensors,
                            stack_format, tensor_fields)

log = logging.getLogger("glmflash.engine")
LoadedWeights = dict[str, "Weight | SplitStack | torch.Tensor"]

# Linear suffix sets that identify each stored format; `input_scale`-style activation scales are
# carried by some NVFP4 exports and unused by W4A16 math.
FORMATS: dict[str, frozenset[str]] = {
    "dense": frozenset({"weight"}),
    "fp8_block": frozenset({"weight", "weight_scale_inv"}),
    "nvfp4_ct": frozenset({"weight_packed", "weight_scale", "weight_global_scale"}),
    "nvfp4_modelopt": frozenset({"weight", "weight_scale", "weight_scale_2"}),
}
IGNORED_SUFFIXES = frozenset({"input_scale", "input_global_scale"})
LINEAR_SUFFIXES = frozenset().union(*FORMATS.values(), IGNORED_SUFFIXES)
# The MTP layer's copies of the embedding and the head, where an export stores them: it uses the model's own.
SKIPPED = re.compile(r"^(model\.vision_tower\.|.*\.shared_head\.head\.|.*layers\.\d+\.embed_tokens\.|.*hc_head)")


@dataclass
class _Group:
    """The checkpoint keys that together make one logical tensor."""

    spec: TensorSpec
    keys: dict[str, str] = field(default_factory=dict)  # suffix ("" for plain tensors) -> checkpoint key
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def add(self, suffix: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Record one part (under the caller's lock); all parts once the last one arrives, else None."""
        self.tensors[suffix] = tensor
        if len(self.tensors) < len(self.keys):
            return None
        parts, self.tensors = self.tensors, {}
        return parts


def shard_files(snapshot: Path) -> list[Path]:
    """The safetensors files of a snapshot: from its index when there is one, else every *.safetensors."""
    index = snapshot / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(p.name for p in snapshot.glob("*.safetensors"))
    if not names:
        raise CheckpointError(f"{snapshot}: no safetensors files and no model.safetensors.index.json")
    missing = [n for n in names if not (snapshot / n).exists()]
    if missing:
        raise CheckpointError(f"{snapshot}: shard file {missing[0]} listed in the index is missing")
    return [snapshot / n for n in names]


def checkpoint_sizes(snapshot: Path, cfg: ModelConfig, mtp: bool = False) -> WeightBytes:
    """Bytes of the weights a load of the snapshot brings (`mtp`: the MTP layers too) and of its placed routed
    experts, from the safetensors headers alone (no tensor is read): near enough to decide placement before
    loading."""
    layers = cfg.num_layers + (cfg.num_mtp_layers if mtp else 0)
    named = [(name, t) for path in shard_files(snapshot) for t in read_header(path)
             if (name := logical_name(t.key, layers)) is not None]
    formats = expert_formats(name for name, _ in named)
    whole = unlike_expert_layers(formats)
    experts = 0
    for name, t in named:
        expert = EXPERT_KEY.match(name.rpartition(".")[0])
        if expert and int(expert.group(1)) not in whole:
            experts += t.nbytes
    return WeightBytes(sum(t.nbytes for _, t in named), experts, len(formats) - len(whole))


def has_mtp_layer(snapshot: Path, cfg: ModelConfig) -> bool:
    """Whether the checkpoint stores the MTP layer its config declares, from the safetensors headers alone (the
    nvidia ModelOpt build declares one and stores none)."""
    if not cfg.num_mtp_layers:
        return False
    first = f"layers.{cfg.num_layers}."
    layers = cfg.num_layers + cfg.num_mtp_layers
    return any((name := logical_name(t.key, layers)) is not None and name.startswith(first)
               for path in shard_files(snapshot) for t in read_header(path))


def logical_name(key: str, num_layers: int) -> str | None:
    """The layout name for a checkpoint key, or None for tensors the model does not use (`num_layers`: the
    layers to load, the MTP layers among them when they are wanted)."""
    if SKIPPED.match(key):
        return None
    if key.startswith(VISION_PREFIX):
        return key[len("model."):]
    if key.startswith(TEXT_PREFIX):
        name = key[len(TEXT_PREFIX):]
    elif key.startswith("model."):
        name = key[len("model."):]
    else:
        name = key
    layer = layer_of(name)
    if layer is not None and layer >= num_layers:  # MTP layer(s) not asked for
        return None
    return name


def load_weights(snapshot: Path | str, cfg: ModelConfig, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.bfloat16, expert_slots: int | None = None,
                 workers: int = 8, progress: Callable[[int, int], None] | None = None,
                 mtp: bool = False) -> LoadedWeights:
    """Load the text model's tensors; see the module docstring for the guarantees. With `expert_slots`
    each MoE layer's first `expert_slots` routed experts go to `device` and the others straight to host
    RAM (pinned when `device` is a GPU): expert stacks are `SplitStack`s. `workers` threads read and as
    many convert; `progress(done_bytes, total_bytes)` follows the reads. `mtp`: the MTP layers too, where the
    checkpoint stores them (`layers.{num_layers}.*`, its experts stacked like any MoE layer's)."""
    reader = _Reader(Path(snapshot), cfg, device, dtype, expert_slots, mtp)
    chunks = plan_chunks(reader.wanted, lambda key: reader.part_of[key][0].spec.name)
    _timed_reads(chunks, reader, workers, progress)
    return reader.assembler.finish()


def _timed_reads(chunks: list[Chunk], reader: "_Reader", workers: int,
                 progress: Callable[[int, int], None] | None) -> None:
    """The reads, then where their threads' time went (`event=load_timing`: reading or converting and placing)."""
    timing, start = ReadTiming(), time.perf_counter()
    read_chunks(chunks, reader.consume, workers, pin_memory=reader.pin, progress=progress, timing=timing)
    log.info("event=load_timing %s", timing.summary(time.perf_counter() - start, workers))


def open_weights(snapshot: Path | str, cfg: ModelConfig, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.bfloat16, expert_slots: int | None = None, workers: int = 8,
                 progress: Callable[[int, int], None] | None = None) -> tuple[LoadedWeights, ExpertAvailability]:
    """`load_weights` for early readiness: every non-expert weight is loaded, the routed expert stacks are
    allocated in their final places and left to fill, one expert's tensors a unit
    (`ExpertAvailability.fill` or `ensure`). `progress` follows the non-expert reads."""
    reader = _Reader(Path(snapshot), cfg, device, dtype, expert_slots)
    expert_of = {key: EXPERT_KEY.match(group.spec.name) for key, (group, _) in reader.part_of.items()}
    others = [t for t in reader.wanted if not expert_of[t.key]]
    _timed_reads(plan_chunks(others, lambda key: reader.part_of[key][0].spec.name), reader, workers, progress)
    reader.reserve_expert_stacks()
    local = threading.local()

    def load(chunk: Chunk) -> None:
        if getattr(local, "staging", None) is None:
            local.staging = staging_buffer(reader.pin)
        read_chunk(chunk, reader.consume, local.staging)

    def pair(key: str) -> tuple[int, int]:
        return int(expert_of[key].group(1)), int(expert_of[key].group(2))

    experts = [t for t in reader.wanted if expert_of[t.key]]
    units = [ExpertUnit(functools.partial(load, chunk), tuple(dict.fromkeys(pair(t.key) for t in chunk.tensors)),
                        chunk.nbytes)
             for chunk in plan_chunks(experts, pair, chunk_bytes=0)]
    return reader.assembler.finish(), ExpertAvailability(units, cfg.moe_layers, cfg.n_routed_experts)


class _Reader:
    """One snapshot's load plan and the consumer that converts and places what the reads hand over (from
    any thread); shared by the one-pass load and the early-readiness one."""

    def __init__(self, snapshot: Path, cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                 expert_slots: int | None, mtp: bool = False) -> None:
        self.cfg, self.dtype = cfg, dtype
        stored = [t for path in shard_files(snapshot) for t in read_header(path)]
        self.part_of = _plan(stored, cfg, mtp)
        whole = unlike_expert_layers(expert_formats(f"{group.spec.name}.{suffix}" for group, suffix in
                                                    self.part_of.values()))
        self.assembler = _Assembler(cfg, device, dtype, expert_slots, whole)
        self.wanted = [t for t in stored if t.key in self.part_of]
        self.pin = self.assembler.device.type == "cuda"
        self.lock = threading.Lock()
        self.streams: dict[int, torch.cuda.Stream] = {}

    def consume(self, chunk: Chunk, views: list[torch.Tensor], staging: torch.Tensor | None) -> None:
        inside = {t.key for t in chunk.tensors}
        stream = None
        if self.assembler.device.type == "cuda":
            with self.lock:
                stream = self.streams.setdefault(threading.get_ident(), torch.cuda.Stream(self.assembler.device))
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for stored_tensor, view in zip(chunk.tensors, views):
                group, suffix = self.part_of[stored_tensor.key]
                if staging is not None and not inside.issuperset(group.keys.values()):
                    view = view.clone()  # the rest of this weight comes with another chunk: outlive the staging
                with self.lock:
                    parts = group.add(suffix, view)
                if parts is not None:
                    self.assembler.add(group.spec, parts, staging)
        if stream is not None:
            stream.synchronize()  # the staging buffer is reused as soon as this returns

    def reserve_expert_stacks(self) -> None:
        """Allocate every routed expert stack before any expert arrives, from the stored dtypes and shapes
        alone: each stack's first expert is converted on the meta device to learn the final layout."""
        meta = _Builder(self.cfg, torch.device("meta"), self.dtype)
        stored = {t.key: t for t in self.wanted}
        firsts: dict[tuple[int, str], _Group] = {}
        for group, _ in self.part_of.values():
            expert = EXPERT_KEY.match(group.spec.name)
            if expert:
                firsts.setdefault((int(expert.group(1)), expert.group(3)), group)
        for (layer, proj), group in firsts.items():
            parts = {suffix: torch.empty(stored[key].shape, dtype=stored[key].dtype, device="meta")
                     for suffix, key in group.keys.items()}
            self.assembler.stacks.reserve(layer, proj, meta.build(group.spec, parts))


def assemble(cfg: ModelConfig, groups: Iterable[tuple[TensorSpec, dict[str, torch.Tensor]]],
             device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
             expert_slots: int | None = None, whole_layers: frozenset[int] = frozenset()) -> LoadedWeights:
    """Turn complete tensor groups (suffix -> tensor; "" for plain tensors) into weight objects.

    Shared by file loading and by synthetic weights built in memory for benchmarks. `whole_layers`: MoE layers
    whose expert stacks stay whole on `device` under `expert_slots` (see `unlike_expert_layers`).
    """
    assembler = _Assembler(cfg, device, dtype, expert_slots, whole_layers)
    for spec, tensors in groups:
        assembler.add(spec, tensors)
    return assembler.finish()


class _Assembler:
    """Builds each complete group into its weight object and puts it in place; safe to feed from
    several threads at once."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                 expert_slots: int | None, whole_layers: frozenset[int] = frozenset()) -> None:
        self.device = torch.device(device)
        self.out: LoadedWeights = {}
        self.stacks = _ExpertStacks(cfg, self.device, expert_slots, whole_layers)
        self.builder = _Builder(cfg, self.device, dtype)
        # Split stacks are filled expert by expert from host memory (most of them stay there).
        self.expert_builder = self.builder if expert_slots is None else _Builder(cfg, torch.device("cpu"), dtype)

    def add(self, spec: TensorSpec, tensors: dict[str, torch.Tensor], staging: torch.Tensor | None = None) -> None:
        """`staging`: a buffer the tensors may live in that is reused afterwards (kept weights are copied out)."""
        expert = EXPERT_KEY.match(spec.name)
        if expert:
            weight = self.expert_builder.build(spec, tensors)
            self.stacks.put(int(expert.group(1)), int(expert.group(2)), expert.group(3), weight)
            return
        weight = self.builder.build(spec, tensors)
        if staging is not None:
            weight = _owned(weight, staging)
        self.out[spec.name] = weight

    def finish(self) -> LoadedWeights:
        self.out.update(self.stacks.finish())
        return self.out


def _owned(weight: Weight | torch.Tensor, staging: torch.Tensor) -> Weight | torch.Tensor:
    """The weight with every tensor that still lives in `staging` (a CPU target, nothing to convert) copied out."""
    base = staging.untyped_storage().data_ptr()

    def own(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if t.device.type == "cpu" and t.untyped_storage().data_ptr() == base else t

    return own(weight) if isinstance(weight, torch.Tensor) else map_tensors(weight, own)


def _plan(stored: list[StoredTensor], cfg: ModelConfig, mtp: bool = False) -> dict[str, tuple[_Group, str]]:
    """Map every stored key to its layout entry from the headers; fail on unknown, missing or malformed sets.
    `mtp`: the MTP layers' keys too, where the checkpoint has them (a partial layer is refused).

    Returns, for every key to read, the group it belongs to and its suffix in it."""
    specs = {s.name: s for s in text_specs(cfg)}
    layers = cfg.num_layers + (cfg.num_mtp_layers if mtp else 0)
    names = {t.key: logical_name(t.key, layers) for t in stored}
    has_tower = any(name and name.startswith("visual.") for name in names.values())
    if cfg.vision is not None and has_tower:
        specs.update((s.name, s) for s in vision_specs(cfg))
    elif cfg.vision is not None:
        log.info("event=vision_tower present=0 reason=no_visual_tensors serving=text")
    if mtp and cfg.num_mtp_layers:
        first = f"layers.{cfg.num_layers}."
        if any(name and name.startswith(first) for name in names.values()):
            specs.update((s.name, s) for s in mtp_specs(cfg))
        else:
            log.info("event=mtp present=0 reason=no_mtp_tensors layers=%s drafts=off",
                     ",".join(map(str, mtp_layer_indices(cfg))))
    groups: dict[str, _Group] = {}
    part_of: dict[str, tuple[_Group, str]] = {}
    seen: dict[str, Path] = {}
    for t in stored:
        if t.key in seen:
            raise CheckpointError(f"tensor {t.key!r} is stored twice: in {seen[t.key].name} and {t.path.name}")
        seen[t.key] = t.path
        name = names[t.key]
        if name is None or (name.startswith("visual.") and cfg.vision is None):  # a tower without its config
            continue
        if name in specs and specs[name].role != "linear":
            group = groups.setdefault(name, _Group(specs[name]))
            group.keys[""] = t.key
            part_of[t.key] = (group, "")
            continue
        base, _, suffix = name.rpartition(".")
        spec = specs.get(base)
        if spec is None or spec.role != "linear" or suffix not in LINEAR_SUFFIXES:
            raise CheckpointError(f"{t.path.name}: unexpected tensor {t.key!r} (not part of the glm5_next model)")
        if suffix not in IGNORED_SUFFIXES:
            group = groups.setdefault(base, _Group(spec))
            group.keys[suffix] = t.key
            part_of[t.key] = (group, suffix)
    for name, spec in specs.items():
        if name not in groups:
            hint = checkpoint_key(name) + (".weight" if spec.role == "linear" else "")
            raise CheckpointError(f"missing tensor {hint!r} (expected shape {list(spec.shape)})")
        found = frozenset(groups[name].keys)
        if spec.role == "linear" and found not in FORMATS.values():
            raise CheckpointError(
                f"tensor {name!r} has parts {sorted(found)}, which match no known format "
                f"(expected one of {[sorted(v) for v in FORMATS.values()]})")
    return part_of


class _Builder:
    """Turns one complete key group into a weight object on the target device, checking shapes and dtypes."""

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.cfg, self.device, self.dtype = cfg, device, dtype

    def build(self, spec: TensorSpec, t: dict[str, torch.Tensor]) -> Weight | torch.Tensor:
        if spec.role != "linear":
            tensor = t[""]
            self._check(spec.name, tensor, spec.shape)
            return tensor.to(self.device, torch.float32 if spec.role == "fp32" else self.dtype)
        kind = next(k for k, v in FORMATS.items() if v == frozenset(t))
        n, k = spec.shape
        if kind == "dense":
            self._check(spec.name + ".weight", t["weight"], spec.shape, floating=True)
            return DenseWeight(t["weight"].to(self.device, self.dtype))
        if kind == "fp8_block":
            bn, bk = self.cfg.quant.block_size
            self._check(spec.name + ".weight", t["weight"], spec.shape, torch.float8_e4m3fn)
            self._check(spec.name + ".weight_scale_inv", t["weight_scale_inv"], (math.ceil(n / bn), math.ceil(k / bk)))
            return Fp8BlockWeight(t["weight"].to(self.device), t["weight_scale_inv"].to(self.device, torch.float32),
                                  (bn, bk))
        packed_key = "weight_packed" if kind == "nvfp4_ct" else "weight"
        global_key = "weight_global_scale" if kind == "nvfp4_ct" else "weight_scale_2"
        if k % 16:
            raise CheckpointError(f"tensor {spec.name!r}: NVFP4 needs in_features divisible by 16, got {k}")
        self._check(f"{spec.name}.{packed_key}", t[packed_key], (n, k // 2), torch.uint8)
        self._check(f"{spec.name}.weight_scale", t["weight_scale"], (n, k // 16), torch.float8_e4m3fn)
        glob = t[global_key].float().reshape(-1)
        if glob.numel() != 1:
            raise CheckpointError(f"tensor {spec.name}.{global_key}: expected one value, found shape {list(t[global_key].shape)}")
        # compressed-tensors stores a divisor, ModelOpt a multiplier; the engine holds multipliers. (On the meta
        # device, where only the layout is wanted, reciprocal() imports torch's compiler: seconds of a start.)
        glob = glob.reciprocal() if kind == "nvfp4_ct" and not glob.is_meta else glob
        return Nvfp4Weight(t[packed_key].to(self.device), t["weight_scale"].to(self.device), glob.to(self.device))

    @staticmethod
    def _check(key: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = None,
               floating: bool = False) -> None:
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(f"tensor {key!r}: expected shape {list(shape)}, found {list(tensor.shape)}")
        if dtype is not None and tensor.dtype != dtype:
            raise CheckpointError(f"tensor {key!r}: expected dtype {dtype}, found {tensor.dtype}")
        if floating and not tensor.dtype.is_floating_point:
            raise CheckpointError(f"tensor {key!r}: expected a floating-point weight, found {tensor.dtype}")


class _ExpertStacks:
    """Per-layer, per-projection stacks of all routed experts, filled one expert at a time (from any thread):
    on `device`, or split (`device_slots` given) between `device` (the first experts) and host RAM (the
    others, pinned when `device` is a GPU), but for `whole_layers`, kept whole on `device`."""

    def __init__(self, cfg: ModelConfig, device: torch.device, device_slots: int | None = None,
                 whole_layers: frozenset[int] = frozenset()) -> None:
        self.cfg, self.device, self.device_slots, self.whole_layers = cfg, device, device_slots, whole_layers
        self.stacks: dict[tuple[int, str], Weight | SplitStack] = {}
        self.lock = threading.Lock()
        self.slot_locks: dict[tuple[int, str], threading.Lock] = {}

    def put(self, layer: int, expert: int, proj: str, weight: Weight) -> None:
        stack = self.reserve(layer, proj, weight)
        kind = stack_format(stack)
        if kind is not type(weight):
            raise CheckpointError(f"layers.{layer}.mlp.experts.{expert}.{proj}: stored as {type(weight).__name__}, "
                                  f"other experts of this layer as {kind.__name__}")
        if not isinstance(stack, SplitStack):
            _copy_into(stack, expert, weight)
        elif expert < stack.slots:
            _copy_into(stack.device, expert, weight)
        else:
            _copy_into(stack.host, expert - stack.slots, weight)

    def reserve(self, layer: int, proj: str, like: Weight) -> Weight | SplitStack:
        """The stack of `layer`'s `proj`, allocated for weights like `like` if it is not yet. A split stack's
        device part is zeroed: hybrid offload runs slot 0 with weight zero for its misses, which may come
        before that expert's bytes do (early readiness)."""
        slot = (layer, proj)
        with self.lock:
            slot_lock = self.slot_locks.setdefault(slot, threading.Lock())
        with slot_lock:  # allocating one stack (pinning a GB or more) holds up only the puts into it
            if slot not in self.stacks:
                self.stacks[slot] = self._empty(layer, like)
            return self.stacks[slot]

    def _empty(self, layer: int, weight: Weight) -> Weight | SplitStack:
        count = self.cfg.n_routed_experts
        if self.device_slots is None or layer in self.whole_layers:
            return _empty_stack(weight, count, self.device, pin=False)
        slots = min(self.device_slots, count)
        spare = spare_entries(count - slots)
        return SplitStack(_empty_stack(weight, slots, self.device, pin=False, zero=True),
                          _empty_stack(weight, count - slots + spare, torch.device("cpu"),
                                       pin=self.device.type == "cuda"), spare)

    def finish(self) -> dict[str, Weight | SplitStack]:
        return {stacked_expert_name(layer, proj): stack for (layer, proj), stack in self.stacks.items()}


def _empty_stack(weight: Weight, count: int, device: torch.device, pin: bool, zero: bool = False) -> Weight:
    """A stack of `count` experts like `weight`: host ones in host bank memory (zero-filled, exact size)."""
    if device.type == "cpu":
        return map_tensors(weight, lambda t: host_empty((count, *t.shape), t.dtype, pin))
    make = torch.zeros if zero else torch.empty
    return map_tensors(weight, lambda t: make((count, *t.shape), dtype=t.dtype, device=device))


def _copy_into(stack: Weight, index: int, weight: Weight) -> None:
    for name in tensor_fields(stack):
        getattr(stack, name)[index].copy_(getattr(weight, name))
