"""Read a glm5_next snapshot directory into the engine's weight objects, shard by shard.

Every key is first mapped to the layout table (engine.checkpoint.layout) from the safetensors
headers alone, so a missing, extra or malformed tensor fails before any data is read. Data is then
read one shard at a time; routed experts are copied into per-layer stacks as they arrive, so peak
host memory stays near the model's own size. Vision tower and MTP tensors are recognised and skipped.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator
import torch
from safetensors import safe_open

from engine.checkpoint.layout import EXPERT_KEY, TEXT_PREFIX, TensorSpec, stacked_expert_name, text_specs
from engine.config import ModelConfig
from engine.offload.placement import WeightBytes
from engine.weights import DenseWeight, Fp8BlockWeight, Nvfp4Weight, SplitStack, Weight, map_tensors, tensor_fields

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
SKIPPED = re.compile(r"^(model\.visual\.|visual\.|model\.vision_tower\.|.*\.shared_head\.|.*hc_head)")


class CheckpointError(ValueError):
    """A snapshot cannot be loaded; the message names the file or tensor and what was expected."""


@dataclass
class _Group:
    """The checkpoint keys that together make one logical tensor."""

    spec: TensorSpec
    keys: dict[str, str] = field(default_factory=dict)  # suffix ("" for plain tensors) -> checkpoint key
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.tensors) == len(self.keys)


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


def checkpoint_sizes(snapshot: Path, cfg: ModelConfig) -> WeightBytes:
    """Bytes of the snapshot's weight shards and of its routed experts, from the safetensors headers alone
    (no tensor is read): near enough to decide placement before loading."""
    experts = 0
    for path in shard_files(snapshot):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for key, entry in header.items():
            name = logical_name(key, cfg.num_layers) if key != "__metadata__" else None
            if name is not None and EXPERT_KEY.match(name.rpartition(".")[0]):
                start, end = entry["data_offsets"]
                experts += end - start
    return WeightBytes(sum(path.stat().st_size for path in shard_files(snapshot)), experts)


def logical_name(key: str, num_layers: int) -> str | None:
    """The layout name for a checkpoint key, or None for tensors the text model does not use."""
    if SKIPPED.match(key):
        return None
    if key.startswith(TEXT_PREFIX):
        name = key[len(TEXT_PREFIX):]
    elif key.startswith("model."):
        name = key[len("model."):]
    else:
        name = key
    layer = re.match(r"^layers\.(\d+)\.", name)
    if layer and int(layer.group(1)) >= num_layers:  # MTP layer(s), loaded by the speculative path later
        return None
    return name


def load_weights(snapshot: Path | str, cfg: ModelConfig, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.bfloat16, expert_slots: int | None = None) -> LoadedWeights:
    """Load the text model's tensors; see the module docstring for the guarantees. With `expert_slots`
    each MoE layer's first `expert_slots` routed experts go to `device` and the others straight to host
    RAM (pinned when `device` is a GPU): expert stacks are `SplitStack`s."""
    snapshot = Path(snapshot)
    files = shard_files(snapshot)
    groups, key_file = _plan(files, cfg)
    by_file: dict[Path, list[tuple[str, _Group, str]]] = defaultdict(list)
    for group in groups.values():
        for suffix, key in group.keys.items():
            by_file[key_file[key]].append((key, group, suffix))

    def complete_groups() -> Iterator[tuple[TensorSpec, dict[str, torch.Tensor]]]:
        for path in files:
            with _open(path) as f:
                for key, group, suffix in by_file[path]:
                    group.tensors[suffix] = _read(f, key, path)
                    if group.complete:
                        yield group.spec, group.tensors
                        group.tensors = {}

    return assemble(cfg, complete_groups(), device, dtype, expert_slots)


def assemble(cfg: ModelConfig, groups: Iterable[tuple[TensorSpec, dict[str, torch.Tensor]]],
             device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
             expert_slots: int | None = None) -> LoadedWeights:
    """Turn complete tensor groups (suffix -> tensor; "" for plain tensors) into weight objects.

    Shared by file loading and by synthetic weights built in memory for benchmarks.
    """
    device = torch.device(device)
    out: LoadedWeights = {}
    stacks = _ExpertStacks(cfg, device, expert_slots)
    builder = _Builder(cfg, device, dtype)
    expert_builder = builder if expert_slots is None else _Builder(cfg, torch.device("cpu"), dtype)
    for spec, tensors in groups:
        expert = EXPERT_KEY.match(spec.name)
        if expert:
            weight = expert_builder.build(spec, tensors)
            stacks.put(int(expert.group(1)), int(expert.group(2)), expert.group(3), weight)
        else:
            out[spec.name] = builder.build(spec, tensors)
    out.update(stacks.finish())
    return out


def _plan(files: list[Path], cfg: ModelConfig) -> tuple[dict[str, _Group], dict[str, Path]]:
    """Map every stored key to its layout entry from the headers; fail on unknown, missing or malformed sets."""
    specs = {s.name: s for s in text_specs(cfg)}
    groups: dict[str, _Group] = {}
    key_file: dict[str, Path] = {}
    for path in files:
        with _open(path) as f:
            keys = list(f.keys())
        for key in keys:
            name = logical_name(key, cfg.num_layers)
            if name is None:
                continue
            key_file[key] = path
            if name in specs and specs[name].role != "linear":
                groups.setdefault(name, _Group(specs[name])).keys[""] = key
                continue
            base, _, suffix = name.rpartition(".")
            spec = specs.get(base)
            if spec is None or spec.role != "linear" or suffix not in LINEAR_SUFFIXES:
                raise CheckpointError(f"{path.name}: unexpected tensor {key!r} (not part of the glm5_next text model)")
            if suffix not in IGNORED_SUFFIXES:
                groups.setdefault(base, _Group(spec)).keys[suffix] = key
    for name, spec in specs.items():
        if name not in groups:
            hint = f"{TEXT_PREFIX}{name}" + (".weight" if spec.role == "linear" else "")
            if name == "lm_head":
                hint = "lm_head.weight"
            raise CheckpointError(f"missing tensor {hint!r} (expected shape {list(spec.shape)})")
        found = frozenset(groups[name].keys)
        if spec.role == "linear" and found not in FORMATS.values():
            raise CheckpointError(
                f"tensor {name!r} has parts {sorted(found)}, which match no known format "
                f"(expected one of {[sorted(v) for v in FORMATS.values()]})")
    return groups, key_file


class _open:
    """safe_open that reports a damaged file by name instead of a bare library error."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self):
        try:
            self.handle = safe_open(str(self.path), framework="pt", device="cpu")
            return self.handle.__enter__()
        except Exception as exc:  # safetensors raises its own error types for truncated/garbled files
            raise CheckpointError(f"{self.path.name}: cannot read safetensors file ({exc})") from exc

    def __exit__(self, *exc_info) -> None:
        self.handle.__exit__(*exc_info)


