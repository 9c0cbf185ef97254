"""The README's install lines are the ones CI runs: CI can pass only where a newcomer following the
README would."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_install_lines() -> list[str]:
    """The commands of the README's first shell block that install (everything before `glmflash serve`)."""
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    commands = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    return commands[:next(i for i, command in enumerate(commands) if command.startswith("glmflash "))]


def test_ci_runs_the_readmes_install_lines_as_written_and_in_order():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    install = readme_install_lines()
    assert install and any(line.startswith("pip install -e") for line in install)
    start = ci.index(install[0])
    assert ci[start:start + len(install)] == install


def test_ci_runs_the_readmes_test_command_last():
    block = (ROOT / "README.md").read_text().split("Run the tests")[1]
    command = re.search(r"```bash\n(.*?)\n", block).group(1).split("  #")[0].strip()
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert ci[-1] == command
