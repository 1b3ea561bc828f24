"""The pipelined repack: read, convert and write overlapped, over tasks of one layer (one expert of a stack) each.

Stages (docs/scale-out.md draws them)::

    read (preadv, one range per tensor) -> convert (workbench.ops) -> write (by the task, at the planned offsets)

* **The plan fixes every byte's place first.** ``repack`` plans each output file's header (names, dtypes, shapes,
  offsets) before any tensor is read; a task's output goes to its planned offsets, so the order in which tasks
  finish cannot change the file: the output is the serial path's, byte for byte, for any number of workers.
* **Local, CPU**: a pool of processes (forkserver, the conversion preloaded) for ``workers`` > 1, else one thread,
  each reading its task's source tensors itself, converting them with the run's host backend (``cpu``: workbench.host_repack's compiled loops; ``numpy``: the
  reference ops) and writing them into
  the shard file at their planned offsets (``write_results``: through a mapping of the range, pages populated first,
  or pwrite); the coordinator streams pass-through tensors and finishes the files.
* **Local, GPU** (backend numba): two converter threads, each with its own non-blocking CUDA stream (handed to
  the ops and made the thread's current CuPy stream), reading into page-locked buffers from a bounded pool; for the
  layers ``convert.to_marlin_device`` takes, the results stay on the device and come back into the same buffer,
  from which the thread writes them. The copies in and out and the kernels of one thread overlap the other's, and
  the reads and writes of both. (On one shared stream, the legacy default one, the two threads' GPU work would run
  one after the other.)
* **Bounded memory**: at most ``window`` tasks are in flight (read, converting, or waiting to be written), so host
  memory stays below ``window`` x (largest task's source + Marlin bytes) plus the page-locked buffers, whatever the
  checkpoint's size; ``Stats`` reports the bound and the measured peak, and where the time went (``stage_seconds``).
* **Shards finish atomically**: each file is written under a temporary name, checksummed as its ranges become
  final (``_PrefixHasher``: the same digest as ``manifest.shard_entry``), fsync'ed, renamed into place and then
  recorded in the journal, so a file under its final name is always complete and a resumed run redoes exactly the
  ones not recorded.

The dask executor (``workbench.checkpoint.executor``) runs ``write_shard`` on cluster workers with the same tasks.
"""
from __future__ import annotations

import dataclasses
import errno
import mmap
import os
import resource
import socket
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

import numpy as np

from workbench.checkpoint.convert import nonfinite_scales
from workbench.checkpoint.files import CheckpointError
from workbench.checkpoint.layers import LayerSpec
from workbench.checkpoint.output import KeepsPartial
from workbench.checkpoint.safetensors_io import (PlannedTensor, StreamingWriter, TensorInfo, encode_header,
                                                 planned_header)
from workbench.checkpoint.source import SourceCheckpoint, open_source

WRITING_PREFIX = ".writing-"  # a shard under this name is not finished; no run leaves one behind
GPU_STREAMS = 2
OWN_STREAMS = True  # each converter thread on a stream of its own (False: all on the current stream, for comparison)
# Columns per reference-op call on the CPU path with backend numpy (backend cpu converts whole tensors). The output does not depend on it (column blocks convert independently,
# convert.COLUMN_BLOCK says why); 256 keeps each block's temporaries in the core's cache, which converts a
# DeepSeek-V3 expert (K 7168) up to 1.8x faster than 1024 columns and never slower (measured per format)
CPU_COLUMN_BLOCK = 256


@dataclass
class Unit:
    """A layer or a pass-through tensor: what goes into one output file together."""

    layer: LayerSpec | None
    name: str
    tensors: list[PlannedTensor]
    source_bytes: int

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def tasks(self) -> list[int | None]:
        """Expert numbers of this unit's conversion tasks; [None] for a dense layer or a pass-through tensor."""
        return list(range(self.layer.num_experts)) if self.layer is not None and self.layer.num_experts else [None]


@dataclass
class ShardJob:
    """One output file: its name, its units in file order and its header's metadata."""

    name: str
    units: list[Unit]
    metadata: dict[str, str]

    @property
    def planned(self) -> list[PlannedTensor]:
        return [t for u in self.units for t in u.tensors]

    @property
    def source_bytes(self) -> int:
        return sum(u.source_bytes for u in self.units)

    def places(self) -> dict[str, int]:
        """{tensor: absolute file offset of its first byte}, as ``StreamingWriter`` lays the file out."""
        header = planned_header(self.planned, self.metadata)
        start = 8 + len(encode_header(header, self.name))
        return {t.name: start + header[t.name]["data_offsets"][0] for t in self.planned}


