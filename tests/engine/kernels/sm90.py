"""Compiling a Triton kernel for sm_90 without a GPU (the interpreter the CPU tests run takes code the compiler
rejects), in a child process without TRITON_INTERPRET."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.child_env import child_env

HELPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend

def compile_for_sm90(fn, pointers, constants, num_warps, scalars=None):
    target = GPUTarget("cuda", 90, 32)
    options = make_backend(target).parse_options({"num_warps": num_warps})
    scalar = lambda name: (scalars or {}).get(name, "i32")
    signature = {name: "constexpr" if name in constants else pointers.get(name) or scalar(name)
                 for name in fn.arg_names}
    constexprs = {(i,): constants[name] for i, name in enumerate(fn.arg_names) if name in constants}
    triton.compile(ASTSource(fn, signature, constexprs), target=target, options=options.__dict__)
"""


def assert_compiles_for_sm90(script: str, cache_dir: Path) -> None:
    """Runs `script` (which calls compile_for_sm90) in a child and checks it printed 'compiled'."""
    done = subprocess.run([sys.executable, "-c", HELPER + script], capture_output=True, text=True,
                          env=child_env("TRITON_INTERPRET", TRITON_CACHE_DIR=str(cache_dir)))
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
