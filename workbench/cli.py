"""The ``workbench`` command line: one sub-command per module listed in COMMAND_MODULES.

Each module exposes ``register(subparsers)`` which adds its sub-parser(s) and sets ``func`` on them; ``func(args)``
returns the process exit code.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "workbench.tour",
    "workbench.checkpoint.commands",
    "workbench.examples",
    "workbench.explore",
    "workbench.doctor",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="workbench",
        description="Research workbench for Marlin mixed-precision weight formats.",
    )
    from workbench import __version__

    parser.add_argument("--version", action="version", version=f"marlin-workbench {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if getattr(args, "backend", None) == "numba":
        from workbench.backends import ensure_numba_target

        ensure_numba_target()  # no GPU: the CUDA simulator, chosen here because nothing has imported numba.cuda yet
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, FileNotFoundError, FileExistsError) as exc:
        print(f"workbench {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
