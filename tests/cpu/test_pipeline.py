"""The pipelined repack (workbench.checkpoint.pipeline) and --resume: the output is the serial path's byte for byte
for any executor and worker count; an interrupted, failed or killed run leaves only finished, checksummed shards,
which --resume keeps and a changed source refuses; the source is never touched."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from file_snapshots import snapshot

from workbench import cli
from workbench.checkpoint import repack, verify
from workbench.checkpoint import synthetic as sy
from workbench.checkpoint.manifest import PROGRESS, Journal
from workbench.checkpoint.output import read_marker
from workbench.checkpoint.pipeline import WRITING_PREFIX, Stats

QUIET = dict(progress=False, log=lambda msg: None)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL_RECORDS = {".marlin-workbench.json"}  # holds the writing run's pid and times


def _model(tmp_path, opt, name="src", seed=0) -> str:
    return sy.random_model(str(tmp_path / name), opt, {"model.layers.0.self_attn.q_proj": (256, 256),
                                                       "model.layers.0.mlp.down_proj": (512, 128)},
                           experts=3, expert_shape=(128, 128), seed=seed)


def _files(folder) -> dict:
    return {k: v for k, v in snapshot(folder).items() if k not in TOOL_RECORDS}


def _cli(capsys, *argv):
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.out, captured.err


FORMATS = [sy.Options(fmt="gptq", bits=4, group_size=128, act_order=True),
           sy.Options(fmt="awq", bits=4, group_size=64, sym=False),
           sy.Options(fmt="block-fp8", group_size=128)]


@pytest.mark.parametrize("opt", FORMATS, ids=lambda o: o.fmt)
def test_every_executor_writes_the_serial_bytes(opt, tmp_path):
    src = _model(tmp_path, opt)
    before = snapshot(src)
    shard = 60_000  # several files, one of them holding only pass-through tensors
    repack(src, tmp_path / "serial", executor="serial", max_shard_bytes=shard, **QUIET)
    repack(src, tmp_path / "one", workers=1, max_shard_bytes=shard, **QUIET)
    reference = _files(tmp_path / "serial")
    assert len([f for f in reference if f.endswith(".safetensors")]) >= 3
    assert _files(tmp_path / "one") == reference
    if opt.fmt == "gptq":  # worker processes once (their start costs seconds on a 2-core box)
        stats = Stats()
        repack(src, tmp_path / "two", workers=2, max_shard_bytes=shard, stats=stats, **QUIET)
        assert stats.path == "process" and stats.workers == 2 and stats.peak_worker_rss_bytes > 0
        assert _files(tmp_path / "two") == reference
        assert verify(tmp_path / "two", src, progress=False, workers=2).ok
    assert snapshot(src) == before
    manifest = json.load(open(tmp_path / "one" / "marlin_checkpoint.json"))
    assert set(manifest["shards"]) == {f for f in reference if f.endswith(".safetensors")}
    from workbench.checkpoint.manifest import file_checksum  # computed while the files filled: the whole file's

    for name, entry in manifest["shards"].items():
        assert entry["digest"] == file_checksum(str(tmp_path / "one" / name), entry["checksum"])
        assert entry["bytes"] == os.path.getsize(tmp_path / "one" / name)
    assert not any(name.startswith(WRITING_PREFIX) or name == PROGRESS for name in os.listdir(tmp_path / "one"))


def test_stats_report_a_memory_bound_of_the_largest_task(tmp_path):
    src = _model(tmp_path, FORMATS[0])
    stats = Stats()
    repack(src, tmp_path / "out", workers=1, stats=stats, **QUIET)
    assert stats.source_bytes > 0 and stats.seconds > 0 and stats.peak_rss_bytes > 0
    largest = os.path.getsize(os.path.join(src, "model.safetensors"))  # a task is one layer, far below the file
    assert 0 < stats.memory_bound_bytes < 4 * largest + 64 * 1024**2


def _interrupt_after_first_shard(monkeypatch, src, out, failure=KeyboardInterrupt):
    """Run a repack that stops (``failure``) as its second file is recorded: one file finished, one not."""
    real = Journal.add
    calls = []

    def add(self, name, entry):
        calls.append(name)
        if len(calls) == 2:
            raise failure()
        real(self, name, entry)
    monkeypatch.setattr(Journal, "add", add)
    with pytest.raises(failure):
        repack(src, out, workers=1, max_shard_bytes=60_000, **QUIET)
    monkeypatch.setattr(Journal, "add", real)
    return calls[0]


def test_resume_keeps_finished_shards_and_writes_the_rest(tmp_path, monkeypatch):
    src = _model(tmp_path, FORMATS[1])
    repack(src, tmp_path / "ref", executor="serial", max_shard_bytes=60_000, **QUIET)
    out = tmp_path / "out"
    first = _interrupt_after_first_shard(monkeypatch, src, out)
    partial = tmp_path / "out.partial"
    assert read_marker(partial)["state"] == "partial"
    recorded = list(Journal.read(str(partial))["shards"])  # files finished meanwhile are recorded on the way out
    assert first in recorded and all((partial / n).exists() for n in recorded)
    assert not [n for n in os.listdir(partial) if n.startswith(WRITING_PREFIX)]
    kept = os.stat(partial / first)
    logs = []
    stats = Stats()
    repack(src, out, resume=True, max_shard_bytes=60_000, progress=False, log=logs.append, stats=stats)
    assert stats.shards_kept == len(recorded) and any(f"keeping {len(recorded)} finished file" in line
                                                      for line in logs)
    assert os.stat(out / first).st_ino == kept.st_ino  # kept, not rewritten
    assert _files(out) == _files(tmp_path / "ref") and verify(out, src, progress=False).ok


def test_resume_rewrites_a_finished_shard_that_was_damaged(tmp_path, monkeypatch):
    src = _model(tmp_path, FORMATS[1])
    repack(src, tmp_path / "ref", executor="serial", max_shard_bytes=60_000, **QUIET)
    first = _interrupt_after_first_shard(monkeypatch, src, tmp_path / "out")
    path = tmp_path / "out.partial" / first
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))
    logs = []
    repack(src, tmp_path / "out", resume=True, max_shard_bytes=60_000, progress=False, log=logs.append)
    assert any(f"{first} does not match its journal entry" in line for line in logs)
    assert _files(tmp_path / "out") == _files(tmp_path / "ref")


@pytest.mark.parametrize("change", ["mtime", "size", "header"])
def test_resume_refuses_a_source_that_changed(change, tmp_path, monkeypatch, capsys):
    src = _model(tmp_path, FORMATS[1])
    _interrupt_after_first_shard(monkeypatch, src, tmp_path / "out")
    shard = os.path.join(src, "model.safetensors")
    st = os.stat(shard)
    if change == "mtime":
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    elif change == "size":  # rewritten with one more (pass-through) tensor
        from safetensors.numpy import load_file, save_file

        tensors = load_file(shard)
        tensors["model.extra.weight"] = np.random.default_rng(9).standard_normal(64).astype(np.float16)
        save_file(tensors, shard, metadata={"format": "pt"})
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:  # same size and mtime, one header byte different (a tensor renamed)
        data = bytearray(open(shard, "rb").read())
        at = data.index(b"model.norm.weight")
        data[at] = ord("M")
        open(shard, "wb").write(bytes(data))
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    before_src, before_partial = snapshot(src), snapshot(tmp_path / "out.partial")
    code, _, err = _cli(capsys, "repack", src, "--out", str(tmp_path / "out"), "--resume",
                        "--max-shard-size", "60000", "--no-progress")
    what = {"mtime": "modification time", "size": "size", "header": "header checksum"}[change]
    assert code == 2 and shard in err and what in err and "source changed" in err
    assert snapshot(src) == before_src and snapshot(tmp_path / "out.partial") == before_partial
    assert not (tmp_path / "out").exists()


def test_resume_refuses_another_plan_and_force_with_resume(tmp_path, monkeypatch, capsys):
    src = _model(tmp_path, FORMATS[1])
    _interrupt_after_first_shard(monkeypatch, src, tmp_path / "out")
    code, _, err = _cli(capsys, "repack", src, "--out", str(tmp_path / "out"), "--resume", "--no-progress")
    assert code == 2 and "planned with other output files" in err and (tmp_path / "out.partial").exists()
    code, _, err = _cli(capsys, "repack", src, "--out", str(tmp_path / "out"), "--resume", "--force")
    assert code == 2 and "contradict" in err


def test_a_full_disk_keeps_only_finished_shards_for_resume(tmp_path, monkeypatch, capsys):
    from workbench.checkpoint import pipeline

    src = _model(tmp_path, FORMATS[2])
    before = snapshot(src)
    repack(src, tmp_path / "ref", executor="serial", max_shard_bytes=60_000, **QUIET)
    real = pipeline._pwrite_all

    def pwrite_all(fd, data, at):  # the disk fills up in the second file (a task's own write, as os.pwrite says it)
        if "00002" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data, at)
    # (a full disk makes the mapped write's MADV_POPULATE_WRITE fail, which then writes with pwrite to say why)
    monkeypatch.setattr(pipeline, "_copy_mapped", lambda fd, data, at: False)
    monkeypatch.setattr(pipeline, "_pwrite_all", pwrite_all)
    code, _, err = _cli(capsys, "repack", src, "--out", str(tmp_path / "out"), "--workers", "1",
                        "--max-shard-size", "60000", "--no-progress")
    assert code == 2 and os.strerror(errno.ENOSPC) in err and "--resume" in err
    partial = tmp_path / "out.partial"
    names = sorted(os.listdir(partial))
    assert not [n for n in names if n.startswith(WRITING_PREFIX)] and "marlin_checkpoint.json" not in names
    recorded = Journal.read(str(partial))["shards"]
    assert recorded and all(n in names for n in recorded) and not any("00002" in n for n in names)
    monkeypatch.setattr(pipeline, "_pwrite_all", real)
    monkeypatch.undo()
    assert _cli(capsys, "repack", src, "--out", str(tmp_path / "out"), "--resume", "--max-shard-size", "60000",
                "--no-progress")[0] == 0
    assert _files(tmp_path / "out") == _files(tmp_path / "ref") and snapshot(src) == before


@pytest.mark.parametrize("mode", ["mmap", "pwrite"])
def test_a_task_writes_its_results_at_their_places_either_way(mode, tmp_path):
    """write_results: the bytes land at the planned offsets (an expert's slice at its index, offsets not page
    aligned) whether through a mapping or pwrite; nothing else in the file changes; the arrays are dropped."""
    from workbench.checkpoint import pipeline

    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(bytes(range(256)) * 400)  # 102400 bytes
    before = open(path, "rb").read()
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2**31, (7, 33), dtype=np.int32)
    b = rng.random((5, 64)).astype(np.float16)
    result = pipeline.TaskResult("s", 0, 2, {"a": a, "b": b}, 0, [])
    places = {"a": 1001, "b": 70_000 - 2 * b.nbytes}  # b: expert 2 of a stack starting there
    pipeline.write_results(path, places, result, mode)
    after = open(path, "rb").read()
    expected = bytearray(before)
    at_a = 1001 + 2 * a.nbytes
    expected[at_a: at_a + a.nbytes] = a.tobytes()
    expected[70_000: 70_000 + b.nbytes] = b.tobytes()
    assert after == bytes(expected)
    assert result.arrays == {} and result.written == {"a": a.nbytes, "b": b.nbytes} and "write" in result.seconds


def test_a_bad_tensor_in_a_worker_is_a_message_and_leaves_nothing(tmp_path, capsys):
    opt = sy.Options(fmt="gptq", bits=4, group_size=64, sym=False)
    src = _model(tmp_path, opt)
    path = os.path.join(src, "model.safetensors")
    from safetensors.numpy import load_file, save_file

    tensors = load_file(path)
    name = "model.layers.0.mlp.experts.1.up_proj.qzeros"
    tensors[name] = np.full_like(tensors[name], -1)  # GPTQ v1 stores zero - 1: all ones is out of range
    save_file(tensors, path, metadata={"format": "pt"})
    code, _, err = _cli(capsys, "repack", src, "--out", str(tmp_path / "out"), "--workers", "2", "--no-progress")
    assert code == 2 and name in err and "outside" in err
    assert sorted(os.listdir(tmp_path)) == ["src"]


def _big_source(tmp_path) -> str:
    """A checkpoint whose conversion takes a few seconds: many act-order layers (one, repeated under many names)."""
    opt = sy.Options(fmt="gptq", bits=4, group_size=128, act_order=True)
    w = np.random.default_rng(3).standard_normal((1024, 1024)).astype(np.float32)
    one = sy.quantized_tensors("x", w, opt, seed=1)
    tensors = {f"model.layers.{i}.mlp.up_proj{k[1:]}": v for i in range(48) for k, v in one.items()}
    return sy.write_checkpoint(str(tmp_path / "src"), tensors, opt)


def test_a_worker_process_killed_mid_tensor_is_a_message_and_resume_finishes(tmp_path, capsys):
    import psutil

    src = _big_source(tmp_path)
    out = tmp_path / "out"
    # (backend numpy, the reference ops: slow enough that a worker is caught converting; the compiled cpu loops
    # finish this checkpoint too quickly for the window below)
    argv = [sys.executable, "-m", "workbench", "repack", src, "--out", str(out), "--workers", "2",
            "--max-shard-size", "2MB", "--no-progress", "--backend", "numpy"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT, "PYTHONFAULTHANDLER": "1"})
    partial, victim = tmp_path / "out.partial", None
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and victim is None:
        # a pool worker is a child of the forkserver; the window keeps every worker converting while tasks remain
        busy = [c for c in psutil.Process(proc.pid).children(recursive=True) if c.ppid() != proc.pid]
        if busy and (partial / PROGRESS).exists() and Journal.read(str(partial))["shards"]:
            victim = busy[0]
        time.sleep(0.05)
    assert victim is not None, "no worker was converting while the run went on; make the checkpoint larger"
    victim.send_signal(signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # say where it hangs: faulthandler prints every thread on SIGABRT
        proc.send_signal(signal.SIGABRT)
        pytest.fail("the repack did not end after its worker was killed:\n" + proc.communicate(timeout=60)[1][-8000:])
    assert proc.returncode == 2 and "worker process died" in err and "Traceback" not in err, err
    names = os.listdir(partial)
    assert not [n for n in names if n.startswith(WRITING_PREFIX)] and read_marker(partial)["state"] == "partial"
    assert _cli(capsys, "repack", src, "--out", str(out), "--resume", "--workers", "1", "--max-shard-size", "2MB",
                "--no-progress")[0] == 0
    assert verify(out, src, progress=False).ok


def test_verify_names_a_file_whose_checksum_changed_while_its_tensors_match(tmp_path):
    src = _model(tmp_path, FORMATS[1])
    out = tmp_path / "out"
    repack(src, out, **QUIET)
    path = out / "model.safetensors"
    data = bytearray(path.read_bytes())
    at = data.index(b'"format":"pt"')  # header metadata: no tensor byte changes
    data[at + 10: at + 12] = b"PT"
    path.write_bytes(bytes(data))
    report = verify(out, src, progress=False)
    assert not report.ok and report.differing_elements == 0
    assert len(report.problems) == 1 and str(path) in report.problems[0] and "checksum" in report.problems[0]


_GPU_PATH = r"""
import sys
from workbench.checkpoint import repack
from workbench.checkpoint.pipeline import Stats
stats = Stats()
repack(sys.argv[1], sys.argv[2], backend="numba", max_shard_bytes=40000, progress=False, log=lambda m: None,
       stats=stats)
