"""The ``workbench`` command line: one sub-command per module listed in COMMAND_MODULES.

Each module exposes ``register(subparsers)`` which adds its sub-parser(s) and sets ``func`` on them; ``func(args)``
returns the process exit code. Errors are not handled in the commands: ``run`` is the one place that turns an
exception into an exit code and a message (docs/cli.md):

    0 success · 1 the answer is "no" (verification mismatch, incompatible layers) · 2 bad input or environment,
    with a message naming the file, tensor and value · 130 Ctrl-C · 143 SIGTERM

No traceback is printed unless ``--debug`` is given (before or after the sub-command).
"""
from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
import threading
import traceback

EXIT_OK, EXIT_NO, EXIT_BAD_INPUT = 0, 1, 2
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, the shell's code for a Ctrl-C
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143

COMMAND_MODULES = (
    "workbench.tour",
    "workbench.checkpoint.commands",
    "workbench.examples",
    "workbench.explore",
    "workbench.doctor",
)


class Terminated(BaseException):
    """SIGTERM raised as an exception, so that ``with`` blocks unwind as for Ctrl-C (an output folder stays marked
    partial) instead of the process vanishing mid-write. A BaseException: ``except Exception`` must not catch it."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="workbench",
        description="Research workbench for Marlin mixed-precision weight formats. Exit codes: 0 success, 1 the"
                    " answer is no (mismatch, incompatible), 2 bad input or environment, 130 interrupted.",
    )
    from workbench import __version__

    parser.add_argument("--version", action="version", version=f"marlin-workbench {__version__}")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    for command in sub.choices.values():  # --debug after the sub-command too; SUPPRESS keeps an earlier one
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="print the traceback of an error")
    return parser


def describe(exc: BaseException) -> str:
    """The one-line message of an error: bad input names its file and values already; an OSError names its file."""
    if isinstance(exc, OSError):
        where = exc.filename if exc.filename is not None else ""
        return f"{where}: {exc.strerror}" if where and exc.strerror else str(exc) or type(exc).__name__
    if isinstance(exc, MemoryError):
        return "out of memory"
    if isinstance(exc, RecursionError):
        return "input nested too deeply to process"
    if isinstance(exc, (ValueError, TypeError, NotImplementedError)):  # CheckpointError is a ValueError
        return str(exc)
    return f"internal error: {type(exc).__name__}: {exc} (a bug: rerun with --debug for the traceback)"


def _raise_terminated(signum, frame):
    raise Terminated()


def run(func, args) -> int:
    """``func(args)`` under the error model: the exit code, a message on stderr instead of a traceback."""
    command = getattr(args, "command", None) or "workbench"
    main_thread = threading.current_thread() is threading.main_thread()
    # SIGTERM as an exception, unless the parent asked for it to be ignored
    previous = signal.getsignal(signal.SIGTERM) if main_thread else None
    if main_thread and previous is not signal.SIG_IGN:
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        code, message = EXIT_INTERRUPTED, "interrupted (Ctrl-C)"
    except Terminated:
        code, message = EXIT_TERMINATED, "terminated (SIGTERM)"
    except Exception as exc:  # noqa: BLE001 - this is the one place every error becomes an exit code
        code, message = EXIT_BAD_INPUT, "error: " + describe(exc)
        if getattr(args, "debug", False):
            traceback.print_exc()
    finally:
        if main_thread and previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(f"workbench {command}: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps({"ok": False, "exit_code": code, "error": message}))
    return code


def main(argv: list[str] | None = None, *, signals: dict | None = None) -> int:
    """Parse and run one command. ``signals``: {signal: handler} to put back once the command modules are imported
    (``python -m workbench`` exits at once on Ctrl-C or SIGTERM while importing)."""
    try:  # building the parser imports the command modules (NumPy, Numba): seconds in which Ctrl-C may come
        parser = build_parser()
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        print("workbench: interrupted (Ctrl-C)", file=sys.stderr)
        return EXIT_INTERRUPTED
    for sig, handler in (signals or {}).items():
        signal.signal(sig, handler)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    if getattr(args, "backend", None) == "numba":
        from workbench.backends import ensure_numba_target

        ensure_numba_target()  # no GPU: the CUDA simulator, chosen here because nothing has imported numba.cuda yet
    return run(args.func, args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