def _read(f, key: str, path: Path) -> torch.Tensor:
    try:
        return f.get_tensor(key)
    except Exception as exc:
        raise CheckpointError(f"{path.name}: cannot read tensor {key!r} ({exc})") from exc


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
        # compressed-tensors stores a divisor, ModelOpt a multiplier; the engine holds multipliers.
        glob = glob.reciprocal() if kind == "nvfp4_ct" else glob
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
    """Per-layer, per-projection stacks of all routed experts, filled one expert at a time: on `device`, or
    split (`device_slots` given) between `device` (the first experts) and host RAM (the others, pinned
    when `device` is a GPU)."""

    def __init__(self, cfg: ModelConfig, device: torch.device, device_slots: int | None = None) -> None:
        self.cfg, self.device, self.device_slots = cfg, device, device_slots
        self.stacks: dict[tuple[int, str], Weight | SplitStack] = {}

    def put(self, layer: int, expert: int, proj: str, weight: Weight) -> None:
        slot = (layer, proj)
        if slot not in self.stacks:
            self.stacks[slot] = self._empty(weight)
        stack = self.stacks[slot]
        kind = type(stack.host if isinstance(stack, SplitStack) else stack)
        if kind is not type(weight):
            raise CheckpointError(f"layers.{layer}.mlp.experts.{expert}.{proj}: stored as {type(weight).__name__}, "
                                  f"other experts of this layer as {kind.__name__}")
        if not isinstance(stack, SplitStack):
            _copy_into(stack, expert, weight)
        elif expert < stack.slots:
            _copy_into(stack.device, expert, weight)
        else:
            _copy_into(stack.host, expert - stack.slots, weight)

    def _empty(self, weight: Weight) -> Weight | SplitStack:
        count = self.cfg.n_routed_experts
        if self.device_slots is None:
            return _empty_stack(weight, count, self.device, pin=False)
        slots = min(self.device_slots, count)
        return SplitStack(_empty_stack(weight, slots, self.device, pin=False),
                          _empty_stack(weight, count - slots, torch.device("cpu"), pin=self.device.type == "cuda"))

    def finish(self) -> dict[str, Weight | SplitStack]:
        return {stacked_expert_name(layer, proj): stack for (layer, proj), stack in self.stacks.items()}


def _empty_stack(weight: Weight, count: int, device: torch.device, pin: bool) -> Weight:
    return map_tensors(weight, lambda t: torch.empty((count, *t.shape), dtype=t.dtype, device=device, pin_memory=pin))


def _copy_into(stack: Weight, index: int, weight: Weight) -> None:
    for name in tensor_fields(stack):
        getattr(stack, name)[index].copy_(getattr(weight, name))
