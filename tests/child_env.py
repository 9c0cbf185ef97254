"""The environment of a Python child process a test starts: this checkout first on its import path, then
what the caller's PYTHONPATH held (wheels installed beside it on a GPU machine)."""

from __future__ import annotations

import os


def child_env(*drop_prefixes: str, **overrides: str) -> dict[str, str]:
    """os.environ less the variables starting with any of `drop_prefixes`, plus `overrides`."""
    env = {k: v for k, v in os.environ.items() if not (drop_prefixes and k.startswith(drop_prefixes))}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])
    return {**env, **overrides}
