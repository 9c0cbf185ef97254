"""The fla configs shipped per GPU architecture: fla's own reader finds them for the keys they were tuned
for, under kernel names fla still has, and they are offered only before fla's import fixes its mode. (That
each is one of its kernel's candidates, which fla picks by the GPU, is checked on one: tests/gpu.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.child_env import child_env
from engine.kernels.kda.fla_tuning import TUNED, tuned_dir
from ops.fla_tuned_configs import convert

SHIPPED = sorted(TUNED.glob("*/*.json"))


def fla_autotuners() -> dict[str, object]:
    """Every fla kernel with a config-file autotuner, by kernel name (the KDA prefill's modules imported)."""
    import fla.ops.kda  # noqa: F401 - imports the chunk kernels it runs
    from fla.ops.utils.cache import CachedAutotuner

    found = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("fla.") and module is not None:
            for value in vars(module).values():
                while value is not None and not isinstance(value, CachedAutotuner) and hasattr(value, "fn"):
                    value = value.fn
                if isinstance(value, CachedAutotuner):
                    found[value.kernel_name] = value
    return found


def test_sm90_configs_are_shipped():
    assert tuned_dir((9, 0)) is not None and len(list(tuned_dir((9, 0)).glob("*.json"))) >= 6
    assert tuned_dir((7, 5)) is None


@pytest.mark.parametrize("file", SHIPPED, ids=lambda f: f"{f.parent.name}/{f.stem}")
def test_shipped_configs_are_candidates_fla_finds(file):
    from fla.ops.utils.cache import AutotuneKey, KernelConfigFile

    assert file.stem in fla_autotuners(), f"{file.stem}: no such fla kernel (renamed in an fla upgrade?)"
    parsed = KernelConfigFile.from_file(file)
    assert parsed is not None and parsed.autotune_entries
    for entry in parsed.autotune_entries.values():
        key = AutotuneKey(tuple(entry["autotune_key"]))
        assert parsed.lookup_exact(key) is entry
        assert entry["config"].keys() >= {"kwargs", "num_warps", "num_stages", "num_ctas"}


LOOKUP = """
import json, sys
from engine.kernels.kda.fla_tuning import use_tuned_configs
if sys.argv[1] == "fla-first":
    import fla.ops.utils.cache
used = use_tuned_configs((9, 0))
from fla.ops.utils.cache import AutotuneKey, load_cached_config
key = AutotuneKey(tuple(json.loads(sys.argv[2])))
print(json.dumps({"used": str(used) if used else None, "config": load_cached_config(sys.argv[3], key)}))
"""


KERNEL = "chunk_local_cumsum_vector_kernel"


def lookup(order: str, key: list) -> dict:
    done = subprocess.run([sys.executable, "-c", LOOKUP, order, json.dumps(key), KERNEL], capture_output=True,
                          text=True, env=child_env("FLA_"), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_fla_reads_the_shipped_config_when_offered_before_its_import():
    shipped = json.loads((TUNED / "sm90" / f"{KERNEL}.json").read_text())
    entry = next(iter(shipped["autotune_entries"].values()))
    found = lookup("ours-first", entry["autotune_key"])
    assert found == {"used": str(TUNED / "sm90"), "config": entry["config"]}
    other_key = [entry["autotune_key"][0] + 1, *entry["autotune_key"][1:]]  # a shape not shipped: autotuned
    assert lookup("ours-first", other_key)["config"] is None
    assert lookup("fla-first", entry["autotune_key"]) == {"used": None, "config": None}


def test_convert_keeps_the_fastest_config_and_merges(tmp_path):
    from fla.ops.utils.cache import AutotuneKey

    def result(key: list, timings: list[tuple[int, float]]) -> dict:
        return {"key": key, "configs_timings": [
            ({"kwargs": {"BT": bt}, "num_warps": 4, "num_ctas": 1, "num_stages": 2, "maxnreg": None,
              "pre_hook": None, "ir_override": None}, [t, t * 0.9, t * 1.1]) for bt, t in timings]}

    cache = tmp_path / "triton"
    for directory, key, timings in (("A", [128, 1, "torch.bfloat16"], [(8, 0.5), (16, 0.2), (32, 0.3)]),
                                    ("B", [128, 2, "torch.bfloat16"], [(8, 0.1), (16, 0.2)])):
        (cache / directory).mkdir(parents=True)
        (cache / directory / "k.autotune.json").write_text(json.dumps(result(key, timings)))
    written = convert(cache, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "k.json").read_text())
    assert written == [tmp_path / "out" / "k.json"] * 2 and config["kernel_name"] == "k"
    by_key = {json.dumps(e["autotune_key"]): e["config"]["kwargs"]["BT"] for e in config["autotune_entries"].values()}
    assert by_key == {json.dumps([128, 1, "torch.bfloat16"]): 16, json.dumps([128, 2, "torch.bfloat16"]): 8}
    assert AutotuneKey.key_hash([128, 1, "torch.bfloat16"]) in config["autotune_entries"]