assert stats.path == "gpu", stats.path
"""


def test_the_gpu_path_writes_the_serial_bytes_in_the_simulator(tmp_path):
    """The GPU path's code (pinned staging pool, converter threads, whole-width op calls) in the CUDA simulator."""
    opt = sy.Options(fmt="gptq", bits=4, group_size=64, sym=False)
    src = sy.random_model(str(tmp_path / "src"), opt, {"model.layers.0.mlp.up_proj": (128, 128)}, experts=2,
                          expert_shape=(128, 128))
    repack(src, tmp_path / "serial", executor="serial", max_shard_bytes=40000, **QUIET)
    env = {**os.environ, "PYTHONPATH": ROOT, "NUMBA_ENABLE_CUDASIM": "1"}
    done = subprocess.run([sys.executable, "-c", _GPU_PATH, src, str(tmp_path / "gpu")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _files(tmp_path / "gpu") == _files(tmp_path / "serial")


CPU_IMPORTS = r'''
import importlib.abc, json, sys
attempted = []


class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("cupy", "torch"):
            attempted.append(name)
        return None


sys.meta_path.insert(0, Watch())
from workbench.checkpoint import repack
for i, src in enumerate(sys.argv[1:]):
    repack(src, src + f".out{i}", backend="numpy", workers=1, progress=False, log=lambda m: None)
print(json.dumps(sorted(set(attempted))))
'''


def test_the_cpu_path_never_imports_cupy_or_torch(tmp_path):
    """Asking whether an op's argument (a dtype, a host array) is a CuPy array must not import CuPy: on a GPU machine
    that import (and the CUDA libraries it loads) would cost every CPU worker process time and memory."""
    sources = [_model(tmp_path, opt, name=opt.fmt) for opt in FORMATS]
    run = subprocess.run([sys.executable, "-c", CPU_IMPORTS, *sources], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == []


def test_an_explicit_numpy_backend_never_looks_for_a_gpu():
    """backend="numpy" is a promise to stay on the CPU: choosing it must not probe for a GPU (which loads
    numba.cuda and the driver in the coordinator); "auto" says why it fell back."""
    code = ("import importlib, sys; r = importlib.import_module('workbench.checkpoint.repack'); "
            "print(r.choose_backend('numpy')[1]); print('numba.cuda' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-1] == "False" and "NumPy reference path on the CPU" in run.stdout


@pytest.mark.parametrize("opt", [sy.Options(fmt="block-fp8", group_size=128),
                                 sy.Options(fmt="gptq", bits=4, group_size=64),
                                 sy.Options(fmt="gptq", bits=4, group_size=64, sym=False),
                                 sy.Options(fmt="gptq", bits=4, group_size=128, act_order=True)],
                         ids=["block-fp8", "gptq-sym", "gptq-asym", "gptq-act-order"])
def test_the_device_conversion_gives_the_host_conversions_bytes(opt, tmp_path):
    """convert.to_marlin_device (the GPU path's results left on the device) writes what to_marlin writes, byte for
    byte, for every layer and expert it takes (run here with the NumPy ops standing in for the device's), fused
    projections included; act-order layers it leaves to to_marlin."""
    from workbench.checkpoint.convert import NotOnDevice, device_conversion, to_marlin, to_marlin_device
    from workbench.checkpoint.layers import discover
    from workbench.checkpoint.source import open_source

    src = open_source(_model(tmp_path, opt))
    layers = discover(src).layers
    assert layers
    for spec in layers:
        if not device_conversion(spec):
            assert spec.act_order
            with pytest.raises(NotOnDevice):
                to_marlin_device(src, spec, 0, np.asarray, None, backend="numpy")
            continue
        for e in range(max(spec.num_experts, 1)):
            host = to_marlin(src, spec, e, "numpy")
            dev = to_marlin_device(src, spec, e, np.asarray, None, backend="numpy")
            for a, b in ((host.qweight, dev.qweight), (host.scales, dev.scales), (host.zeros, dev.zeros)):
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.shape == b.shape and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
    assert any(device_conversion(s) for s in layers) and (not opt.act_order or any(s.act_order for s in layers))
