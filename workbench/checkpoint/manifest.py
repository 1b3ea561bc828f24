"""What makes a long repack resumable: a fingerprint of the source, a checksum per finished shard, and the journal
that records them as shards finish.

* **Source fingerprint**: per file read (shards, index, configs) its size, mtime and a checksum of its first bytes
  (a safetensors file's header, a config's whole text up to ``HEAD_BYTES``). A resumed run whose source differs in
  any of them is refused, naming the file and what changed: its earlier shards were made from other bytes.
* **Shard checksum**: xxHash's XXH3-64 of the whole file, streamed (``xxhash`` is in the ``[cluster]`` extra; without
  it BLAKE2b-64 from the standard library is used and recorded under its own name, so a record is never compared
  with a different algorithm's digest).
* **Journal** (``PROGRESS`` inside ``OUT.partial``): {fingerprint, plan, shards: {file: {bytes, checksum}}}, replaced
  atomically (write, fsync, rename) after each shard is renamed into place. ``--resume`` keeps a shard only when the
  journal lists it and the file on disk still has that size and checksum; everything else is written again.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct

from workbench.checkpoint.files import CheckpointError, is_regular, parse_json, read_bounded
from workbench.checkpoint.output import KeepsPartial

PROGRESS = ".marlin-workbench-progress.json"
JOURNAL_VERSION = 1
HEAD_BYTES = 1 << 20  # a config or index is checksummed up to this much; a safetensors file through its header
READ_CHUNK = 8 << 20
MAX_JOURNAL_BYTES = 64 << 20

try:
    import xxhash
except ImportError:  # the [cluster] extra is not installed
    xxhash = None

CHECKSUM = "xxh3_64" if xxhash is not None else "blake2b_64"


class SourceChanged(KeepsPartial, CheckpointError):
    """A resumed run's source is not the one the partial output was made from (the partial folder is kept as it
    is: the run cannot judge it)."""


def _hasher(algorithm: str):
    if algorithm == "xxh3_64":
        if xxhash is None:
            raise CheckpointError("this output's checksums are xxh3_64, and the xxhash package is not installed"
                                  " (python3 -m pip install -e '.[cluster]')")
        return xxhash.xxh3_64()
    if algorithm == "blake2b_64":
        return hashlib.blake2b(digest_size=8)
    raise CheckpointError(f"checksum algorithm {algorithm!r} is not one of xxh3_64, blake2b_64")


def file_checksum(path: str, algorithm: str = CHECKSUM, limit: int | None = None) -> str:
    """Hex digest of ``path`` (its first ``limit`` bytes when given), read in bounded chunks."""
    h = _hasher(algorithm)
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    left = limit
    with open(path, "rb") as f:
        while left is None or left > 0:
            got = f.readinto(view if left is None else view[: min(left, len(buf))])
            if not got:
                break
            h.update(view[:got])
            if left is not None:
                left -= got
    return h.hexdigest()


def _head_bytes(path: str) -> int:
    """How much of a source file the fingerprint covers: a safetensors file's length field and header."""
    if path.endswith(".safetensors"):
        with open(path, "rb") as f:
            raw = f.read(8)
        if len(raw) == 8:
            return 8 + struct.unpack("<Q", raw)[0]
    return HEAD_BYTES


def fingerprint(paths: list[str]) -> dict[str, dict]:
    """{path: {bytes, mtime_ns, head_bytes, head}} of every regular source file (symlinks followed)."""
    out = {}
    for path in sorted(set(paths)):
        if not is_regular(path):
            continue
        st = os.stat(path)
        n = _head_bytes(path)
        out[path] = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "head_bytes": n,
                     "head": file_checksum(path, CHECKSUM, n), "checksum": CHECKSUM}
    return out


def check_fingerprint(saved: dict, paths: list[str], where: str) -> None:
    """Refuse a source that differs from the ``saved`` fingerprint (files added, gone, resized, touched, rewritten)."""
    now = fingerprint(paths)
    gone, new = sorted(set(saved) - set(now)), sorted(set(now) - set(saved))
    if gone or new:
        raise SourceChanged(f"{where}: the source changed since this output was started: "
                            + "; ".join([f"{p} is gone" for p in gone[:3]] + [f"{p} is new" for p in new[:3]])
                            + ". Its finished shards were made from other files; start again with --force")
    for path, was in saved.items():
        cur = now[path]
        if was.get("checksum") != cur["checksum"]:
            cur = {**cur, "head": file_checksum(path, was.get("checksum", ""), was.get("head_bytes"))}
        for key, what in (("bytes", "size"), ("mtime_ns", "modification time"), ("head", "header checksum")):
            if was.get(key) != cur[key]:
                raise SourceChanged(f"{path}: {what} is {cur[key]}, it was {was.get(key)} when {where} was started;"
                                    " the source changed, so the finished shards no longer match it; nothing was"
                                    " written and the partial output is kept as it is (--force starts again)")


class Journal:
    """The record of finished shards inside a partial output (``PROGRESS``)."""

    def __init__(self, folder: str, source: dict, plan: str):
        self.path = os.path.join(folder, PROGRESS)
        self.record = {"version": JOURNAL_VERSION, "source": source, "plan": plan, "shards": {}}

    @staticmethod
    def read(folder: str) -> dict | None:
        path = os.path.join(folder, PROGRESS)
        if not is_regular(path):
            return None
        record = parse_json(read_bounded(path, MAX_JOURNAL_BYTES, "progress journal"), path)
        if not isinstance(record, dict) or record.get("version") != JOURNAL_VERSION or not isinstance(
                record.get("shards"), dict):
            raise CheckpointError(f"{path}: not a progress journal of this version; start again with --force")
        return record

    def add(self, name: str, entry: dict) -> None:
        self.record["shards"][name] = entry
        self.save()

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.record, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def shard_entry(path: str) -> dict:
    """What the journal and the manifest say about a finished shard file."""
    return {"bytes": os.path.getsize(path), "checksum": CHECKSUM, "digest": file_checksum(path)}


def shard_intact(path: str, entry: dict) -> bool:
    """The file on disk is the shard the journal recorded (same size, same checksum)."""
    if not isinstance(entry, dict) or not is_regular(path) or os.path.getsize(path) != entry.get("bytes"):
        return False
    return file_checksum(path, entry.get("checksum", "")) == entry.get("digest")
