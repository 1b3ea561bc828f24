"""Call plans of the public ops on device arrays, without a GPU: the GPU path of kernels_numba (the runtime's
arrays and launches) on the stand-in CuPy and driver of tests/fake_device.py, in a process of its own (the tier's
process runs the CUDA simulator, where the runtime path is not taken).

A replayed call must launch what the full path launches (same functions, grids, blocks, streams and argument
values, with the new call's input and output addresses in place of the first call's), return a fresh output each
call, and go the full way whenever its outcome cannot be replayed (poisoned outputs)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r'''
import itertools, json, sys, time
import numpy as np
sys.path.insert(0, "tests")
import fake_device
from fake_device import FakeArray, FakeCuPy
from workbench.cuda import arrays as rta
from workbench.cuda import launch as rtl

fake = FakeCuPy()


class Array(FakeArray):
    def __init__(self, shape, dtype, memptr=None, **kw):
        super().__init__((shape,) if isinstance(shape, int) else shape, dtype,
                         ptr=None if memptr is None else memptr.ptr, **kw)


class MemoryPointer:
    def __init__(self, mem, offset):
        self.mem, self.ptr = mem, mem.ptr + offset


fake_device._Memory.mem = property(lambda m: m)
fake.ndarray, fake.cuda.MemoryPointer = Array, MemoryPointer
fake.empty = lambda shape, dtype: Array(shape, dtype)
rta._cupy_module, rta._cupy_array = fake, Array

import kernels_numba._launch as L
assert not L.SIMULATOR


class Driver:
    CUkernel = type("CUkernel", (), {})

    @staticmethod
    def cuCtxGetDevice():
        return 0, 0

    memsets = 0

    @staticmethod
    def cuMemsetD8Async(*args):
        Driver.memsets += 1
        return (0,)

    @staticmethod
    def cuMemcpyHtoDAsync(*args):
        return (0,)


L._driver = lambda: Driver
launches, functions = [], itertools.count(0x1000)


def launch_kernel(launch, stream, params):
    launches.append((launch.function, launch._grid3, launch._block3, stream, list(L._recorded_values)))


rtl.launch_kernel = launch_kernel
_launch_plan = L._launch_plan


def record_values(plan, grid, block, handle, values):
    L._recorded_values = list(values)
    _launch_plan(plan, grid, block, handle, values)


L._launch_plan = record_values


def compile_(self, key, args, nvalues):
    plan = L._Plan(next(functions), "q" * nvalues)
    self._plans[key] = plan
    return plan


L.RuntimeKernel._compile = compile_
from workbench import backends, ops
backends._target = "gpu"
K, N, G = 256, 512, 128
cases = {
    "gptq u4": (lambda x: ops.gptq_marlin_repack(x, None, K, N, 4), ((K // 8, N), np.int32)),
    "gptq u8": (lambda x: ops.gptq_marlin_repack(x, None, K, N, 8), ((K // 4, N), np.int32)),
    "awq u4": (lambda x: ops.awq_marlin_repack(x, K, N, 4), ((K, N // 8), np.int32)),
    "block fp8": (lambda x: ops.block_fp8_group128_repack(x, K, N), ((N, K), np.uint8)),
    "scales f16": (lambda x: ops.marlin_permute_scales(x, K, N, G), ((K // G, N), np.float16)),
    "fp8 scales": (lambda x: ops.block_fp8_group128_scales(x, K, N), ((N // 128, K // 128), np.float32)),
    "to awq": (lambda x: ops.marlin_to_awq_qweight(x, K, N, 4), ((K // 16, N * 2), np.int32)),
    "to gptq u8": (lambda x: ops.marlin_to_gptq_qweight(x, None, K, N, 8), ((K // 16, N * 4), np.int32)),
    "to row-major": (lambda x: ops.marlin_to_block_fp8(x, K, N), ((K // 16, N * 4), np.int32)),
}


def symbolic(calls, x, out):
    """The launches with the call's input / output addresses named (in, out + offset)."""
    lo, hi = out.data.ptr, out.data.ptr + out.nbytes
    return [[f, g, b, s, [("in", v - x.data.ptr) if x.data.ptr <= v < x.data.ptr + x.nbytes else
                           ("out", v - lo) if lo <= v < hi else v for v in values]] for f, g, b, s, values in calls]


result = {}
for name, (call, (shape, dtype)) in cases.items():
    runs = []
    for i in range(3):
        x = Array(shape, dtype)
        del launches[:]
        out = call(x)
        runs.append(dict(launches=symbolic(launches, x, out), out=out.data.ptr, shape=list(out.shape),
                         dtype=str(out.dtype)))
    result[name] = dict(same=runs[0]["launches"] == runs[1]["launches"] == runs[2]["launches"],
                        launches=len(runs[0]["launches"]), fresh=len({r["out"] for r in runs}) == 3,
                        shape=runs[0]["shape"] == runs[2]["shape"], dtype=runs[0]["dtype"] == runs[2]["dtype"])
