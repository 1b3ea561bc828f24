"""Where ``repack`` may write, and the one state machine every output directory goes through.

The output-path rule (checked before anything is created): ``--out`` may not be, contain or lie inside the source
directory or any file the source is read from (shards, index, configs), all compared after resolving symlinks, and
``--out`` itself may not be a symlink. ``--force`` replaces only a directory that holds this tool's marker file.

States of ``OUT`` (a directory written by this tool holds ``MARKER``, a JSON record whose ``state`` says which)::

    (absent) --claim--> OUT.partial  [marker: partial, lock held by the writing process]
                            |-- error (bad input, disk full) ----------------> removed, nothing left behind
                            |-- Ctrl-C / SIGTERM / SIGKILL ------------------> OUT.partial stays, marked partial,
                            |                                                  lock released (by the kernel if killed)
                            '-- success: rename to OUT, then marker: complete -> OUT  [marker: complete]

* A reader (``verify``, ``load``, ``inspect``) accepts only ``state = complete``, so a partial folder, under either
  name, can never pass ``verify``.
* The next run that finds ``OUT.partial`` names it: if its lock is held (a live run) it refuses and touches nothing;
  if not, it is a leftover: replaced with ``force``, continued with ``resume`` (same folder, lock taken over; the
  repack then keeps the shards its journal lists and verifies, ``workbench.checkpoint.manifest``), else refused
  (exit 2).
* An error of kind ``KeepsPartial`` (a worker lost, a write that failed after some shards were finished, a resumed
  run whose source changed) leaves ``OUT.partial`` as it is, marked partial, for ``--resume`` or ``--force``.
* The lock is ``fcntl.flock`` on ``LOCK`` inside the folder; its PID in the marker is for messages only.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import time

from workbench.checkpoint.files import CheckpointError, is_regular, parse_json, read_bounded

MARKER = ".marlin-workbench.json"
LOCK = ".marlin-workbench.lock"
TOOL = "marlin-workbench"
PARTIAL, COMPLETE = "partial", "complete"
MAX_MARKER_BYTES = 64 * 1024  # a marker is a few hundred bytes


class OutputError(CheckpointError):
    """The output path breaks the rule, or a directory there is not this tool's to replace."""


class KeepsPartial(Exception):
    """Mixed into an error after which the partial folder is kept as it is (marked partial): what it holds is
    finished, checksummed work that ``--resume`` continues, or a folder the run must not judge."""


class KeptPartialError(KeepsPartial, OutputError):
    """An environment failure (a write, a lost worker) after some shards were finished and recorded."""


def _inside(path: str, folder: str) -> bool:
    """``path`` is ``folder`` or lies inside it (both resolved)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def check_output_path(out: str, protected: list[str]) -> str:
    """The resolved output path, refused when it is, contains or lies inside any ``protected`` path."""
    out = os.path.abspath(out)
    if os.path.islink(out):
        target = os.readlink(out)
        state = "" if os.path.exists(out) else " (dangling)"
        raise OutputError(f"{out}: --out is a symlink{state} to {target!r}; name a real directory path (a symlink is"
                          " never replaced)")
    real = os.path.realpath(out)
    for name in (real, partial_path(real)):
        for p in sorted(protected):
            p = os.path.realpath(p)
            if _inside(name, p) or _inside(p, name):
                how = "is" if name == p else ("lies inside" if _inside(name, p) else "contains")
                raise OutputError(f"{out}: the output {how} {p}, which the source checkpoint is read from; choose an"
                                  " output directory outside the source (nothing was written)")
    return real


def partial_path(out: str) -> str:
    return out + ".partial"


def read_marker(folder: str) -> dict | None:
    """This tool's marker record of ``folder``, or None when there is none (not a directory this tool wrote)."""
    path = os.path.join(folder, MARKER)
    if os.path.islink(folder) or not os.path.isdir(folder) or not is_regular(path):
        return None
    try:
        record = parse_json(read_bounded(path, MAX_MARKER_BYTES, "marker"), path)
    except CheckpointError:
        return None
    return record if isinstance(record, dict) and record.get("tool") == TOOL else None