@dataclass
class Stats:
    """What a run measured: bytes read from the source, time, and host memory against its bound."""

    source_bytes: int = 0
    output_bytes: int = 0
    seconds: float = 0.0
    workers: int = 1
    path: str = ""
    memory_bound_bytes: int = 0
    baseline_rss_bytes: int = 0  # the coordinator's resident memory when the run started (interpreter, imports)
    peak_rss_bytes: int = 0  # the coordinator process
    peak_worker_rss_bytes: int = 0  # the largest worker process (0 when the workers are threads)
    startup_seconds: float = 0.0  # starting the worker processes (part of ``seconds``)
    # where the time went (the local executor): each task stage's wall seconds summed over the tasks (STAGES; a
    # sum over parallel workers, so up to workers x the run), the seconds spent finishing files (the checksum
    # read; fsync), and the tail: from the last task's result to the end (the last file's finish)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    finish_seconds: float = 0.0
    tail_seconds: float = 0.0
    last_result_at: float = 0.0
    device_tasks: int = 0  # GPU path: tasks whose results stayed on the device (convert.to_marlin_device)
    cpu_seconds: float = 0.0  # user + system time of the coordinator and every worker during the run
    shards_written: int = 0
    shards_kept: int = 0  # resumed: already written and verified
    warnings: list[str] = field(default_factory=list)

    @property
    def gbs(self) -> float:
        return self.source_bytes / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def gbs_per_core(self) -> float:
        """Source bytes per CPU second: what one worker converts when it has a core to itself."""
        return self.source_bytes / self.cpu_seconds / 1e9 if self.cpu_seconds else 0.0


def cpu_time() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def peak_rss(who: int = resource.RUSAGE_SELF) -> int:
    """Peak resident set size in bytes. For this process, the kernel's high-water mark of its own address space
    (VmHWM): ``ru_maxrss`` of a process started by fork + exec also counts the parent's pages it was forked with."""
    if who == resource.RUSAGE_SELF:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError):
            pass
    return resource.getrusage(who).ru_maxrss * 1024  # Linux reports kilobytes


