"""The Numba backend's contract: validation before any launch, clear errors, device arrays stay on the device."""
import numpy as np
import pytest
from numba import cuda

from kernels_numba import marlin_repack as kr
from workbench import backends, ops
from workbench.formats import packing


def test_every_dispatched_op_has_a_kernel():
    import importlib

    for op_name, (module, name) in backends.KERNELS.items():
        assert callable(getattr(importlib.import_module(f"kernels_numba.{module}"), name)), op_name


def test_unknown_backend_and_numpy_backend_with_device_array(rng):
    q = packing.pack_rows(rng.integers(0, 16, (16, 64), dtype=np.uint8), 4)
    with pytest.raises(ValueError, match="backend = 'cuda'"):
        ops.gptq_marlin_repack(q, None, 16, 64, 4, backend="cuda")
    with pytest.raises(TypeError, match="backend='numpy' was given a CUDA device array"):
        ops.gptq_marlin_repack(cuda.to_device(q), None, 16, 64, 4, backend="numpy")


@pytest.mark.parametrize("call, message", [
    # shapes that are not whole tiles are padded (test_numba_odd_shapes.py); what GPTQ rows cannot hold is refused
    (lambda q: ops.gptq_marlin_repack(q, None, 16, 0, 4, backend="numba"), "size_n = 0 must be positive"),
    (lambda q: ops.gptq_marlin_repack(q, None, 20, 64, 4, backend="numba"),
     "size_k = 20 is not a multiple of the pack factor 8"),
    (lambda q: ops.gptq_marlin_repack(q, None, 16, 64, 3, backend="numba"), "num_bits = 3"),
    (lambda q: ops.gptq_marlin_repack(q, None, 32, 64, 4, backend="numba"), "b_q_weight has shape"),
    (lambda q: ops.gptq_marlin_repack(q.astype(np.int64), None, 16, 64, 4, backend="numba"), "dtype"),
])
def test_bad_input_is_rejected_before_launch(call, message, rng):
    q = packing.pack_rows(rng.integers(0, 16, (16, 64), dtype=np.uint8), 4)
    with pytest.raises((ValueError, TypeError), match=message):
        call(q)


def test_kernel_wrapper_checks_shapes_itself(rng):
    """Called directly (no ops validation), a wrong shape is still an error, never an out-of-bounds read."""
    q = packing.pack_rows(rng.integers(0, 16, (32, 64), dtype=np.uint8), 4)
    with pytest.raises(ValueError, match=r"b_q_weight has shape \(4, 64\), expected \(2, 64\)"):
        kr.gptq_marlin_repack(q, None, 16, 64, 4)
    with pytest.raises(ValueError, match="perm has shape"):
        kr.gptq_marlin_repack(q, np.arange(16, dtype=np.int32), 32, 64, 4)


def test_a_perm_that_is_not_a_permutation_is_refused_before_launch(rng):
    """A repeated or out-of-range row index would make the kernel read out of bounds: refused, host or device."""
    q = packing.pack_rows(rng.integers(0, 16, (32, 64), dtype=np.uint8), 4)
    bad = rng.permutation(32).astype(np.int32)
    bad[int(rng.integers(0, 32))] = 32 + int(rng.integers(0, 1000))
    for perm in (bad, cuda.to_device(bad)):
        with pytest.raises(ValueError, match=r"perm is not a permutation of range\(32\)"):
            kr.gptq_marlin_repack(q, perm, 32, 64, 4)
        with pytest.raises(ValueError, match=r"perm is not a permutation of range\(32\)"):
            kr.marlin_to_gptq_qweight(kr.gptq_marlin_repack(q, None, 32, 64, 4), perm, 32, 64, 4)


def test_non_contiguous_device_array_is_a_clear_error(rng):
    q = packing.pack_rows(rng.integers(0, 16, (16, 128), dtype=np.uint8), 4)
    strided = cuda.to_device(q)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        kr.gptq_marlin_repack(strided, None, 16, 64, 4)


def test_numba_backend_without_a_gpu_falls_back_to_the_simulator(tmp_path):
    """backend='numba' on NumPy input in a fresh process with no simulator requested: the kernel still runs (on the
    GPU when there is one, else the process switches to the CUDA simulator before numba.cuda is imported)."""
    import os
    import subprocess
    import sys

    script = (
        "import numpy as np\n"
        "from workbench import ops, hardware\n"
        "from workbench.formats import packing\n"
        "rng = np.random.default_rng()\n"
        "q = packing.pack_rows(rng.integers(0, 16, (16, 64), dtype=np.uint8), 4)\n"
        "got = ops.gptq_marlin_repack(q, None, 16, 64, 4, backend='numba')\n"
        "assert np.array_equal(got, ops.gptq_marlin_repack(q, None, 16, 64, 4, backend='numpy'))\n"
        "print(hardware.describe())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "simulator" in result.stdout or "sm_" in result.stdout, result.stdout
