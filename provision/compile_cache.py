"""Triton's compiled kernels and autotuning results kept beside the models on the volume.

A cold start at full width spends most of its load stage compiling the Triton kernels and autotuning
fla's KDA prefill (~80 s on an H200 for a one-layer slice, against 2.4 s of weight reads). Triton keeps
both in its cache directory, by default under the home directory, which a container loses when it
restarts; kept under the model cache instead (the volume serverless platforms keep), the next start
on that volume loads them. Autotuning results are cached only when TRITON_CACHE_AUTOTUNING is set
before the kernels are defined, so this runs before the engine is imported.
"""

from __future__ import annotations

import os
from pathlib import Path


def use_compile_cache(cache_dir: Path) -> Path:
    """Point Triton at `cache_dir/triton` and cache autotuning results there, unless the environment
    already chose (TRITON_CACHE_DIR, TRITON_CACHE_AUTOTUNING). Returns the directory Triton will use."""
    directory = Path(os.environ.setdefault("TRITON_CACHE_DIR", str(cache_dir / "triton")))
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    return directory
