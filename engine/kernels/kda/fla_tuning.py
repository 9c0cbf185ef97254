"""fla's KDA-prefill kernels with their tuning shipped for the GPU architectures we measured.

fla autotunes each chunk kernel at its first call: every candidate config is compiled and timed. With an
empty Triton cache (a fresh volume) that was 139 compiles and 84 s of a 20 GB start on an H200, longer than
its reads (ops/BENCHMARKS.md). fla reads best configs from `FLA_CONFIG_DIR/<kernel>.json` when
`FLA_CACHE_MODE` asks for it, as vLLM ships its fused-MoE configs per device. `tuned/sm<major><minor>/`
holds them for our model's shapes, written by `python -m ops.fla_tuned_configs` on such a GPU; they are
offered before fla is imported (fla reads the mode once, at import). Strict mode: a key the files lack
(other head counts, a prefill step of more than 65,536 tokens) is autotuned as before. A user's own
FLA_CACHE_MODE / FLA_CONFIG_DIR win.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("glmflash.engine")

TUNED = Path(__file__).with_name("tuned")


def tuned_dir(capability: tuple[int, int]) -> Path | None:
    """The shipped configs for a GPU architecture (an H100's serve an H200: same SMs), or None."""
    directory = TUNED / f"sm{capability[0]}{capability[1]}"
    return directory if directory.is_dir() else None


@functools.cache
def use_tuned_configs(capability: tuple[int, int]) -> Path | None:
    """Point fla at the shipped configs for `capability` -> the directory fla will read, or None (none
    shipped, or fla was imported before with its config lookup off: it then autotunes as without)."""
    directory = tuned_dir(capability)
    if directory is None:
        return None
    if "fla.ops.utils.cache" in sys.modules and "FLA_CACHE_MODE" not in os.environ:
        log.info("event=fla_tuned_configs used=no reason=fla_imported_first")
        return None
    os.environ.setdefault("FLA_CACHE_MODE", "strict")
    os.environ.setdefault("FLA_CONFIG_DIR", str(directory))
    log.info("event=fla_tuned_configs dir=%s mode=%s", os.environ["FLA_CONFIG_DIR"], os.environ["FLA_CACHE_MODE"])
    return Path(os.environ["FLA_CONFIG_DIR"])
