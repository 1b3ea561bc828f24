"""workbench.cuda without a GPU: argument blocks, launch forms, streams and arrays of every framework, and the dense
GEMM's launch on another framework's arrays (tests/fake_device.py stands in for CuPy and the driver)."""
from __future__ import annotations

import ctypes
import subprocess
import sys

import numpy as np
import pytest

from fake_device import SMS, FakeArray, installed
from workbench import cuda as rt
from workbench import gemm


def test_import_needs_neither_torch_nor_cupy():
    code = ("import sys, workbench, workbench.gemm, workbench.moe, workbench.cuda, workbench.policy; "
            "assert 'torch' not in sys.modules and 'cupy' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_arg_block_table_points_at_each_parameter_in_order():
    block = rt.ArgBlock("pipiip")
    block.set([1 << 40, -3, 2 << 40, 7, 8, 3 << 40])
    table = (ctypes.c_void_p * 6).from_address(block.address)
    read = [ctypes.c_uint64.from_address(table[i]).value if k == "p" else ctypes.c_int32.from_address(table[i]).value
            for i, k in enumerate(block.kinds)]
    assert read == [1 << 40, -3, 2 << 40, 7, 8, 3 << 40]
    assert list(block.ptrs) == [1 << 40, 2 << 40, 3 << 40] and list(block.ints) == [-3, 7, 8]
    array, at = block.slot(4)
    array[at] = 99
    assert ctypes.c_int32.from_address(table[4]).value == 99
    with pytest.raises(ValueError, match="one 'p'"):
        rt.ArgBlock("px")
    with pytest.raises(ValueError, match="2 values for 6 parameters"):
        block.set([1, 2])


def test_arg_block_int64_slots_take_a_numba_argument_list_in_one_store():
    block = rt.ArgBlock("q" * 5)
    block.wides[:] = [0, 0, 6, 4, 1 << 40]  # meminfo, parent, nitems, itemsize, data: Numba's array fields
    table = (ctypes.c_void_p * 5).from_address(block.address)
    assert [ctypes.c_int64.from_address(table[i]).value for i in range(5)] == [0, 0, 6, 4, 1 << 40]
    mixed = rt.ArgBlock("pqi")
    mixed.set([1 << 41, -(1 << 40), 7])
    table = (ctypes.c_void_p * 3).from_address(mixed.address)
    assert (ctypes.c_uint64.from_address(table[0]).value, ctypes.c_int64.from_address(table[1]).value,
            ctypes.c_int32.from_address(table[2]).value) == (1 << 41, -(1 << 40), 7)


def test_launch_takes_three_dimensional_grids_and_blocks():
    pytest.importorskip("cuda.bindings.driver", reason="the launch configuration is cuda-python's")
    launch = rt.Launch(0x1234, (4, 5, 6), (32, 2), 0)
    config = launch._config
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (4, 5, 6)
    assert (config.blockDimX, config.blockDimY, config.blockDimZ) == (32, 2, 1)
    launch.set_grid((7, 8))
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (7, 8, 1) and launch.grid == (7, 8)


@pytest.mark.parametrize("programmatic, cluster, attrs", [(False, 1, 0), (True, 1, 1), (False, 2, 1), (True, 4, 2)])
def test_launch_forms_are_attributes_of_one_configuration(programmatic, cluster, attrs):
    pytest.importorskip("cuda.bindings.driver", reason="the launch configuration is cuda-python's")
    launch = rt.Launch(0x1234, 77, 256, 4096, programmatic=programmatic, cluster=cluster)
    config = launch._config
    assert launch.supported and config.numAttrs == attrs
    assert (config.gridDimX, config.blockDimX, config.sharedMemBytes) == (77, 256, 4096)
    launch.set_grid(12)
    assert config.gridDimX == 12 and launch.grid == 12


class _TorchLikeStream:
    cuda_stream = 0x7001


class _ProtocolStream:
    def __cuda_stream__(self):
        return (0, 0x7002)


class _NumbaLikeStream:
    handle = ctypes.c_void_p(0x7003)


class _CuPyLikeStream:
    ptr = 0x7004


def test_stream_handles_of_every_framework():
    assert rt.stream_handle(0x7000) == 0x7000 and rt.stream_handle(np.int64(5)) == 5
    assert rt.stream_handle(_TorchLikeStream()) == 0x7001
    assert rt.stream_handle(_ProtocolStream()) == 0x7002
    assert rt.stream_handle(_NumbaLikeStream()) == 0x7003
    assert rt.stream_handle(_CuPyLikeStream()) == 0x7004
    with pytest.raises(TypeError, match="stream must be None, an int handle"):
        rt.stream_handle("default")


class Foreign:
    """A device array of no framework the runtime knows: only ``__cuda_array_interface__`` (as Numba's)."""

    def __init__(self, like: FakeArray):
        self.like = like

    @property
    def __cuda_array_interface__(self):
        iface = dict(self.like.__cuda_array_interface__)
        iface["strides"] = None if self.like.flags["C_CONTIGUOUS"] else self.like.strides
        return iface

    @property
    def device(self):
        return self.like.device


def test_views_of_interface_arrays_read_like_cupy_arrays():
    x = FakeArray((4, 6), np.float16, device=1)
    v = rt.as_device_array(Foreign(x), "x")
    assert isinstance(v, rt.DeviceArray) and v.framework == "other" and rt.framework_of(v) == "other"
    assert (v.shape, v.strides, v.dtype, v.data.ptr, v.data.device_id) == ((4, 6), (12, 2), np.float16, x.data.ptr, 1)
    assert v.flags["C_CONTIGUOUS"] and v.size == 24 and v.nbytes == 48
    assert rt.device_pointer(Foreign(x), "x") == (x.data.ptr, 1)
    with pytest.raises(TypeError, match=r"w is not on GPU \(got numpy.ndarray"):
        rt.as_device_array(np.zeros(3), "w")


def test_torch_tensors_are_viewed_through_torch():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed here (the GPU tier runs it)")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch tensors")
    t = torch.zeros((3, 8), dtype=torch.bfloat16, device="cuda")
    v = rt.as_device_array(t, "t")
    assert v.framework == "torch" and v.shape == (3, 8) and v.strides == (16, 2) and v.dtype.name == "bfloat16"


