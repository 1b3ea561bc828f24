"""``--executor dask://HOST:PORT`` on a dask.distributed LocalCluster on the loopback interface: the output is the
serial path's byte for byte; a worker killed mid-shard is replaced and the job still finishes identical; workers
that keep dying, a shard that fails to write and a cluster too small are clear errors that leave only finished,
checksummed shards (or nothing); verify runs there too."""
from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest
from file_snapshots import snapshot

distributed = pytest.importorskip("distributed")
import dask  # noqa: E402

from workbench import cli  # noqa: E402
from workbench.checkpoint import repack, verify  # noqa: E402
from workbench.checkpoint import synthetic as sy  # noqa: E402
from workbench.checkpoint.manifest import Journal  # noqa: E402
from workbench.checkpoint.output import read_marker  # noqa: E402
from workbench.checkpoint.pipeline import WRITING_PREFIX  # noqa: E402

QUIET = dict(progress=False, log=lambda msg: None)
SHARD = 1_000_000  # bytes: several output files
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _executor(cluster) -> str:
    return "dask://" + cluster.scheduler_address[len("tcp://"):]


@pytest.fixture(scope="module")
def cluster():
    """Two single-thread worker processes; a worker that dies is restarted by its nanny, and a task whose workers
    died twice is given up (KilledWorker)."""
    with dask.config.set({"distributed.scheduler.allowed-failures": 1}):
        with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                      dashboard_address=None, memory_limit="2GiB", env={"PYTHONPATH": ROOT}) as c:
            yield c


