"""The repack benchmark times what the wrappers run: for every weight repack and every inverse, the launches that
``bench/bench_repack.py`` makes (``repack_launch`` / ``unpack_launch``) and the launches the public wrappers make are
recorded at the kernel-call boundary (which kernel — its code and closure constants —, grid, block, argument shapes and
dtypes) and must be the same list; the outputs must be bitwise equal too. A bench that builds its own kernel or grid
(the drift 65b47b3 / 16b6c93 mended for the forward path) fails here."""
import importlib.util
import os
import sys

import numpy as np
import pytest
from numba import cuda

from kernels_numba import marlin_repack as kr
from workbench import hardware

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "bench_repack.py")


@pytest.fixture(scope="module")
def bench():
    bench_dir = os.path.dirname(os.path.abspath(BENCH))
    sys.path.insert(0, bench_dir)  # bench_repack imports repack_timer from its own folder
    try:
        spec = importlib.util.spec_from_file_location("bench_repack_under_test", BENCH)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(bench_dir)
    return module


def _identity(fn):
    """What decides a kernel's generated code: its code object and the values its closure captured (recursively
    for captured functions and kernels)."""
    fn = getattr(fn, "py_func", fn)
    cells = []
    for cell in fn.__closure__ or ():
        value = cell.cell_contents
        if callable(value) and hasattr(getattr(value, "py_func", value), "__code__"):
            cells.append(_identity(value))
        elif isinstance(value, (int, float, bool, str, type(None), tuple)):
            cells.append(value)
        else:
            cells.append(repr(type(value)))
    return fn.__code__, tuple(cells)


def _dims(d):
    d = tuple(d) if isinstance(d, (tuple, list)) else (d,)
    return tuple(int(x) for x in d) + (1,) * (3 - len(d))


def _args(args):
    return tuple((tuple(a.shape), np.dtype(a.dtype).str) if hasattr(a, "shape") else int(a) for a in args)


@pytest.fixture
def launches(monkeypatch):
    """Every kernel launch made inside the test, as (kernel identity, grid, block, argument shapes/dtypes)."""
    if not hardware.simulator_enabled():
        pytest.skip("records launches through the simulator's kernel class")
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    calls = []
    original = FakeCUDAKernel.__getitem__

    def getitem(self, config):
        configured = original(self, config)

        def launch(*args):
            calls.append((_identity(self), _dims(config[0]), _dims(config[1]), _args(args)))
            return configured(*args)

        return launch

    monkeypatch.setattr(FakeCUDAKernel, "__getitem__", getitem)
    return calls


def _poisoned(out):
    host = np.full(out.shape, 0xDEADBEEF, np.uint32)
    out.copy_to_device(host)
    return out


# (bits, target, wrapper): every inverse the wrappers offer, at one and two stacked experts
INVERSES = [(4, "gptq", lambda q, k, n: kr.marlin_to_gptq_qweight(q, None, k, n, 4)),
            (8, "gptq", lambda q, k, n: kr.marlin_to_gptq_qweight(q, None, k, n, 8)),
            (8, "gptq", lambda q, k, n: kr.marlin_to_fp8_raw_bits(q, k, n)),
            (4, "awq", lambda q, k, n: kr.marlin_to_awq_qweight(q, k, n, 4)),
            (8, "awq", lambda q, k, n: kr.marlin_to_awq_qweight(q, k, n, 8)),
            (8, "row_major_bytes", lambda q, k, n: kr.marlin_to_block_fp8_row_major(q, k, n))]