def test_dense_gemm_on_interface_arrays_launches_what_cupy_arrays_launch():
    """Another framework's arrays go through views into the same checks and plan: the same kernel, grid, shared
    memory and scalars as CuPy arrays of the same layout; the output comes from the caller's framework's pool (CuPy's,
    for a framework without one) and the views' plan serves the next call."""
    k, n, m = 512, 256, 3
    with installed() as (fake, driver):
        arrays = dict(a=FakeArray((m, k), np.float16), b_q_weight=FakeArray((k // 16, n * 16 // 8), np.int32),
                      b_scales=FakeArray((k // 128, n), np.float16), b_zeros=None, g_idx=None, perm=None,
                      workspace=FakeArray((gemm.workspace_numel(SMS),), np.int32))
        scalars = dict(b_q_type="u4b8", size_m=m, size_n=n, size_k=k)
        out = gemm.gptq_marlin_gemm(**arrays, **scalars)
        foreign = {name: (Foreign(x) if x is not None else None) for name, x in arrays.items()}
        got = gemm.gptq_marlin_gemm(**foreign, **scalars)
        plans = len(gemm.api._array_plans)
        again = gemm.gptq_marlin_gemm(**foreign, **scalars)
        plans_again = len(gemm.api._array_plans)
    assert type(out) is FakeArray and type(got) is FakeArray and got.shape == (m, n)
    (f0, g0, b0, s0, st0, args0), (f1, g1, b1, s1, st1, args1), (_, _, _, _, _, args2) = driver.launches
    assert (f0, g0, b0, s0, st0) == (f1, g1, b1, s1, st1) and args0[8:] == args1[8:]
    assert args1[0] == foreign["a"].like.data.ptr and args1[2] == got.data.ptr and args2[2] == again.data.ptr
    assert plans == plans_again, "the views' plan serves the next call"


def test_torch_and_numpy_dtypes_map_both_ways_including_raw_bits():
    # bf16 scales travel to the layout kernels as uint16 bit patterns: the runtime must take that dtype from torch
    # and allocate it for torch callers (this missing entry failed the torch layout ops on a GPU)
    torch = pytest.importorskip("torch")
    import ml_dtypes
    from workbench.cuda.arrays import _torch_numpy_dtype, numpy_to_torch_dtype

    for np_dtype in (np.float16, ml_dtypes.bfloat16, np.float32, np.int32, np.uint16, np.uint8, np.int8):
        t = numpy_to_torch_dtype(np_dtype)
        assert torch.empty(0, dtype=t).element_size() == np.dtype(np_dtype).itemsize
        assert _torch_numpy_dtype(t) == np.dtype(np_dtype)
    with pytest.raises(TypeError, match="complex64"):
        numpy_to_torch_dtype(np.complex64)
