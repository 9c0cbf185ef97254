"""Tune fla's KDA-prefill kernels on this GPU and write their best configs where the engine ships them
(engine/kernels/kda/tuned/sm<major><minor>/), in fla's config-file format:

    python -m ops.fla_tuned_configs [--heads 64 --dim 128] [--out DIR]

A fresh process with an empty Triton cache and fla's config lookup off: `warm_up_kda_prefill` at the
release's KDA shapes in bf16 makes fla's autotuners compile and time every candidate on an otherwise idle GPU
(a tuning inside a start competes with the weight copies). Triton keeps each result
(`<kernel>.autotune.json`, fla sets cache_results); each becomes `<kernel>.json`: fla's hash of the tuning
key -> the fastest config, merged into what the directory held. Run it again when an fla or Triton upgrade
changes the kernels or their candidates.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ops.bench_engine import RELEASED_TEXT

CONFIG_FIELDS = ("kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg", "ir_override")


def fastest(configs_timings: list[tuple[dict[str, Any], list[float]]]) -> dict[str, Any]:
    """Triton's own choice: the least (median, p20, p80) timing."""
    config, _ = min(configs_timings, key=lambda pair: pair[1])
    return {name: config.get(name) for name in CONFIG_FIELDS}


def convert(triton_cache: Path, out: Path) -> list[Path]:
    """Every autotuning result in a Triton cache -> fla config files in `out` (merged into those there)."""
    from fla.ops.utils.cache import AutotuneKey

    import triton

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for result in sorted(triton_cache.rglob("*.autotune.json")):
        kernel = result.name.removesuffix(".autotune.json")
        tuned = json.loads(result.read_text())
        file = out / f"{kernel}.json"
        config = json.loads(file.read_text()) if file.exists() else {"kernel_name": kernel, "autotune_entries": {}}
        config["triton_version"] = triton.__version__
        config["autotune_entries"][AutotuneKey.key_hash(tuned["key"])] = {
            "autotune_key": tuned["key"], "config": fastest(tuned["configs_timings"])}
        file.write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
        written.append(file)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=RELEASED_TEXT["linear_num_heads"])
    parser.add_argument("--dim", type=int, default=RELEASED_TEXT["linear_head_dim"])
    parser.add_argument("--out", type=Path, help="default: the engine's directory for this GPU architecture")
    args = parser.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="triton-tuning-"))
    # Before fla is imported (it reads these once): tune everything, and keep the results in an empty cache.
    os.environ.update(FLA_CACHE_MODE="disabled", FLA_CACHE_RESULTS="1", TRITON_CACHE_DIR=str(cache))

    import torch

    from engine.kernels.kda.fla_prefill import warm_up_kda_prefill
    from engine.kernels.kda.fla_tuning import TUNED

    major, minor = torch.cuda.get_device_capability()
    out = args.out or TUNED / f"sm{major}{minor}"
    warm_up_kda_prefill(torch.device("cuda", 0), args.heads, args.dim, torch.bfloat16)
    torch.cuda.synchronize()
    for file in convert(cache, out):
        print(f"kernel={file.stem} file={file}")


if __name__ == "__main__":
    main()
