"""Kernel cache keys that do not depend on which kernel was hashed first: in fresh processes (compiled, not
interpreted: the tests' kernels run in Triton's interpreter) the expert kernels get the same settled keys
whichever helper was hashed before them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.child_env import child_env

KEYS = """
import json, sys
from engine.kernels.experts import decode, dequant, prefill
from engine.kernels.cache_keys import jit_functions, settle_cache_keys
if sys.argv[1] != "none":
    getattr(dequant, sys.argv[1]).cache_key  # a helper hashed on its own first
    decode._down_kernel.cache_key
unsettled = prefill._down_kernel.cache_key
rounds = settle_cache_keys([decode, prefill])
names = sorted(f"{fn.__module__}.{fn.__name__}" for fn in jit_functions([decode]))
print(json.dumps({"unsettled": unsettled, "rounds": rounds, "names": names,
                  "keys": [prefill._down_kernel.cache_key, decode._down_kernel.cache_key,
                           dequant.gemv_partial.cache_key]}))
"""


def keys_after(first: str) -> dict:
    done = subprocess.run([sys.executable, "-c", KEYS, first], env=child_env("TRITON_INTERPRET"), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def orders() -> dict[str, dict]:
    return {first: keys_after(first) for first in ("none", "e2m1_values", "group_scales")}


def test_settled_keys_do_not_depend_on_the_order(orders):
    assert len({json.dumps(result["keys"]) for result in orders.values()}) == 1
    assert all(1 <= result["rounds"] <= 4 for result in orders.values())


def test_the_closure_follows_helpers_into_their_modules(orders):
    names = orders["none"]["names"]
    assert "engine.kernels.experts.decode._down_kernel" in names
    assert {"engine.kernels.experts.dequant.gemv_partial", "engine.kernels.experts.dequant.e2m1_values",
            "engine.kernels.experts.dequant._fp16_pair"} <= set(names)
