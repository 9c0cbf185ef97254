"""The shipped fla configs on a GPU they were tuned for: each is one of its kernel's candidates here (an fla
or Triton upgrade that changes them fails), and a KDA prefill warm-up in a fresh process with an empty
Triton cache compiles one specialization per kernel instead of timing every candidate."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.child_env import child_env
from engine.kernels.kda.fla_tuning import tuned_dir

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]

WARM_UP = """
import json, torch
from engine.kernels.kda.fla_tuning import use_tuned_configs
from engine.kernels.kernel_manifest import record_compiles
from engine.kernels.kda.fla_prefill import warm_up_kda_prefill
use_tuned_configs(torch.cuda.get_device_capability())
compiles = record_compiles(None, {})
warm_up_kda_prefill(torch.device("cuda", 0), 64, 128, torch.bfloat16)
torch.cuda.synchronize()
print(json.dumps({"kernels": sorted(k.rsplit(".", 1)[-1] for k in compiles.by_kernel), "count": compiles.count}))
"""


@pytest.fixture(scope="module")
def shipped():
    directory = tuned_dir(torch.cuda.get_device_capability())
    if directory is None:
        pytest.skip("no configs shipped for this GPU architecture (python -m ops.fla_tuned_configs writes them)")
    return directory


def test_shipped_configs_are_this_gpus_candidates(shipped):
    from tests.engine.kernels.test_fla_tuning import fla_autotuners

    tuners = fla_autotuners()
    for file in shipped.glob("*.json"):
        candidates = [(c.kwargs, c.num_warps, c.num_stages) for c in tuners[file.stem].configs]
        for entry in json.loads(file.read_text())["autotune_entries"].values():
            config = entry["config"]
            assert (config["kwargs"], config["num_warps"], config["num_stages"]) in candidates, file.stem


def test_warm_up_compiles_one_config_per_kernel(shipped, tmp_path):
    env = child_env("FLA_", TRITON_CACHE_DIR=str(tmp_path / "triton"))
    done = subprocess.run([sys.executable, "-c", WARM_UP], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    kernels = {file.stem for file in shipped.glob("*.json")}
    assert kernels <= set(result["kernels"])
    assert result["count"] <= len(result["kernels"]) + 2, result  # not one compile per candidate
