"""Where a repack (or a verify) runs: ``serial``, ``local`` (this machine's cores or GPU, the default) or
``dask://HOST:PORT`` (the workers of a dask.distributed scheduler listening at ``tcp://HOST:PORT``).

On a cluster the unit of work is one output file: a worker converts a shard's layers one after another, writes the
file under a temporary name in the output folder, fsyncs, checksums and renames it, and returns its journal entry.
So the output folder and the source must be on storage every worker and the client see under the same paths (NFS,
Lustre, a FUSE-mounted bucket); ``check_workers`` asks each worker before any work is sent. Worker deaths are
retried by the scheduler (``distributed.scheduler.allowed-failures``), task errors ``retries`` times; what still
fails ends the run with the finished files kept for ``--resume``.
"""
from __future__ import annotations

import os
import re
import uuid
from dataclasses import dataclass

from workbench.checkpoint.files import CheckpointError
from workbench.checkpoint.manifest import SourceChanged
from workbench.checkpoint.output import KeptPartialError

SCHEME = "dask://"
CONNECT_TIMEOUT_S = 20
_ADDRESS = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(?P<port>[0-9]{1,5})$")


@dataclass(frozen=True)
class Executor:
    kind: str  # "serial", "local" or "dask"
    address: str = ""  # the scheduler's tcp:// address for dask

    def __str__(self) -> str:
        return self.kind if self.kind != "dask" else SCHEME + self.address[len("tcp://"):]


def is_killed_worker(exc: BaseException) -> bool:
    """Whether a task failed because its workers kept dying (dask's ``KilledWorker``, matched by name so that this
    module imports dask only when a cluster is used)."""
    return type(exc).__name__ == "KilledWorker"


def parse_executor(text: str) -> Executor:
    """``serial`` | ``local`` | ``dask://HOST:PORT`` -> Executor (a ValueError naming the text otherwise)."""
    if text in ("serial", "local"):
        return Executor(text)
    if text.startswith(SCHEME):
        m = _ADDRESS.match(text[len(SCHEME):])
        if m and 0 < int(m["port"]) < 65536:
            return Executor("dask", f"tcp://{m['host']}:{int(m['port'])}")
    raise ValueError(f"--executor {text!r} is not 'local', 'serial' or 'dask://HOST:PORT' (the address of a dask"
                     " scheduler, e.g. dask://10.0.0.5:8786)")


def connect(executor: Executor):
    """A ``distributed.Client`` of the scheduler, or a CheckpointError saying why not."""
    try:
        from distributed import Client
    except ImportError:
        raise CheckpointError(f"--executor {executor}: dask.distributed is not installed (python3 -m pip install -e"
                              " '.[cluster]')") from None
    try:
        return Client(executor.address, timeout=CONNECT_TIMEOUT_S, set_as_default=False)
    except (OSError, TimeoutError) as exc:
        raise CheckpointError(f"--executor {executor}: cannot reach the dask scheduler at {executor.address}"
                              f" ({exc})") from None


def check_workers(client, executor: Executor, need: int, worker_memory: int | None, what: str) -> int:
    """Refuse a cluster whose workers cannot hold one task: memory per worker thread (``worker_memory`` given, else
    the worker's own ``memory_limit``) below ``need`` bytes. Returns the number of worker threads."""
    workers = client.scheduler_info(n_workers=-1).get("workers", {})
    if not workers:
        raise CheckpointError(f"--executor {executor}: the scheduler has no workers")
    for address, w in sorted(workers.items()):
        threads = max(int(w.get("nthreads") or 1), 1)
        limit = worker_memory or int(w.get("memory_limit") or 0)
        if limit and limit // threads < need:
            raise CheckpointError(
                f"--executor {executor}: worker {address} has {limit / 1e9:.2f} GB for {threads} thread(s), "
                f"{limit / threads / 1e9:.2f} GB per task, but {what} needs about {need / 1e9:.2f} GB; give the"
                " workers more memory (dask worker --memory-limit, --worker-memory) or fewer threads (--nthreads)")
    return sum(max(int(w.get("nthreads") or 1), 1) for w in workers.values())


