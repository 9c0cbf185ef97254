"""fla's KDA ops imported without torch's compiler stack: the import leaves torch._dynamo unloaded, the
decorators it defers still compile at a function's first call, and torch's own are put back."""

from __future__ import annotations

import subprocess
import sys

import torch

from engine.kernels.kda.fla_import import compiler_deferred
from tests.child_env import child_env


def test_importing_fla_kda_leaves_the_compiler_stack_unloaded():
    code = ("import sys, torch; real = torch.compile\n"
            "from engine.kernels.kda.fla_import import import_fla_kda\n"
            "kda = import_fla_kda()\n"
            "assert callable(kda.chunk_kda) and torch.compile is real\n"
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor.compile_fx') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_deferred_compile_compiles_at_the_first_call_and_disable_is_the_identity():
    real_compile, real_disable = torch.compile, torch.compiler.disable

    def square_plus_one(x: torch.Tensor) -> torch.Tensor:
        return x * x + 1

    with compiler_deferred():
        with_options = torch.compile(backend="eager")(square_plus_one)
        direct = torch.compile(square_plus_one, backend="eager")
        assert torch.compiler.disable(square_plus_one) is square_plus_one
        assert torch.compiler.disable(recursive=False)(square_plus_one) is square_plus_one
    assert torch.compile is real_compile and torch.compiler.disable is real_disable
    x = torch.arange(6.0)
    for fn in (with_options, direct):
        assert fn.__name__ == "square_plus_one"
        torch.testing.assert_close(fn(x), square_plus_one(x))
        torch.testing.assert_close(fn(x + 1), square_plus_one(x + 1))  # the compiled one, kept
