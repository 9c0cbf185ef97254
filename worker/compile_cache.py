"""Triton's compiled kernels and autotuning results kept beside the models on the volume.

A cold start at full width spends most of its load stage compiling the Triton kernels and autotuning
fla's KDA prefill (~80 s on an H200 for a one-layer slice, against 2.4 s of weight reads). Triton keeps
both in its cache directory, by default under the home directory, which a container loses when it
restarts; kept under the model cache instead (the volume serverless platforms keep), the next start
on that volume loads them. Autotuning results are cached only when TRITON_CACHE_AUTOTUNING is set
before the kernels are defined, so this runs before the engine is imported. An image can carry kernels
compiled when it was built (`python -m engine.kernels.prebuilt DIR`): they are copied into that cache
first, so a fresh volume's first start does not compile them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("glmflash.provision")


def use_compile_cache(cache_dir: Path) -> Path:
    """Point Triton at `cache_dir/triton` and cache autotuning results there, unless the environment
    already chose (TRITON_CACHE_DIR, TRITON_CACHE_AUTOTUNING). Returns the directory Triton will use."""
    directory = Path(os.environ.setdefault("TRITON_CACHE_DIR", str(cache_dir / "triton")))
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    return directory


def seed_prebuilt_kernels(prebuilt: Path | None, triton_dir: Path) -> int:
    """Copy the kernels an image compiled at build time (GLMFLASH_PREBUILT_KERNELS) into the volume's Triton
    cache -> cache entries copied. A volume that cannot take them (full, read-only) compiles as without."""
    if prebuilt is None:
        return 0
    from engine.kernels.prebuilt import seed  # defines the kernels: after use_compile_cache

    try:
        return seed(prebuilt, triton_dir)
    except OSError as exc:
        log.warning("event=prebuilt_kernels_unseeded dir=%s error=%r", prebuilt, exc)
        return 0
