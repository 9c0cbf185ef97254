"""Kernel manifests at rest: the ones the package ships, one read back for its key, entry lists merged, and
the Triton JIT function an entry names. The start's recording and preload (`kernel_manifest`), the offline
compiles (`precompile`) and the image's prebuilt kernels (`prebuilt`) all read manifests through here.

An entry is one compiled specialization: {"module", "name" (qualified), "data" (Triton's specialization data),
"source" (the kernel's source hash when it was recorded)}.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

MANIFESTS = Path(__file__).with_name("manifests")  # the manifests the package ships


def packaged_manifest(key: dict[str, str]) -> Path:
    """The manifest shipped for a GPU architecture and dtype (written by a start at the release's shapes:
    a first start on a fresh volume preloads it); valid only for the Triton it names."""
    return MANIFESTS / f"sm{key['capability'].replace('.', '')}-{key['dtype']}.json"


def _written_under(file: Path, key: dict[str, str]) -> dict | None:
    """The manifest file's content when it was written under `key`; None when absent, unreadable or another's."""
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("key") == key else None


def read_manifest(file: Path, key: dict[str, str]) -> list[dict[str, str]]:
    """The manifest's entries when it was written under `key`; [] when absent, unreadable or for another
    GPU architecture, Triton or dtype."""
    manifest = _written_under(file, key)
    if manifest is None or not isinstance(manifest.get("kernels"), list):
        return []
    return [e for e in manifest["kernels"] if isinstance(e, dict) and {"module", "name", "data", "source"} <= e.keys()]


def read_warm_up(file: Path, key: dict[str, str]) -> dict | None:
    """The prefill warm-up an earlier start recorded with its manifest under `key` ({"signature", "lengths"}), or
    None."""
    warmed = (_written_under(file, key) or {}).get("warmed")
    if not isinstance(warmed, dict) or not isinstance(warmed.get("signature"), dict) \
            or not isinstance(warmed.get("lengths"), list):
        return None
    return warmed


def merged_entries(first: list[dict[str, str]], then: list[dict[str, str]]) -> list[dict[str, str]]:
    """`first`, then the entries of `then` for specializations `first` lacks."""
    known = {entry["data"] for entry in first}
    return first + [entry for entry in then if entry["data"] not in known]


def resolve(module: str, name: str) -> Any:
    """The JIT function a manifest entry names: the module's attribute by qualified name, unwrapped from
    autotuners and heuristics (their `.fn`) down to what has `preload` and a source hash (`cache_key`)."""
    target: Any = importlib.import_module(module)
    for part in name.split("."):
        target = getattr(target, part)
    while not hasattr(target, "preload") and hasattr(target, "fn"):
        target = target.fn
    if not (hasattr(target, "preload") and hasattr(target, "cache_key")):
        raise TypeError(f"{module}.{name} is not a Triton JIT function")
    return target