def current_rss() -> int:
    """Resident set size now, in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def writing_path(folder: str, name: str) -> str:
    return os.path.join(folder, WRITING_PREFIX + name)


# ---------------------------------------------------------------------------------------------------------------
# read: a task's source tensors, one sequential range each, from a memory map
# ---------------------------------------------------------------------------------------------------------------
class _Maps:
    """The source files opened once per process (or thread pool), read by position (``os.preadv``: thread-safe, no
    shared file offset). (The name stays from when the reads went through memory maps: a copy out of a map took
    a page fault per 4 KiB and an ``madvise`` to drop the pages again, and moved half the bytes per second that one
    ``preadv`` of the whole range does, measured on the 2-core box: 7 vs 13 GB/s from the page cache.)"""

    def __init__(self):
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def fd(self, path: str) -> int:
        with self._lock:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                if hasattr(os, "posix_fadvise"):  # one pass front to back: read ahead, as the map was told
                    os.posix_fadvise(self._fds[path], 0, 0, os.POSIX_FADV_SEQUENTIAL)
            return self._fds[path]

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __del__(self):  # pragma: no cover - interpreter shutdown
        try:
            self.close()
        except Exception:
            pass


def read_range(fd: int, into: np.ndarray, offset: int, what: str) -> None:
    """Fill ``into`` (uint8, contiguous) with the file's bytes from ``offset`` on: large positional reads straight
    into the buffer (page-locked on the GPU path), no intermediate copy."""
    view = memoryview(into).cast("B")
    done = 0
    while done < into.nbytes:
        got = os.preadv(fd, [view[done:]], offset + done) if hasattr(os, "preadv") else \
            _pread_into(fd, view[done:], offset + done)
        if got <= 0:
            raise CheckpointError(f"{what}: the file ended after {done} of {into.nbytes} bytes: it was truncated while"
                                  " the repack ran")
        done += got


def _pread_into(fd: int, view: memoryview, offset: int) -> int:  # pragma: no cover - platforms without preadv
    data = os.pread(fd, len(view), offset)
    view[:len(data)] = data
    return len(data)


class StagedSource:
    """The part of ``SourceCheckpoint`` that ``to_marlin`` uses (``read``, ``info``, ``describe``, ``root``), served
    from one task's tensors read beforehand. ``read`` hands out the staged array itself: each task's arrays are
    its own (never the file's bytes), and the conversion only reads them."""

    def __init__(self, src: SourceCheckpoint, arrays: dict[str, np.ndarray]):
        self._src, self._arrays, self.root = src, arrays, src.root

    def read(self, name: str, index: int | None = None) -> np.ndarray:
        a = self._arrays[name]
        return a if index is None else a[index]

    def info(self, name: str) -> TensorInfo:
        return self._src.info(name)

    def describe(self, name: str) -> str:
        return self._src.describe(name)

    def path_of(self, name: str) -> str:
        return self._src.path_of(name)


def task_tensors(spec: LayerSpec, expert: int | None) -> list[str]:
    return [name for part in spec.parts[expert or 0] for name in part.tensors.values()]


def stage(src: SourceCheckpoint, maps: _Maps, names: list[str], alloc=np.empty) -> dict[str, np.ndarray]:
    """Read tensors ``names`` from the source into fresh arrays (``alloc(nbytes, uint8)``: page-locked for the GPU),
    one positional read per tensor. The file is checked to still hold each range first, so a file truncated since
    it was opened gives a message naming the tensor."""
    out = {}
    for name in names:
        info = src.info(name)
        path = src.path_of(name)
        size = os.stat(path).st_size
        if size < info.end:
            raise CheckpointError(f"{path}: tensor {name!r} needs bytes [{info.begin}, {info.end}) but the file now"
                                  f" holds {size}: it was truncated while the repack ran")
        buf = alloc(info.nbytes, np.uint8)
        read_range(maps.fd(path), buf, info.begin, f"{path}: tensor {name!r}")
        out[name] = buf.view(info.np_dtype).reshape(info.shape)
    return out


# ---------------------------------------------------------------------------------------------------------------
# convert: one task, the same function for threads, processes and cluster workers
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class TaskResult:
    shard: str
    unit: int  # index in the shard's units
    expert: int | None
    arrays: dict[str, np.ndarray]  # Marlin tensor name -> array (the expert's slice for stacks)
    source_bytes: int
    warnings: list[str]
    worker_rss: int = 0
    worker: tuple[int, float] = (0, 0.0)  # (pid, its CPU seconds so far) of a worker process
    written: dict[str, int] = field(default_factory=dict)  # bytes the task wrote into the file itself, per tensor
    seconds: dict[str, float] = field(default_factory=dict)  # wall time of the task's stages (STAGES)
    on_device: bool = False  # the GPU path kept the results on the device (run_task_device)


STAGES = ("read", "convert", "write")  # a task's stages, timed; ``Stats.stage_seconds`` sums them over the tasks


def marlin_arrays(spec: LayerSpec, m) -> dict[str, np.ndarray]:
    out = {f"{spec.name}.qweight": m.qweight, f"{spec.name}.scales": m.scales}
    if spec.weight_type.has_zero_points:
        out[f"{spec.name}.zeros"] = m.zeros
    if spec.act_order:
        out[f"{spec.name}.g_idx"] = m.g_idx
        out[f"{spec.name}.perm"] = m.perm
    out.update({f"{spec.name}.{suffix}": value for suffix, value in m.extra.items()})  # e.g. NVFP4's global scale
    return out


def run_task(src: SourceCheckpoint, maps: _Maps, shard: str, unit_index: int, unit: Unit, expert: int | None,
             backend: str, alloc=np.empty, stream=None) -> TaskResult:
    """Read and convert one task (one layer, or one expert of a stack). The results are fresh arrays: nothing of
    the staged source (``alloc``'s buffers) is referenced once this returns. ``stream``: the GPU path's, for the
    ops."""
    from workbench.checkpoint.repack import convert_layer  # the one conversion call (repack imports this module)

    began = time.perf_counter()
    spec = unit.layer
    staged = StagedSource(src, stage(src, maps, task_tensors(spec, expert), alloc))
    read = time.perf_counter()
    one = dataclasses.replace(spec, parts=[spec.parts[expert or 0]])
    warnings = nonfinite_scales(staged, one)
    # on the GPU one op call per tensor (the kernels take the whole width); on the CPU cache-sized blocks
    block = -(-spec.size_n // 64) * 64 if backend == "numba" else CPU_COLUMN_BLOCK
    m = convert_layer(staged, spec, expert or 0, backend, block, stream)
    arrays = {k: np.array(v, order="C", copy=True) if _shares(v, staged) else np.ascontiguousarray(v)
              for k, v in marlin_arrays(spec, m).items()}
    return TaskResult(shard, unit_index, expert, arrays, unit.source_bytes // max(len(unit.tasks), 1), warnings,
                      seconds={"read": read - began, "convert": time.perf_counter() - read})


def _shares(array: np.ndarray, staged: StagedSource) -> bool:
    """Whether a result is (a view of) a staged source buffer, which goes back to the pool after the task."""
    return any(np.may_share_memory(array, a) for a in staged._arrays.values())  # bounds only: cheap


# ---------------------------------------------------------------------------------------------------------------
# write: a task's results into the shard file at their planned offsets, by the task itself
# ---------------------------------------------------------------------------------------------------------------
# How a task writes its results into the shard file (which the coordinator created at its full size):
# * "mmap": a shared mapping of the tensor's byte range, its pages allocated up front with MADV_POPULATE_WRITE (so a
#   full disk is an error from that call, which then falls back to pwrite to say ENOSPC, never a SIGBUS in the
#   copy), then one copy into it. Writers of one file run in parallel: a page fault takes the page's lock only.
# * "pwrite": positional writes. Simple, but Linux takes the file's inode lock for the whole of each buffered write
#   (tmpfs, ext4 and XFS alike), so the workers writing one shard take turns: on the 2-core box two processes
#   writing one tmpfs file moved 0.9-2.3 GB/s together against 3.0-3.2 GB/s into two files.
# Where the mapping or MADV_POPULATE_WRITE is unavailable (not Linux, a kernel before 5.14), "mmap" writes as
# "pwrite" does. The bytes are the same either way.
WORKER_WRITE = "mmap"
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if os.uname().sysname == "Linux" else None)
_mapped_writes_work: list[bool] = []  # learnt at the first try in this process: [] unknown, [False] use pwrite


def _pwrite_all(fd: int, data: memoryview, at: int) -> None:
    done = 0
    while done < data.nbytes:
        done += os.pwrite(fd, data[done:], at + done)


def _copy_mapped(fd: int, data: np.ndarray, at: int) -> bool:
    """Copy ``data`` (uint8) into the file at ``at`` through a shared mapping; False when that is not possible here
    (then nothing was written)."""
    if _MADV_POPULATE_WRITE is None or _mapped_writes_work == [False] or not data.nbytes:
        return False
    start = at - at % mmap.ALLOCATIONGRANULARITY
    try:
        mm = mmap.mmap(fd, at + data.nbytes - start, offset=start)
    except (OSError, ValueError):
        return False
    try:
        try:
            mm.madvise(_MADV_POPULATE_WRITE)  # allocate the pages now: no space -> an error here, not a SIGBUS later
        except (OSError, ValueError, AttributeError) as exc:
            if getattr(exc, "errno", None) == errno.EINVAL or not isinstance(exc, OSError):
                _mapped_writes_work[:] = [False]  # an older kernel: this process writes with pwrite from now on
            return False  # (a full disk: the caller's pwrite raises ENOSPC with the file's name)
        target = np.frombuffer(mm, np.uint8, data.nbytes, at - start)
        target[:] = data
        del target
        _mapped_writes_work[:] = [True]
        return True
    finally:
        mm.close()


def write_results(path: str, places: dict[str, int], result: TaskResult, mode: str | None = None) -> None:
    """Write a task's arrays into the shard file ``path`` at their planned places (an expert's slice of a stack at
    its index), then drop them from ``result``: what stays is ``result.written`` (bytes per tensor), which the
    coordinator adds up before it lets the file finish."""
    began = time.perf_counter()
    mode = mode or WORKER_WRITE
    fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    try:
        for name, array in result.arrays.items():
            data = array.reshape(-1).view(np.uint8)
            at = places[name] + (result.expert or 0) * data.nbytes  # an expert's slice of a stack, or the tensor
            if not (mode == "mmap" and _copy_mapped(fd, data, at)):
                _pwrite_all(fd, memoryview(data), at)
    except OSError as exc:
        if exc.filename is None:  # (os.pwrite names no file)
            raise OSError(exc.errno, exc.strerror, path) from None
        raise
    finally:
        os.close(fd)
    result.written = {name: array.nbytes for name, array in result.arrays.items()}
    result.arrays = {}
    result.seconds["write"] = time.perf_counter() - began


# process-pool workers: the source opened once per process
_WORKER: dict = {}


def _worker_init(path: str, write_mode: str = "mmap", backend: str = "cpu") -> None:
    _WORKER["cpu0"] = cpu_time()
    _WORKER["backend"] = backend
    _WORKER["src"] = open_source(path)
    _WORKER["maps"] = _Maps()
    _WORKER["write"] = write_mode


def _worker_task(shard: str, unit_index: int, unit: Unit, expert: int | None, path: str,
                 places: dict[str, int]) -> TaskResult:
    """Convert one task and write its tensors into the shard file at their planned places (``path`` is the file
    being written). What goes back is a few hundred bytes: a worker killed while sending it cannot leave half a
    message in the result pipe (which would stall the pool), as a worker sending megabytes of arrays could."""
    result = run_task(_WORKER["src"], _WORKER["maps"], shard, unit_index, unit, expert, _WORKER["backend"])
    write_results(path, places, result, _WORKER.get("write"))
    result.worker_rss = peak_rss()
    result.worker = (os.getpid(), cpu_time() - _WORKER["cpu0"])
    return result


def _worker_ready() -> int:
    return os.getpid()


# ---------------------------------------------------------------------------------------------------------------
# write: results into their planned places; files finished atomically
# ---------------------------------------------------------------------------------------------------------------
class _PrefixHasher:
    """The shard's checksum (the manifest's: ``manifest.CHECKSUM`` of the whole file), computed front to back while
    the file is still being written: each range is handed in once its bytes are final (``add``), and ``advance``
    hashes from where it stopped through every range that now follows without a gap. So finishing the file hashes
    only what the last tasks wrote, instead of reading the whole file again after the last task (on the H200 that
    read was 0.5 s at the end of a 2.6 s run with 16 workers)."""

    def __init__(self, path: str, size: int, planned: list[tuple[int, int]]):
        from workbench.checkpoint.manifest import CHECKSUM, _hasher

        self.algorithm, self.size, self._path = CHECKSUM, size, path
        self._h = _hasher(CHECKSUM)
        self._pos = 0
        self._ready: dict[int, int] = {}  # start -> end of final ranges not hashed yet (disjoint, tiling the file)
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._buf = np.empty(0, np.uint8)
        at = 0
        for start, end in sorted(planned):  # the header, and any bytes between tensors, are final already
            if start > at:
                self.add(at, start)
            at = max(at, end)
        if size > at:
            self.add(at, size)

    def add(self, start: int, end: int) -> None:
        if end > start:
            with self._lock:
                self._ready[start] = end

    def advance(self) -> None:
        """Hash every final range that follows the hashed prefix (one caller at a time)."""
        from workbench.checkpoint.manifest import READ_CHUNK

        while True:
            with self._lock:
                end = self._ready.pop(self._pos, None)
            if end is None:
                return
            if self._fd is None:
                self._fd = os.open(self._path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                self._buf = np.empty(READ_CHUNK, np.uint8)
            while self._pos < end:
                n = min(end - self._pos, self._buf.nbytes)
                read_range(self._fd, self._buf[:n], self._pos, self._path)
                self._h.update(memoryview(self._buf[:n]))
                self._pos += n

    def digest(self) -> str:
        self.advance()
        self.close()
        if self._pos != self.size:
            raise RuntimeError(f"{self._path}: bytes from {self._pos} on were never written (of {self.size})")
        return self._h.hexdigest()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class ShardWriter:
    """One output file under its temporary name, filled in any order, finished by ``finish`` (fsync, checksum,
    rename). ``abort`` removes the temporary file: a half-written shard never stays under any name. The checksum
    is computed as the file fills (``_PrefixHasher``; ``hash_ahead`` runs it on the caller's thread)."""

    def __init__(self, folder: str, job: ShardJob, attempt: str = ""):
        self.job, self.folder = job, folder
        self.tmp = writing_path(folder, job.name) + (f".{attempt}" if attempt else "")
        self.final = os.path.join(folder, job.name)
        self.pending = sum(len(u.tasks) for u in job.units)
        self._w = StreamingWriter(self.tmp, job.planned, job.metadata)
        self._by_workers: dict[str, int] = {}  # bytes the tasks (processes, threads) wrote into the file themselves
        self._places = job.places()
        self._sizes = {t.name: t.nbytes for t in job.planned}
        self._hasher = _PrefixHasher(self.tmp, os.path.getsize(self.tmp),
                                     [(self._places[n], self._places[n] + b) for n, b in self._sizes.items()])
        self.hashing = False  # a hash_ahead is queued (the coordinator queues one at a time)

    def _final(self, name: str, nbytes: int, expert: int | None) -> None:
        at = self._places[name] + (expert or 0) * nbytes
        self._hasher.add(at, at + nbytes)

    def write(self, result: TaskResult) -> None:
        for name, array in result.arrays.items():
            self._w.write(name, array, result.expert)
        if result.arrays:
            self._w.flush()  # (the hasher reads the file through its own descriptor)
        for name, array in result.arrays.items():
            self._final(name, array.nbytes, result.expert)
        for name, nbytes in result.written.items():
            self._by_workers[name] = self._by_workers.get(name, 0) + nbytes
            self._final(name, nbytes, result.expert)
        self.pending -= 1

    def copy_passthrough(self, src: SourceCheckpoint, unit: Unit) -> None:
        src.files[src.where[unit.name]].copy_bytes_to(unit.name, lambda chunk: self._w.append(unit.name, chunk))
        self._w.flush()
        self._final(unit.name, self._sizes[unit.name], None)
        self.pending -= 1

    def hash_ahead(self) -> None:
        self.hashing = False
        self._hasher.advance()

    def finish(self) -> dict:
        if self._by_workers:  # the tasks wrote their tensors: check every byte is there, then sync the file
            planned = {t.name: t.nbytes for t in self.job.planned}
            done = {n: self._by_workers.get(n, 0) + self._w.written(n) for n in planned}  # (+ pass-through bytes)
            short = [f"{n} ({done[n]} of {planned[n]} bytes)" for n in planned if done[n] != planned[n]]
            self._w.abort()
            if short:
                raise RuntimeError(f"{self.tmp}: tensors not completely written: {', '.join(short[:5])}")
            fd = os.open(self.tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        else:
            self._w.close()
        size = os.path.getsize(self.tmp)
        if size != self._hasher.size:
            raise RuntimeError(f"{self.tmp}: {size} bytes, planned {self._hasher.size}")
        entry = {"bytes": size, "checksum": self._hasher.algorithm, "digest": self._hasher.digest()}
        os.rename(self.tmp, self.final)
        return entry

    def abort(self) -> None:
        self._hasher.close()
        self._w.abort()
        if os.path.lexists(self.tmp):
            os.remove(self.tmp)


def write_shard(src: SourceCheckpoint, folder: str, job: ShardJob, backend: str, maps: _Maps | None = None,
                on_progress=None) -> tuple[dict, list[str]]:
    """One whole shard, task after task in this process (a cluster worker's unit of work). Returns its journal
    entry and the warnings."""
    maps = maps or _Maps()
    # a temporary name of its own: a worker the scheduler gave up on may still be writing its attempt meanwhile
    writer = ShardWriter(folder, job, f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    warnings: list[str] = []
    try:
        for i, unit in enumerate(job.units):
            if unit.layer is None:
                writer.copy_passthrough(src, unit)
                if on_progress:
                    on_progress(unit.source_bytes)
                continue
            for e in unit.tasks:
                result = run_task(src, maps, job.name, i, unit, e, backend)
                writer.write(result)
                warnings += result.warnings
                if on_progress:
                    on_progress(result.source_bytes)
        return writer.finish(), warnings
    except BaseException:
        writer.abort()
        raise


# ---------------------------------------------------------------------------------------------------------------
# the local executor
# ---------------------------------------------------------------------------------------------------------------
class WorkerLost(KeepsPartial, CheckpointError):
    """A worker process died (killed, out of memory) while converting; the finished files are kept."""


class _PinnedPool:
    """A bounded set of page-locked buffers, one per converter thread: the GPU path's reads land in the first
    ``staging`` bytes of one, and its results come back from the device into the rest (``alloc.out``), from where
    the thread writes them: no pageable copy either way. ``alloc_for`` blocks while all are in use."""

    def __init__(self, count: int, staging: int, results: int = 0):
        from numba import cuda

        self.staging = -(-max(staging, 1) // 64) * 64
        self._free = [cuda.pinned_array(self.staging + max(results, 0), np.uint8) for _ in range(count)]
        self._cv = threading.Condition()
        self.nbytes = (self.staging + max(results, 0)) * count

    def alloc_for(self, sizes: list[int]):
        """An ``alloc`` handing out consecutive pieces of one pinned buffer for one task's tensors; ``alloc.out(n)``
        hands out pieces of its results part."""
        with self._cv:
            while not self._free:
                self._cv.wait()
            buf = self._free.pop()
        offsets = iter(np.cumsum([0] + [-(-s // 64) * 64 for s in sizes]).tolist())
        taken = [self.staging]

        def alloc(nbytes, dtype):
            start = next(offsets)
            return buf[start: start + nbytes]

        def out(nbytes: int) -> np.ndarray:
            start = taken[0]
            if start + nbytes > buf.nbytes:
                raise MemoryError(f"the task's results ({start - self.staging + nbytes} bytes so far) exceed the"
                                  f" {buf.nbytes - self.staging} bytes planned for them")
            taken[0] = start + -(-nbytes // 64) * 64
            return buf[start: start + nbytes]
        alloc.buffer, alloc.out = buf, out
        return alloc

    def give_back(self, buf) -> None:
        with self._cv:
            self._free.append(buf)
            self._cv.notify()


# The GPU path keeps the results of the layers ``convert.to_marlin_device`` takes (block-FP8, GPTQ without
# act-order) on the device and copies them straight into the thread's page-locked buffer, from where the thread
# writes them (False: every layer through ``to_marlin`` on host arrays, whose results come back into fresh pageable
# arrays and are copied again into each layer's array; for comparison).
DEVICE_RESULTS = True


def run_task_device(src: SourceCheckpoint, maps: _Maps, shard: str, unit_index: int, unit: Unit,
                    expert: int | None, alloc, stream) -> TaskResult:
    """``run_task`` for the GPU path with the results left on the device: the staged source goes up on the
    thread's stream, the ops run on device arrays, the results come down into ``alloc.out``'s page-locked pieces
    (asynchronously, one synchronize at the end). Raises ``convert.NotOnDevice`` for a layer it does not take."""
    from workbench.checkpoint.convert import to_marlin_device
    from workbench.cuda.arrays import cupy

    cp = cupy()
    began = time.perf_counter()
    spec = unit.layer
    staged = StagedSource(src, stage(src, maps, task_tensors(spec, expert), alloc))
    read = time.perf_counter()
    warnings = nonfinite_scales(staged, dataclasses.replace(spec, parts=[spec.parts[expert or 0]]))
    on = cp.cuda.get_current_stream()  # the thread's stream (``_on_stream``)

    def upload(host: np.ndarray):
        host = np.ascontiguousarray(host)
        d = cp.empty(host.shape, host.dtype)
        d.set(host, stream=on)  # from page-locked memory: asynchronous
        return d
    try:
        m = to_marlin_device(staged, spec, expert or 0, upload, stream)
    except CheckpointError:
        raise
    except (ValueError, TypeError) as exc:  # an op's refusal, said with the layer (as repack.convert_layer does)
        which = f" expert {expert}" if spec.num_experts else ""
        raise CheckpointError(f"{src.root}: layer {spec.name!r}{which}: {exc}") from exc
    arrays = {}
    for name, d in marlin_arrays(spec, m).items():
        host = alloc.out(d.nbytes).view(d.dtype).reshape(d.shape)
        try:
            d.get(stream=on, out=host, blocking=False)
        except TypeError:  # pragma: no cover - CuPy before 13 (no blocking=): a synchronous copy
            d.get(stream=on, out=host)
        arrays[name] = host
    on.synchronize()
    return TaskResult(shard, unit_index, expert, arrays, unit.source_bytes // max(len(unit.tasks), 1), warnings,
                      seconds={"read": read - began, "convert": time.perf_counter() - read}, on_device=True)


class _ThreadStreams:
    """One non-blocking CUDA stream per converter thread (made on the thread's first task, by CuPy, whose runtime
    binds the device's context in any thread; released by ``close``): a non-blocking stream does not wait for work
    on the legacy default stream, nor that on it."""

    def __init__(self):
        from workbench.cuda.arrays import cupy

        self._cupy = cupy()
        self._device = self._cupy.cuda.runtime.getDevice()  # the coordinator's: every thread works on it
        self._local = threading.local()
        self._made: list = []
        self._lock = threading.Lock()

    def current(self) -> int | None:
        """This thread's stream handle (None: the current stream, when OWN_STREAMS is off)."""
        if not getattr(self._local, "bound", False):
            # the driver-API launches need the device's context current in this thread: setDevice binds it
            self._cupy.cuda.runtime.setDevice(self._device)
            self._local.bound = True
        if not OWN_STREAMS:
            return None
        handle = getattr(self._local, "handle", None)
        if handle is None:
            stream = self._cupy.cuda.Stream(non_blocking=True)
            handle = self._local.handle = int(stream.ptr)
            with self._lock:
                self._made.append(stream)
        return handle

    def close(self) -> None:
        for stream in self._made:
            stream.synchronize()
        self._made.clear()  # (CuPy destroys a stream it made when its object goes)


def _on_stream(handle: int | None):
    """The block runs with ``handle`` as this thread's current CuPy stream: ops called without a stream (the
    microscaled formats' conversion) take it too."""
    import contextlib

    if handle is None:
        return contextlib.nullcontext()
    from workbench.cuda import streams as cuda_streams

    return cuda_streams.cupy_stream(handle)


def _gpu_threads() -> int:
    """Converter threads on the GPU path: one per stream; one in the CUDA simulator, which runs one kernel at a time
    (two threads launching at once would share its simulated thread state)."""
    from workbench import hardware

    return 1 if hardware.simulator_enabled() else GPU_STREAMS


def task_source_bytes(unit: Unit, expert: int | None, src: SourceCheckpoint) -> int:
    return sum(src.info(n).nbytes for n in task_tensors(unit.layer, expert))


def run_local(src: SourceCheckpoint, source_path: str, folder: str, jobs: list[ShardJob], backend: str,
              workers: int, bar, on_shard, stats: Stats) -> None:
    """Convert and write ``jobs`` with ``workers`` processes (CPU) or ``GPU_STREAMS`` threads (GPU); ``on_shard(name,
    entry)`` is called as each file is finished, in any order."""
    tasks = [(job, i, unit, e) for job in jobs for i, unit in enumerate(job.units) for e in unit.tasks]
    largest = max((task_source_bytes(u, e, src) + u.nbytes // len(u.tasks) for _, _, u, e in tasks
                   if u.layer is not None), default=0)
    pool_kind = "gpu" if backend == "numba" else ("process" if workers > 1 else "thread")
    parallel = (_gpu_threads() if pool_kind == "gpu" else workers)
    window = 2 * parallel  # tasks in flight: one converting and one read ahead or waiting per worker
    pinned = streams = None
    if pool_kind == "gpu":
        from workbench import hardware

        # (the CUDA simulator has no driver streams: it runs one kernel at a time anyway)
        streams = None if hardware.simulator_enabled() else _ThreadStreams()
        staging = max((task_source_bytes(u, e, src) + 64 * len(task_tensors(u.layer, e))
                       for _, _, u, e in tasks if u.layer is not None), default=1)
        results = max((u.nbytes // len(u.tasks) + 64 * len(u.tensors) for _, _, u, e in tasks
                       if u.layer is not None), default=0) if DEVICE_RESULTS else 0
        pinned = _PinnedPool(parallel, staging, results)
    stats.workers, stats.path = parallel, pool_kind
    stats.memory_bound_bytes = window * largest + (pinned.nbytes if pinned else 0) + 64 * 1024**2
    maps = _Maps()
    places = {job.name: job.places() for job in jobs}

    def unit_places(job: ShardJob, unit: Unit) -> dict[str, int]:  # (what a task needs: its unit's tensors)
        return {t.name: places[job.name][t.name] for t in unit.tensors}
    if pool_kind == "process":
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # forkserver: workers forked from a clean server that has imported the conversion (repack, convert, the
        # ops, NumPy and host_repack's compiled loops) once, so a worker starts converting at once (a fork of this process would copy its
        # threads' locks; spawn would import NumPy and the ops in every worker)
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        context = multiprocessing.get_context(method)
        if method == "forkserver":
            context.set_forkserver_preload([__name__, "workbench.checkpoint.repack", "workbench.host_repack"])
        began = time.perf_counter()
        executor = ProcessPoolExecutor(workers, mp_context=context,
                                       initializer=_worker_init, initargs=(source_path, WORKER_WRITE, backend))
        wait([executor.submit(_worker_ready) for _ in range(workers)])
        stats.startup_seconds = time.perf_counter() - began

        def submit(job, i, unit, e):
            return executor.submit(_worker_task, job.name, i, unit, e, writer_of(job).tmp, unit_places(job, unit))
    else:
        executor = ThreadPoolExecutor(parallel, thread_name_prefix="repack")

        from workbench.checkpoint.convert import NotOnDevice, device_conversion

        def one(job, i, unit, e, path, where):
            # the thread writes its own results, as a worker process does: the writes of the threads overlap each
            # other and the copies, instead of queueing behind this coordinator
            if pinned is None:
                result = run_task(src, maps, job.name, i, unit, e, backend)
                write_results(path, where, result)
                return result
            alloc = pinned.alloc_for([src.info(n).nbytes for n in task_tensors(unit.layer, e)])
            try:  # (the buffer stays the thread's until the results in it are written)
                stream = streams.current() if streams is not None else None
                with _on_stream(stream):
                    result = None
                    if DEVICE_RESULTS and streams is not None and device_conversion(unit.layer):
                        try:
                            result = run_task_device(src, maps, job.name, i, unit, e, alloc, stream)
                        except NotOnDevice:
                            result = None
                    if result is None:
                        result = run_task(src, maps, job.name, i, unit, e, backend, alloc, stream)
                write_results(path, where, result)
            finally:
                pinned.give_back(alloc.buffer)
            return result

        def submit(job, i, unit, e):
            return executor.submit(one, job, i, unit, e, writer_of(job).tmp, unit_places(job, unit))

    writers: dict[str, ShardWriter] = {}
    in_flight: set[Future] = set()
    worker_cpu: dict[int, float] = {}
    cpu0 = cpu_time()
    broken = False
    warned: set[str] = set()

    def writer_of(job: ShardJob) -> ShardWriter:
        if job.name not in writers:
            writers[job.name] = ShardWriter(folder, job)
        return writers[job.name]

    # a finished file is fsync'ed, read back for its checksum and renamed on this thread, while the next converts
    finisher = ThreadPoolExecutor(1, thread_name_prefix="repack-finish")
    finishing: dict[Future, str] = {}

    def timed_finish(w: ShardWriter) -> dict:
        began = time.perf_counter()
        try:
            return w.finish()
        finally:
            stats.finish_seconds += time.perf_counter() - began

    def finish_if_done(job_name: str) -> None:
        w = writers[job_name]
        if w.pending == 0:
            finishing[finisher.submit(timed_finish, w)] = job_name
            del writers[job_name]

    def record_finished(block: bool) -> None:
        done, _ = wait(finishing, timeout=None if block else 0)
        for fut in done:
            on_shard(finishing.pop(fut), fut.result())
            stats.shards_written += 1

    def drain(block: bool) -> None:
        done, _ = wait(in_flight, return_when=FIRST_COMPLETED, timeout=None if block else 0)
        for fut in done:
            in_flight.discard(fut)
            result: TaskResult = fut.result()
            writers[result.shard].write(result)
            for stage_name, seconds in result.seconds.items():
                stats.stage_seconds[stage_name] = stats.stage_seconds.get(stage_name, 0.0) + seconds
            stats.last_result_at = time.perf_counter()
            stats.device_tasks += result.on_device
            stats.peak_worker_rss_bytes = max(stats.peak_worker_rss_bytes, result.worker_rss)
            if result.worker[0]:
                worker_cpu[result.worker[0]] = max(worker_cpu.get(result.worker[0], 0.0), result.worker[1])
            layer = next(iter(result.written or result.arrays), "").rsplit(".", 1)[0]
            for w in result.warnings:
                if layer not in warned:
                    warned.add(layer)
                    stats.warnings.append(w)
            bar.update(result.source_bytes)
            w = writers[result.shard]
            if w.pending and not w.hashing:  # checksum what is final so far, beside the conversion
                w.hashing = True
                finisher.submit(w.hash_ahead)
            finish_if_done(result.shard)

    try:
        for job, i, unit, e in tasks:
            w = writer_of(job)
            if unit.layer is None:  # pass-through: a bounded streamed copy, here, between the results
                w.copy_passthrough(src, unit)
                bar.update(unit.source_bytes)
                finish_if_done(job.name)
                continue
            while len(in_flight) >= window:
                drain(block=True)
            in_flight.add(submit(job, i, unit, e))
            drain(block=False)
            record_finished(block=False)
        while in_flight:
            drain(block=True)
        for name in list(writers):  # shards of pass-through tensors only finish here when nothing was in flight
            finish_if_done(name)
        record_finished(block=True)
    except BaseException as exc:
        for fut in in_flight:
            fut.cancel()
        wait(finishing)  # a file being finished is renamed complete or fails; the complete ones are recorded
        for fut, name in finishing.items():
            if fut.exception() is None:
                on_shard(name, fut.result())
        finisher.shutdown(wait=True, cancel_futures=True)  # no checksum reads a file that is about to go
        for w in writers.values():
            w.abort()
        if isinstance(exc, BrokenProcessPool):  # from a result or from the next submit, whichever came first
            broken = True
            raise WorkerLost(f"a repack worker process died (killed, or out of memory: each needs about"
                             f" {largest / 1e6:.0f} MB) while converting; the files finished so far are kept"
                             " (--resume continues)") from None
        raise
    finally:
        finisher.shutdown(wait=True)
        if broken:  # the other workers may wait forever on a queue lock the dead one held: end them, don't join
            for process in list((getattr(executor, "_processes", None) or {}).values()):
                process.kill()
        executor.shutdown(wait=not broken, cancel_futures=True)
        if streams is not None:
            streams.close()
        stats.cpu_seconds = cpu_time() - cpu0 + sum(worker_cpu.values())
        if stats.last_result_at:
            stats.tail_seconds = time.perf_counter() - stats.last_result_at
        stats.peak_rss_bytes = peak_rss()
        if pool_kind == "process":
            stats.peak_worker_rss_bytes = max(stats.peak_worker_rss_bytes, peak_rss(resource.RUSAGE_CHILDREN))


def default_workers() -> int:
    """Cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def describe_stats(stats: Stats) -> str:
    return (f"{stats.source_bytes / 1e9:.2f} GB in {stats.seconds:.1f} s ({stats.gbs:.2f} GB/s, {stats.path},"
            f" {stats.workers} worker{'s' if stats.workers != 1 else ''}); peak host memory"
            f" {stats.peak_rss_bytes / 1e9:.2f} GB ({stats.baseline_rss_bytes / 1e9:.2f} GB before the run)" + (f" (workers {stats.peak_worker_rss_bytes / 1e9:.2f} GB each at"
                                                       " most)" if stats.peak_worker_rss_bytes else "")
            + f", bound {stats.memory_bound_bytes / 1e9:.2f} GB")