def require_complete(folder: str) -> None:
    """Refuse a folder that is not a finished output of this tool (a partial one can never pass verify)."""
    record = read_marker(folder)
    if record is None:
        raise CheckpointError(f"{folder}: no {MARKER}, so this is not a complete Marlin checkpoint written by"
                              " `workbench repack`")
    if record.get("state") != COMPLETE:
        raise CheckpointError(f"{folder}: marked {record.get('state')!r} by {MARKER} (repack pid {record.get('pid')}"
                              f" did not finish), so this is not a complete Marlin checkpoint")


def _write_marker(folder: str, record: dict) -> None:
    """Replace the marker atomically (write a temporary file, fsync, rename)."""
    tmp = os.path.join(folder, MARKER + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, MARKER))


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _try_lock(path: str):
    """An fd holding an exclusive flock on ``path`` (an existing lock file), or None when another process holds it.
    The fd is checked to still be the file at ``path``: a lock on a file someone removed meanwhile locks nothing."""
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return None
        raise
    try:
        same = os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        same = False
    if not same:
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def _signals_deferred():
    """Ctrl-C and SIGTERM wait until the block ends (the two renames of a publish are not torn apart)."""
    sigs = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class OutputDir:
    """One run's output: claim a locked partial folder, then ``publish`` it, or leave it on interruption.

    Used as a context manager around the writing: on an ``Exception`` the partial folder is removed (nothing is
    left behind) unless the error is ``KeepsPartial``; on ``KeyboardInterrupt`` / SIGTERM / ``SystemExit`` it stays,
    marked partial, for the next run to name and, with ``resume``, to continue.
    """

    def __init__(self, out: str, protected: list[str], *, force: bool = False, resume: bool = False,
                 source: str = "", log=None):
        if force and resume:
            raise OutputError(f"{out}: --force (start again) and --resume (continue) contradict each other; give one")
        self.out = check_output_path(out, protected)
        self.partial = partial_path(self.out)
        self.force = force
        self.resume = resume
        self.resumed = False  # claim() took over a leftover partial folder
        self.source = source
        self.log = log or (lambda msg: None)
        self._lock_fd: int | None = None
        self.state = "absent"
        self._check_existing_out()

    # -- the output name ------------------------------------------------------------------------------------------
    def _check_existing_out(self) -> None:
        if not os.path.lexists(self.out):
            return
        if not self.force:
            raise OutputError(f"{self.out} already exists; choose another output directory, or replace it (--force)")
        if read_marker(self.out) is None:
            raise OutputError(f"{self.out} exists and holds no {MARKER}: it was not written by `workbench repack`, so"
                              " --force does not replace it; remove it yourself or choose another --out")

    # -- claim ----------------------------------------------------------------------------------------------------
    def _leftover(self) -> None:
        """A partial folder is already there: refuse, replace (force) or, later, resume it."""
        record = read_marker(self.partial)
        if record is None:
            raise OutputError(f"{self.partial} exists and holds no {MARKER}: not a partial output of this tool; remove"
                              " it yourself or choose another --out")
        lock = os.path.join(self.partial, LOCK)
        # no lock file: the run died while publishing (the lock file goes just before the rename), nobody holds it
        fd = _try_lock(lock) if os.path.lexists(lock) else os.open(self.partial, os.O_RDONLY)
        if fd is None:
            raise OutputError(f"{self.partial} is being written by a running repack (pid {record.get('pid')} on"
                              f" {record.get('host')}); not touching it")
        if self.resume:
            self._take_over(record, fd, lock)
            return
        try:
            if not self.force:
                raise OutputError(f"{self.partial} is left over from an interrupted repack (pid {record.get('pid')},"
                                  f" started {record.get('started')}); rerun with --resume to continue it or --force"
                                  " to replace it")
            self.log(f"repack: replacing {self.partial}, left over from an interrupted repack (pid"
                     f" {record.get('pid')})")
            shutil.rmtree(self.partial)
        finally:
            os.close(fd)

    def _take_over(self, record: dict, fd: int, lock: str) -> None:
        """Continue a leftover partial folder: hold its lock (made anew if the run died while publishing) and mark
        it with this run's PID. Its contents are the repack's to judge (the journal)."""
        try:
            if record.get("source") != self.source:
                raise OutputError(f"{self.partial} was started from {record.get('source')!r}, not {self.source!r};"
                                  " --resume continues only the same source (--force replaces it)")
            if not os.path.lexists(lock):
                os.close(fd)
                fd = None
                with open(lock, "w"):
                    pass
                fd = _try_lock(lock)
                if fd is None:
                    raise OutputError(f"{self.partial} was claimed by another run while this one resumed it")
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        self._lock_fd = fd
        self.log(f"repack: resuming {self.partial} (left by pid {record.get('pid')}, started {record.get('started')})")
        self.resumed = True

    def mark_resumed(self) -> None:
        """Put this run's PID in the marker of a taken-over folder, once the repack has accepted its contents (a
        refused resume leaves the folder byte for byte as it was)."""
        record = read_marker(self.partial) or {}
        _write_marker(self.partial, {**record, "pid": os.getpid(), "host": socket.gethostname(),
                                     "resumed": time.strftime("%Y-%m-%dT%H:%M:%S%z")})

    def claim(self) -> str:
        """Create and lock ``OUT.partial`` (or, resuming, take over the leftover one); return its path."""
        if os.path.lexists(self.partial):
            self._leftover()
            if self.resumed:
                self.state = "writing"
                return self.partial
        parent = os.path.dirname(self.out)
        os.makedirs(parent, exist_ok=True)
        staging = f"{self.partial}.{os.getpid()}"  # built under a private name, then renamed: a folder that appears
        os.mkdir(staging)  # as OUT.partial always has its marker and a held lock
        try:
            lock_path = os.path.join(staging, LOCK)
            with open(lock_path, "w"):
                pass
            fd = _try_lock(lock_path)
            assert fd is not None, "a lock file no other process can know of is locked"
            self._lock_fd = fd
            _write_marker(staging, {"tool": TOOL, "state": PARTIAL, "pid": os.getpid(), "host": socket.gethostname(),
                                    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "source": self.source})
            try:
                os.rename(staging, self.partial)  # fails when a racing run created OUT.partial first
            except OSError as exc:
                raise OutputError(f"{self.partial} appeared while this run was starting ({exc.strerror}); another"
                                  " repack is writing it") from None
        except BaseException:
            self._unlock()
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self.state = "writing"
        return self.partial

    # -- finish ---------------------------------------------------------------------------------------------------
    def publish(self) -> None:
        """Rename the finished partial folder to OUT (replacing this tool's old OUT with force), then mark it
        complete. Signals are deferred meanwhile, so an interrupt cannot leave OUT half swapped."""
        with _signals_deferred():
            _fsync_dir(self.partial)
            os.remove(os.path.join(self.partial, LOCK))  # the lock fd stays held until the end
            old = None
            if os.path.lexists(self.out):
                self._check_existing_out()  # it may have appeared during the run
                old = f"{self.out}.replaced-{os.getpid()}"
                os.rename(self.out, old)
            os.rename(self.partial, self.out)
            record = read_marker(self.out) or {}
            _write_marker(self.out, {**record, "state": COMPLETE, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
            _fsync_dir(os.path.dirname(self.out))
            self.state = "published"
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> str:
        return self.claim()

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.state == "writing":
            if exc_type is not None and issubclass(exc_type, KeepsPartial):
                self.state = "kept"
                self.log(f"repack: {self.partial} stays, marked partial; what it holds is finished work (rerun with"
                         " --resume to continue, --force to start again)")
            elif exc_type is None or issubclass(exc_type, Exception):
                shutil.rmtree(self.partial, ignore_errors=True)  # a failed run leaves nothing behind
                self.state = "removed"
            else:  # interrupted: keep it, marked partial, for the next run to name
                self.state = "interrupted"
                self.log(f"repack: interrupted; {self.partial} stays, marked partial (the next run names it; --force"
                         " replaces it)")
        self._unlock()
        return False
