"""Every file the checkpoint code reads goes through here: regular files only, each read with a size bound.

Why: a checkpoint directory is user input. A FIFO named ``model.safetensors.index.json`` blocks ``open()`` forever, a
directory under a file's name raises ``IsADirectoryError`` deep inside a parser, ``/dev/zero`` behind a symlink never
ends, and a 10 GB "config.json" would be read whole. ``open_regular`` opens without blocking, then asks the opened
descriptor (not the path, which could be swapped between the two calls) what it is; ``read_json`` bounds the size and
the nesting. Symlinks are followed: the Hugging Face cache stores every snapshot file as a symlink to a blob.
"""
from __future__ import annotations

import json
import os
import stat


# Configs and manifests are kilobytes; the index json of a 100k-tensor model is ~10 MB. 64 MiB leaves room and still
# bounds what one json.loads can cost.
MAX_JSON_BYTES = 64 * 1024 * 1024



class CheckpointError(ValueError):
    """Bad checkpoint input: the message names the file, the tensor and the offending values."""


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def short_repr(value, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: messages quote input values, which may be huge."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def kind_of(mode: int) -> str:
    """'a directory', 'a FIFO (named pipe)', ... for a st_mode that is not a regular file."""
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str, what: str = "file"):
    """``path`` opened for binary reading, refused (CheckpointError) unless it is a regular file (after symlinks)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot open {what} ({exc.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{path}: {what} is {kind_of(mode)}, not a regular file; refusing to read it")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def is_regular(path: str) -> bool:
    """True when ``path`` (after symlinks) is a regular file; never blocks, never raises."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def read_bounded(path: str, max_bytes: int, what: str = "file") -> bytes:
    """The whole of a regular file that holds at most ``max_bytes`` bytes."""
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise CheckpointError(f"{path}: {what} is {size} bytes, more than the {max_bytes} this tool reads")
        data = f.read(size + 1)  # read(n) reserves n bytes up front: ask for what fstat says is there
    if len(data) > size:  # grew while being read
        raise CheckpointError(f"{path}: {what} changed size while being read")
    return data


def parse_json(raw: bytes | str, where: str):
    """JSON text -> value; a CheckpointError naming ``where`` for bad text or nesting too deep to parse."""
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{where}: not valid JSON ({exc})") from None
    except RecursionError:
        raise CheckpointError(f"{where}: JSON nested too deeply to parse") from None


def read_json(path: str, what: str = "JSON file", max_bytes: int = MAX_JSON_BYTES) -> dict:
    """A JSON object from a regular file of bounded size."""
    value = parse_json(read_bounded(path, max_bytes, what), path)
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value
