"""Kernels compiled when an image is built, so a first start on a fresh volume compiles almost nothing.

A cold start on an H200 spent ~35 s of a 20 GB slice's ~50 s compiling the shipped kernel manifest
(ops/BENCHMARKS.md), on every fresh volume: serverless workers start on new machines with new volumes.
A compile targets an architecture, not a device, so an image's build (no GPU needed) can compile the
package's manifests into a directory of its own (`build`): Triton's cache files plus a manifest of what they
hold. At start, `seed` copies those cache entries into the volume's Triton cache (a few MB) and leaves the
manifest beside them: the engine then counts those entries as already compiled (`seeded_manifest`), loads
them from the cache and starts children only for the rest. An entry whose source hashes otherwise on the
build machine is left out: fla's `chunk_kda_fwd_kernel_inter_solve_fused` reads the GPU (TF32 support) at
import, so on a machine without one its key differs; it is compiled at start as before.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
from pathlib import Path

from engine.kernels.manifest_store import MANIFESTS, merged_entries, resolve
from engine.kernels.precompile import precompile, precompile_processes

log = logging.getLogger("glmflash.engine")

MANIFEST = "glmflash-prebuilt.json"  # in a prebuilt directory and in a Triton cache seeded from one
TRITON = "triton"  # a prebuilt directory's Triton cache


def build(directory: Path, manifests: list[Path], processes: int) -> tuple[int, int]:
    """Compile each manifest's entries whose source hashes here as it was recorded into `directory`/triton,
    list them in `directory`/MANIFEST -> (entries compiled, entries left out)."""
    import triton

    from engine.kernels.cache_keys import settle_kernel_keys

    os.environ["TRITON_CACHE_DIR"] = str(directory / TRITON)  # the children's cache
    settle_kernel_keys()
    compiled: list[dict] = []
    left_out = 0
    for file in manifests:
        manifest = json.loads(file.read_text())
        key, entries = manifest["key"], manifest["kernels"]
        if key["triton"] != triton.__version__:  # binaries of another Triton would never be looked up
            log.warning("event=prebuild_skipped manifest=%s triton=%s installed=%s", file, key["triton"],
                        triton.__version__)
            left_out += len(entries)
            continue
        ours = [e for e in entries if _hashes_here(e)]
        capability = int(key["capability"].replace(".", ""))
        done = sum(count for _, count in precompile(ours, capability, processes))
        if done == len(ours):
            compiled.append({"key": key, "kernels": ours})
            left_out += len(entries) - len(ours)
        else:  # which ones a failed child left out is not known: none is listed, a start compiles them all
            log.warning("event=prebuild_incomplete manifest=%s compiled=%d of=%d", file, done, len(ours))
            left_out += len(entries)
    (directory / MANIFEST).write_text(json.dumps(compiled))
    return sum(len(m["kernels"]) for m in compiled), left_out


def _hashes_here(entry: dict[str, str]) -> bool:
    try:
        return resolve(entry["module"], entry["name"]).cache_key == entry["source"]
    except Exception:  # noqa: BLE001 - a kernel renamed since: not prebuilt
        return False


def seed(prebuilt: Path, triton_dir: Path) -> int:
    """Copy the prebuilt Triton cache entries `triton_dir` lacks into it and merge the prebuilt manifest into
    its own -> entries copied. Each entry lands under a temporary name and is renamed, so a start killed
    midway leaves whole entries only (Triton trusts any entry it finds)."""
    source = prebuilt / TRITON
    if not (prebuilt / MANIFEST).is_file() or not source.is_dir():
        return 0
    triton_dir.mkdir(parents=True, exist_ok=True)
    copied = 0
    for entry in source.iterdir():
        target = triton_dir / entry.name
        if target.exists() or not entry.is_dir():
            continue
        part = triton_dir / f".{entry.name}.{os.getpid()}.part"
        shutil.rmtree(part, ignore_errors=True)
        shutil.copytree(entry, part)
        try:
            os.rename(part, target)
            copied += 1
        except OSError:  # another start seeded it first
            shutil.rmtree(part, ignore_errors=True)
    manifests = seeded_manifests(triton_dir)
    for manifest in json.loads((prebuilt / MANIFEST).read_text()):
        same = [m for m in manifests if m["key"] == manifest["key"]]
        if same:
            same[0]["kernels"] = merged_entries(same[0]["kernels"], manifest["kernels"])
        else:
            manifests.append(manifest)
    part = triton_dir / f".{MANIFEST}.{os.getpid()}.part"
    part.write_text(json.dumps(manifests))
    os.replace(part, triton_dir / MANIFEST)
    return copied


def seeded_manifests(triton_dir: Path) -> list[dict]:
    """The manifests a Triton cache was seeded with ([] when none or unreadable)."""
    try:
        manifests = json.loads((triton_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return []
    return [m for m in manifests if isinstance(m, dict) and isinstance(m.get("kernels"), list) and "key" in m]


def seeded_manifest(triton_dir: Path, key: dict[str, str]) -> list[dict[str, str]]:
    """The entries seeded into `triton_dir` under `key`: compiled there already."""
    return [e for m in seeded_manifests(triton_dir) if m["key"] == key for e in m["kernels"]]


def main() -> None:
    parser = argparse.ArgumentParser(description="Compile the package's kernel manifests into DIRECTORY (an "
                                                 "image's build step; no GPU needed), for GLMFLASH_PREBUILT_KERNELS.")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--manifest", type=Path, action="append",
                        help="a manifest to compile (default: every one the package ships)")
    parser.add_argument("--processes", type=int, default=precompile_processes())
    args = parser.parse_args()
    logging.basicConfig(level="INFO", format="level=%(levelname)s logger=%(name)s %(message)s")
    args.directory.mkdir(parents=True, exist_ok=True)
    compiled, left_out = build(args.directory, args.manifest or sorted(MANIFESTS.glob("*.json")), args.processes)
    print(f"event=prebuilt directory={args.directory} compiled={compiled} left_out={left_out}", flush=True)


if __name__ == "__main__":
    main()
