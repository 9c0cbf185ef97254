"""Kernel-manifest entries of a real kernel of ours, as a GPU start records them, for the precompile and
prebuilt-kernel tests (no GPU needed: a compile targets an architecture)."""

from __future__ import annotations

import functools
import inspect
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.jit import serialize_specialization_data

from tests.child_env import child_env

KEY = {"capability": "9.0", "triton": triton.__version__, "dtype": "bfloat16",
       "shapes": "hidden=4096,experts=288,moe=2048,kda=64x128,vocab=154880"}


@functools.cache
def rms_norm_source() -> str:
    """`_rms_norm_kernel`'s source hash as a serving process sees it (compiled, not interpreted)."""
    code = ("from engine.kernels.norm.triton_norm import _rms_norm_kernel as k\n"
            "from engine.kernels.cache_keys import settle_loaded\nsettle_loaded()\nprint(k.cache_key)")
    done = subprocess.run([sys.executable, "-c", code], env=child_env("TRITON_INTERPRET"),
                          capture_output=True, text=True, check=True)
    return done.stdout.split()[-1]


def rms_norm_entry(block: int) -> dict[str, str]:
    """The entry a GPU start records for `_rms_norm_kernel` on bf16 rows of `block` columns."""
    signature = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "D": "i32", "stride_x": "i32",
                 "stride_out": "i32", "eps": "fp32", "BD": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(6)}
    target = GPUTarget("cuda", 90, 32)
    options = make_backend(target).parse_options({"num_warps": 4})
    since_3_7 = (target,) if "target" in inspect.signature(serialize_specialization_data).parameters else ()
    data = serialize_specialization_data("engine.kernels.norm.triton_norm._rms_norm_kernel", signature,
                                         {(7,): block}, attrs, options, f"rms-{block}", *since_3_7)
    return {"module": "engine.kernels.norm.triton_norm", "name": "_rms_norm_kernel", "data": data,
            "source": rms_norm_source()}


def cache_files(cache) -> set[str]:
    return {str(path.relative_to(cache)) for path in cache.rglob("*") if path.is_file()}