@pytest.mark.parametrize("n_fastest_fits", [True, False])
@pytest.mark.parametrize("experts", [1, 2])
@pytest.mark.parametrize("bits, target, wrapper", INVERSES)
def test_bench_inverse_launch_is_the_wrappers(bits, target, wrapper, experts, n_fastest_fits, bench, launches, rng,
                                              monkeypatch):
    if not n_fastest_fits:
        if target != "awq":
            pytest.skip("only the AWQ inverse has a grid-order fallback")
        monkeypatch.setattr(kr, "grid_n_fastest_fits", lambda *a, **kw: False)
    k, n = 32, 128
    pf = 32 // bits
    marlin = rng.integers(0, 2**32, (experts, k // 16, n * 16 // pf), dtype=np.uint64).astype(np.uint32)
    d_marlin = cuda.to_device(marlin)

    got_wrapper = wrapper(d_marlin if experts > 1 else d_marlin.reshape(marlin.shape[1:]), k, n)
    wrapper_launches = list(launches)
    launches.clear()
    out, launch = bench.unpack_launch(kr, d_marlin, bits, target, k, n, cuda.default_stream())
    _poisoned(out)
    launch()
    bench_launches = list(launches)

    assert wrapper_launches, "the wrapper launched nothing"
    assert bench_launches == wrapper_launches
    wrapper_words = np.asarray(got_wrapper.copy_to_host()).reshape(-1).view(np.uint8)
    assert np.array_equal(out.copy_to_host().reshape(-1).view(np.uint8), wrapper_words)


FORWARDS = [(4, "gptq", False), (8, "gptq", False), (4, "gptq_perm", False), (8, "gptq_perm", False),
            (4, "awq", False), (8, "awq", False), (8, "row_major_bytes", False)]


def _wrapper_repack(bits, source, d_src, perm, k, n):
    if source == "awq":
        return kr.awq_marlin_repack(d_src, k, n, bits)
    if source == "row_major_bytes":
        return kr.block_fp8_group128_repack(d_src.view(np.uint8), k, n)
    return kr.gptq_marlin_repack(d_src, perm, k, n, bits)


@pytest.mark.parametrize("experts", [1, 2])
@pytest.mark.parametrize("bits, source, _unused", FORWARDS)
def test_bench_repack_launch_is_the_wrappers(bits, source, _unused, experts, bench, launches, rng):
    k, n = 32, 128
    pf = 32 // bits
    shape = {"awq": (experts, k, n // pf), "row_major_bytes": (experts, n, k // 4)}.get(source, (experts, k // pf, n))
    src = rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32)
    d_src = cuda.to_device(src)
    perm = np.stack([rng.permutation(k) for _ in range(experts)]).astype(np.int32) if source == "gptq_perm" else None
    d_perm = cuda.to_device(perm) if perm is not None else None

    got_wrapper = _wrapper_repack(bits, source, d_src, d_perm, k, n)
    # the wrapper also checks a device perm on the device first (two small launches the benchmark leaves out)
    checks = [entry for entry in launches if entry[0][0].co_name in ("zero_fill", "check_perm")]
    assert len(checks) == (2 if source == "gptq_perm" else 0)
    wrapper_launches = [entry for entry in launches if entry not in checks]
    launches.clear()
    out, launch = bench.repack_launch(kr, d_src, d_perm, bits, source, k, n, cuda.default_stream())
    _poisoned(out)
    launch()
    bench_launches = list(launches)

    assert wrapper_launches, "the wrapper launched nothing"
    assert bench_launches == wrapper_launches
    assert np.array_equal(out.copy_to_host().reshape(-1), np.asarray(got_wrapper.copy_to_host()).reshape(-1)
                          .view(np.uint32))


def test_the_recorder_sees_a_drifted_grid(bench, launches, rng):
    """The check itself can fail: the AWQ inverse on the other grid order is a different launch list."""
    k, n = 32, 128
    d_marlin = cuda.to_device(rng.integers(0, 2**32, (1, k // 16, n * 2), dtype=np.uint64).astype(np.uint32))
    kr.marlin_to_awq_qweight(d_marlin.reshape((k // 16, n * 2)), k, n, 4)
    wrapper_launches = list(launches)
    launches.clear()
    out = cuda.device_array(kr.unpack_shape("awq", k, n, 4, 1), np.uint32)
    policy = kr._policy
    nfast = not (policy.awq_unpack_n_fastest and kr.grid_n_fastest_fits(k))  # the grid order the wrapper did not use
    kernel = kr._awq_direct_unpack_kernel(4, policy.awq_unpack_wide_stores, policy.awq_unpack_transpose, nfast)
    grid = kr.awq_grid(k, n, 4, 1, 1, kr.DIRECT_THREADS, nfast)
    kernel[grid, kr.DIRECT_THREADS, cuda.default_stream()](d_marlin, out.view(np.uint64), n)
    assert launches != wrapper_launches
