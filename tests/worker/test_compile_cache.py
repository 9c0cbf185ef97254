"""Triton's kernel and autotuning cache follows the model cache onto the volume, unless the user chose."""

from __future__ import annotations

import subprocess
import sys

from triton import knobs

from worker.compile_cache import use_compile_cache


def test_triton_reads_the_cache_under_the_model_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    assert use_compile_cache(tmp_path) == tmp_path / "triton"
    assert knobs.cache.dir == str(tmp_path / "triton")
    assert knobs.autotuning.cache is True


def test_the_users_choice_stands(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")
    assert use_compile_cache(tmp_path / "models") == tmp_path / "mine"
    assert knobs.cache.dir == str(tmp_path / "mine")
    assert knobs.autotuning.cache is False


SCRIPT = """
import sys
from pathlib import Path
from worker.compile_cache import use_compile_cache
use_compile_cache(Path(sys.argv[1]))
import triton
import engine.kernels.kda.fla_prefill  # the engine's KDA prefill: defines fla's kernels
import fla.modules.l2norm as l2
tuners = [v for v in vars(l2).values() if isinstance(v, triton.runtime.autotuner.Autotuner)]
print(len(tuners), all(t.cache_results for t in tuners), triton.knobs.cache.dir)
"""


def test_fla_autotuners_cache_their_results_when_the_worker_set_the_cache_first(tmp_path):
    """The worker sets the variables before the engine is imported: fla's autotuners, defined at import,
    then keep their results on disk."""
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, env=env,
                         check=True).stdout.split()
    assert int(out[0]) > 0 and out[1:] == ["True", str(tmp_path / "triton")]