@pytest.fixture(scope="module")
def threads_cluster():
    """Workers as threads of this process, so a test can patch what they call."""
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, protocol="tcp", host="127.0.0.1",
                                  dashboard_address=None) as c:
        yield c


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Eight act-order layers (the NumPy conversion takes a moment per shard: long enough to kill a worker in)."""
    tmp = tmp_path_factory.mktemp("cluster")
    opt = sy.Options(fmt="gptq", bits=4, group_size=128, act_order=True)
    rng = np.random.default_rng(5)
    tensors = {}
    for i in range(8):
        w = rng.standard_normal((1024, 512)).astype(np.float32)
        tensors.update(sy.quantized_tensors(f"model.layers.{i}.mlp.up_proj", w, opt, seed=i))
    tensors["model.norm.weight"] = rng.standard_normal(1024).astype(np.float16)
    src = sy.write_checkpoint(str(tmp / "src"), tensors, opt)
    repack(src, tmp / "reference", executor="serial", max_shard_bytes=SHARD, **QUIET)
    return src, tmp / "reference"


def _shards(folder) -> list[str]:
    names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    assert len(names) >= 3
    return names


def _files(folder) -> dict:
    return {k: v for k, v in snapshot(folder).items() if k != ".marlin-workbench.json"}


class KillOnWrite(distributed.WorkerPlugin):
    """Kills its worker process (SIGKILL) once a shard file named ``shard`` is being written: mid-tensor."""

    def __init__(self, shard: str, flag: str, always: bool = False):
        self.shard, self.flag, self.always = shard, flag, always

    def setup(self, worker):
        self.worker = worker

    def transition(self, key, start, finish, **kwargs):
        name = key if isinstance(key, str) else str(key)
        if finish != "executing" or not name.endswith(self.shard):
            return
        if not self.always and os.path.exists(self.flag):
            return
        open(self.flag, "a").close()
        folder = self.folder

        def kill():
            deadline = time.time() + 30
            prefix = WRITING_PREFIX + self.shard  # + this attempt's own suffix
            while time.time() < deadline and not any(n.startswith(prefix) for n in os.listdir(folder)):
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=kill, daemon=True).start()


def _register(client, plugin, name):
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    client.register_plugin(plugin, name=name)


def test_the_cluster_writes_the_serial_bytes_and_verifies(cluster, source, tmp_path):
    src, reference = source
    before = snapshot(src)
    repack(src, tmp_path / "out", executor=_executor(cluster), max_shard_bytes=SHARD, **QUIET)
    assert _files(tmp_path / "out") == _files(reference)
    report = verify(tmp_path / "out", src, progress=False, executor=_executor(cluster))
    assert report.ok and report.layers_checked == 8
    assert snapshot(src) == before


def test_a_worker_killed_mid_shard_is_replaced_and_the_output_is_the_same(cluster, source, tmp_path):
    src, reference = source
    out = tmp_path / "out"
    with distributed.Client(cluster.scheduler_address) as client:
        plugin = KillOnWrite(_shards(reference)[1], str(tmp_path / "killed"))
        plugin.folder = str(tmp_path / "out.partial")
        _register(client, plugin, "kill-once")
        try:
            repack(src, out, executor=_executor(cluster), max_shard_bytes=SHARD, **QUIET)
        finally:
            client.unregister_worker_plugin("kill-once")
    assert (tmp_path / "killed").exists()  # the plugin did fire
    assert _files(out) == _files(reference)


def test_workers_that_keep_dying_leave_finished_shards_for_resume(cluster, source, tmp_path, capsys):
    src, reference = source
    out = tmp_path / "out"
    shard = _shards(reference)[-1]
    with distributed.Client(cluster.scheduler_address) as client:
        plugin = KillOnWrite(shard, str(tmp_path / "killed"), always=True)
        plugin.folder = str(tmp_path / "out.partial")
        _register(client, plugin, "kill-always")
        try:
            code = cli.main(["repack", src, "--out", str(out), "--executor", _executor(cluster), "--max-shard-size",
                             str(SHARD), "--no-progress"])
        finally:
            client.unregister_worker_plugin("kill-always")
    err = capsys.readouterr().err
    assert code == 2 and shard in err and "died" in err and "Traceback" not in err, err
    partial = tmp_path / "out.partial"
    assert read_marker(partial)["state"] == "partial" and not out.exists()
    names = os.listdir(partial)
    assert shard not in names and not [n for n in names if n.startswith(WRITING_PREFIX)]
    assert set(Journal.read(str(partial))["shards"]) <= set(names)
    assert cli.main(["repack", src, "--out", str(out), "--resume", "--executor", _executor(cluster),
                     "--max-shard-size", str(SHARD), "--no-progress"]) == 0
    assert _files(out) == _files(reference)


def test_a_shard_that_fails_to_write_is_named_and_nothing_half_written_stays(threads_cluster, source, tmp_path,
                                                                              monkeypatch, capsys):
    import workbench.checkpoint.safetensors_io as io

    src, reference = source
    real = io.StreamingWriter.write

    def write(self, name, array, index=None):  # the disk fills up while the second file is written
        if "00002" in self.path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
        real(self, name, array, index)
    monkeypatch.setattr(io.StreamingWriter, "write", write)
    out = tmp_path / "out"
    code = cli.main(["repack", src, "--out", str(out), "--executor", _executor(threads_cluster), "--retries", "0",
                     "--max-shard-size", str(SHARD), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and os.strerror(errno.ENOSPC) in err and "00002" in err, err
    time.sleep(0.5)  # a task already running when the run ended finishes (it renames a complete file, or nothing)
    partial = tmp_path / "out.partial"
    names = os.listdir(partial)
    assert not [n for n in names if n.startswith(WRITING_PREFIX)] and "marlin_checkpoint.json" not in names
    assert not any("00002" in n for n in names)
    monkeypatch.setattr(io.StreamingWriter, "write", real)
    assert cli.main(["repack", src, "--out", str(out), "--resume", "--executor", _executor(threads_cluster),
                     "--max-shard-size", str(SHARD), "--no-progress"]) == 0
    assert _files(out) == _files(reference)


def test_a_cluster_without_memory_for_a_layer_is_refused_before_anything_is_written(threads_cluster, source,
                                                                                     tmp_path, capsys):
    src, _ = source
    code = cli.main(["repack", src, "--out", str(tmp_path / "out"), "--executor", _executor(threads_cluster),
                     "--worker-memory", "1MB", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "needs about" in err and "--memory-limit" in err
    assert os.listdir(tmp_path) == []


def test_an_unreachable_scheduler_and_a_bad_address_are_messages(source, tmp_path, capsys):
    src, _ = source
    code = cli.main(["repack", src, "--out", str(tmp_path / "out"), "--executor", "dask://localhost:notaport"])
    assert code == 2 and "dask://HOST:PORT" in capsys.readouterr().err
    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        import workbench.checkpoint.executor as ex

        old, ex.CONNECT_TIMEOUT_S = ex.CONNECT_TIMEOUT_S, 2
        try:
            code = cli.main(["repack", src, "--out", str(tmp_path / "out"), "--executor", "dask://127.0.0.1:9",
                             "--no-progress"])
        finally:
            ex.CONNECT_TIMEOUT_S = old
    assert code == 2 and "cannot reach the dask scheduler" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