result["plans"] = sum(v[0] is not None for v in backends._plans.values())
x = Array((K // 8, N), np.int32)
ops.gptq_marlin_repack(x, None, K, N, 4)  # a planned call
with L.poison_outputs():  # poisoned: the full path, which fills the output first
    ops.gptq_marlin_repack(x, None, K, N, 4)
result["poison_memsets"] = Driver.memsets
n = 300
t = time.perf_counter()
for _ in range(n):
    ops.gptq_marlin_repack(x, None, K, N, 4)
result["replay_us"] = (time.perf_counter() - t) / n * 1e6
backends._plans.clear()
t = time.perf_counter()
for _ in range(n):
    backends._plans.clear()
    ops.gptq_marlin_repack(x, None, K, N, 4)
result["full_us"] = (time.perf_counter() - t) / n * 1e6
print(json.dumps(result))
'''


def test_replayed_calls_launch_what_the_full_path_launches():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    print({k: result[k] for k in ("replay_us", "full_us")})
    for name, cell in result.items():
        if isinstance(cell, dict):
            assert cell["launches"] >= 1 and cell["same"] and cell["fresh"] and cell["shape"] and cell["dtype"], \
                (name, cell)
    assert result["plans"] == len([c for c in result.values() if isinstance(c, dict)])
    assert result["poison_memsets"] == 1
    assert result["replay_us"] < result["full_us"]


# A verdict read back inside a recorded call (zero-point codes here) is replayed: the replay uploads the op's
# constant (the verdict slot's first value), launches, reads the verdict again, and goes the full way when it
# differs from the recorded one; the full path then raises the check's message. The stand-in driver keeps the
# bytes uploaded, and a "bad" switch makes the next launch mark every verdict slot, as the check kernel would.
VERDICT_SCRIPT = SCRIPT[:SCRIPT.index("result = {}")] + r'''
import ctypes
memory, state = {}, {"bad": False, "launches": 0, "full": 0}


class MemoryDriver(Driver):
    @staticmethod
    def cuMemcpyHtoDAsync(dst, src, nbytes, stream):
        memory[int(dst)] = bytearray(ctypes.string_at(src, nbytes))
        return (0,)

    @staticmethod
    def cuMemcpyDtoHAsync(dst, src, nbytes, stream):
        data = bytes(memory.get(int(src), bytes(nbytes))[:nbytes])
        ctypes.memmove(dst, data, len(data))
        return (0,)

    @staticmethod
    def cuStreamSynchronize(stream):
        return (0,)


L._driver = lambda: MemoryDriver


def launch_marking_verdicts(launch, stream, params):
    state["launches"] += 1
    if state["bad"]:  # the check found an offender: each verdict slot now names element 0
        for slot in memory.values():
            slot[:8] = (0).to_bytes(8, "little")
    launch_kernel(launch, stream, params)


rtl.launch_kernel = launch_marking_verdicts
zp = Array((K // G, N), np.uint8)
ops.marlin_zero_points(zp, K, N, 4)  # recorded
full = backends._kernels["marlin_zero_points"]


def counted(*args, **kwargs):
    state["full"] += 1
    return full(*args, **kwargs)


backends._kernels["marlin_zero_points"] = counted
outs = [ops.marlin_zero_points(zp, K, N, 4) for _ in range(3)]
result = {"planned": sum(k[0] == "marlin_zero_points" and p is not None for k, (p, _) in backends._plans.items()),
          "good_full": state["full"], "good_launches": state["launches"] - 1,
          "fresh": len({o.data.ptr for o in outs}) == 3}
state["bad"], state["launches"] = True, 0
try:
    ops.marlin_zero_points(zp, K, N, 4)
    result["raised"] = None
except ValueError as exc:
    result["raised"] = str(exc)
result["bad_full"], result["bad_launches"] = state["full"] - result["good_full"], state["launches"]
state["bad"] = False
ops.marlin_zero_points(zp, K, N, 4)
result["after_full"] = state["full"] - result["good_full"] - result["bad_full"]
print(json.dumps(result))
'''


def test_replayed_verdicts_are_read_again_and_a_bad_one_takes_the_full_path():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, "-c", VERDICT_SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["planned"] == 1 and result["fresh"], result
    assert result["good_full"] == 0 and result["good_launches"] == 3, result  # three replays, one launch each
    # the replay launched and read the bad verdict, then the full path launched again and raised the check's message
    assert result["bad_launches"] == 2 and result["bad_full"] == 1, result
    assert result["raised"] and "zp[0, 0] = 0" in result["raised"], result
    assert result["after_full"] == 0, result  # the recorded plan still serves good calls
