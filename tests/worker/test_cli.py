"""The console script's first seconds: the disk starts reading the model once the imports are done, before serving
starts (the memory plan, the host banks and the kernels' preload come before the load's first read)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# Run in a fresh interpreter: the readahead is replaced by a probe that reports what was imported by then, and ends
# the process before anything is served.
PROBE = """
import json, sys
import worker.cli as cli

def probe(files):
    print(json.dumps({"torch": "torch" in sys.modules, "serve": "worker.serve" in sys.modules,
                      "files": [str(path) for path, _ in files]}))
    raise SystemExit(0)

cli.start_readahead = probe
cli.main(sys.argv[1:])
"""


def test_the_readahead_starts_after_the_imports_before_serving(tmp_path: Path):
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "model-00001.safetensors").write_bytes(b"\0" * 64)
    prebuilt = tmp_path / "prebuilt"  # an image's kernels: seeding them imports the kernels (torch, triton)
    prebuilt.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLMFLASH_")}
    run = subprocess.run([sys.executable, "-c", PROBE, "boot", "--model", str(snapshot), "--cache-dir",
                          str(tmp_path / "cache")], capture_output=True, text=True, timeout=120,
                         env={**env, "GLMFLASH_PREBUILT_KERNELS": str(prebuilt)})
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen == {"torch": True, "serve": True, "files": [str(snapshot / "model-00001.safetensors")]}
