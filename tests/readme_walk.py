"""The README's five-minute walk as data: its commands, extracted from README.md, run verbatim in a directory.

``workbench`` in them is the command a user types; here it runs this checkout's package through a shim on PATH
(``python3 -m workbench`` with the checkout first on PYTHONPATH), so an installed older copy cannot answer instead.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WALK_HEADING = "## A five-minute walk"


def walk_blocks(readme: str | None = None) -> list[list[str]]:
    """The ```bash blocks of the walk section, each as its command lines (blank lines dropped)."""
    text = readme if readme is not None else (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index(WALK_HEADING)
    end = text.find("\n## ", start + len(WALK_HEADING))
    section = text[start:end if end != -1 else len(text)]
    return [[line for line in block.splitlines() if line.strip()]
            for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def walk_commands() -> list[str]:
    """The commands that make and check the checkpoint: the walk's first block."""
    return walk_blocks()[0]


def shim_env(bin_dir: Path) -> dict[str, str]:
    """An environment whose ``workbench`` runs this checkout (a shim written into ``bin_dir``)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    shim = bin_dir / "workbench"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m workbench "$@"\n')
    shim.chmod(0o755)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def run_walk(cwd: Path, commands: list[str] | None = None) -> list[subprocess.CompletedProcess]:
    """Run each command verbatim with bash in ``cwd``; returns the finished processes (the caller checks them)."""
    env = shim_env(cwd / ".walk-bin")
    done = []
    for command in commands if commands is not None else walk_commands():
        done.append(subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                                   timeout=600))
        if done[-1].returncode != 0:
            break
    return done
