"""``python -m workbench``. Until the command modules are imported (NumPy, Numba: seconds), Ctrl-C and SIGTERM end
the process at once with the usual code: nothing has been written yet, and an import cut short by
KeyboardInterrupt would otherwise surface as an ImportError traceback. ``cli.main`` puts the handlers found at
start back before a command runs (a signal the parent ignores stays ignored)."""
import os
import signal
import sys

STARTUP = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
for _sig in STARTUP:
    if STARTUP[_sig] is not signal.SIG_IGN:
        signal.signal(_sig, lambda signum, frame: os._exit(128 + signum))

from workbench.cli import main  # noqa: E402

sys.exit(main(signals=STARTUP))