def _sees(paths: list[str]) -> list[str]:
    """On a worker: the paths it cannot see (runs there through ``client.run``)."""
    return [p for p in paths if not os.path.exists(p)]


def check_shared(client, executor: Executor, paths: list[str]) -> None:
    """Every worker sees ``paths`` (the source and the output folder): the storage must be shared."""
    missing = client.run(_sees, paths)
    for worker, gone in sorted(missing.items()):
        if gone:
            raise CheckpointError(f"--executor {executor}: worker {worker} does not see {gone[0]}; the source and"
                                  " --out must be on storage shared by this machine and every worker, under the same"
                                  " path")


# ---------------------------------------------------------------------------------------------------------------
# the worker side
# ---------------------------------------------------------------------------------------------------------------
_OPEN: dict = {}


def _source_on_worker(path: str, stamps: dict[str, tuple[int, int]]):
    """The source opened once per worker process, after checking its files are the ones the client planned with."""
    from workbench.checkpoint.pipeline import _Maps
    from workbench.checkpoint.source import open_source

    for file, (size, mtime) in stamps.items():
        st = os.stat(file)
        if (st.st_size, st.st_mtime_ns) != (size, mtime):
            raise SourceChanged(f"{file}: size {st.st_size}, mtime {st.st_mtime_ns} on this worker, but {size},"
                                f" {mtime} when the repack was planned: the source changed (or the worker sees"
                                " another copy)")
    key = (path, tuple(sorted(stamps.items())))
    if key not in _OPEN:
        _OPEN.clear()
        _OPEN[key] = (open_source(path), _Maps())
    return _OPEN[key]


def shard_task(source_path: str, stamps: dict, folder: str, job, backend: str) -> tuple[dict, list[str], int]:
    """One output file, on a worker: (journal entry, warnings, the worker's peak RSS)."""
    from workbench.checkpoint.pipeline import peak_rss, write_shard
    from workbench.checkpoint.repack import choose_backend

    src, maps = _source_on_worker(source_path, stamps)
    entry, warnings = write_shard(src, folder, job, choose_backend(backend)[0], maps)
    return entry, warnings, peak_rss()


def run_dask(client, executor: Executor, source_path: str, stamps: dict, folder: str, jobs: list, backend: str,
             retries: int, bar, on_shard, stats) -> None:
    """Send one task per shard, record each as it comes back; on a failure cancel the rest and say which shard."""
    from distributed import as_completed

    run = uuid.uuid4().hex[:8]
    futures = {}
    for job in jobs:
        fut = client.submit(shard_task, source_path, stamps, folder, job, backend, key=f"marlin-shard-{run}-{job.name}",
                            retries=retries, pure=False)
        futures[fut] = job
    try:
        with client.as_current():
            _collect(as_completed(list(futures)), futures, executor, folder, on_shard, stats, bar)
    finally:
        pending = [f for f in futures if not f.done()]
        if pending:
            client.cancel(pending, force=True)


def _collect(finished, futures, executor, folder, on_shard, stats, bar) -> None:
    """Record each shard as its task returns; the first failure ends the run, said with the shard it hit."""
    for fut in finished:
        job = futures[fut]
        try:
            entry, warnings, rss = fut.result()
        except CheckpointError:
            raise
        except OSError as exc:
            raise KeptPartialError(f"{exc.filename or os.path.join(folder, job.name)}: {exc.strerror or exc} on a"
                                   f" worker while writing {job.name}") from None
        except Exception as exc:
            if is_killed_worker(exc):
                raise KeptPartialError(f"--executor {executor}: the workers running {job.name} died"
                                       f" {_allowed_failures()} times (killed, or out of memory); the files finished"
                                       " so far are kept") from None
            raise
        on_shard(job.name, entry)
        stats.shards_written += 1
        stats.peak_worker_rss_bytes = max(stats.peak_worker_rss_bytes, rss)
        stats.warnings += warnings
        bar.update(job.source_bytes)


def _allowed_failures() -> int:
    import dask

    return int(dask.config.get("distributed.scheduler.allowed-failures", 3)) + 1
