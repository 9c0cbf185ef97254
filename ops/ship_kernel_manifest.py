"""Ship the kernel specializations a start recorded with the package, so a first start on a fresh volume
compiles them while its weights load (engine/kernels/manifests/sm<arch>-<dtype>.json, one per GPU
architecture and dtype, valid for the Triton it names):

    python -m ops.ship_kernel_manifest CACHE_DIR/models/*/kernels.json

Run it after a cold `glmflash boot` of a full-width snapshot (ops/gpu_serving.sh's boot part) on the GPU:
its start compiles what serving the release's shapes needs (the KDA prefill, the decode graphs, one prefill
per kernel tile size). Entries merge into those shipped for the same key; an entry whose kernel changed
since is skipped at start, so rerun it after changing a kernel. `--resettle MANIFEST` rewrites a shipped
manifest's source hashes as this installation computes them (for one recorded before the keys were settled).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.kernels.manifest_store import packaged_manifest, read_manifest


def resettle(manifest: Path) -> int:
    """Each entry's source hash as this installation gives it with settled keys (engine/kernels/cache_keys.py)
    -> entries changed. For a manifest recorded before keys were settled; run it where the manifest's
    kernels run (a kernel reading the hardware at import may hash otherwise elsewhere)."""
    from engine.kernels.cache_keys import settle_kernel_keys
    from engine.kernels.manifest_store import resolve

    settle_kernel_keys()
    shipped = json.loads(manifest.read_text())
    changed = 0
    for entry in shipped["kernels"]:
        source = resolve(entry["module"], entry["name"]).cache_key
        changed += source != entry["source"]
        entry["source"] = source
    manifest.write_text(json.dumps(shipped, indent=1) + "\n")
    return changed


def ship(recorded: list[Path]) -> list[Path]:
    written = []
    for file in recorded:
        key = json.loads(file.read_text())["key"]
        target = packaged_manifest(key)
        entries = {e["data"]: e for e in read_manifest(target, key) + read_manifest(file, key)}
        target.parent.mkdir(parents=True, exist_ok=True)
        kernels = sorted(entries.values(), key=lambda e: (e["module"], e["name"], e["data"]))
        target.write_text(json.dumps({"key": key, "kernels": kernels}, indent=1) + "\n")
        print(f"manifest={target} kernels={len(kernels)} from={file}")
        written.append(target)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recorded", nargs="*", type=Path, help="kernels.json files beside prepared snapshots")
    parser.add_argument("--resettle", type=Path, metavar="MANIFEST", help="refresh a shipped manifest's sources")
    args = parser.parse_args()
    ship(args.recorded)
    if args.resettle:
        print(f"manifest={args.resettle} sources_changed={resettle(args.resettle)}")


if __name__ == "__main__":
    main()
