"""repack --backend numba (the Numba kernels: a real GPU, or the CUDA simulator in CI) writes the same bytes as the
NumPy path. Tiny shapes: the simulator runs one Python thread per CUDA thread."""
from __future__ import annotations

import numpy as np
import pytest

from workbench import hardware
from workbench.checkpoint import load, repack, verify
from workbench.checkpoint import synthetic as sy

pytestmark = pytest.mark.skipif(
    not (hardware.simulator_enabled() or hardware.gpu_available()),
    reason="needs the Numba kernels: a CUDA GPU or NUMBA_ENABLE_CUDASIM=1",
)

CASES = {
    "gptq-u4b8-actorder": sy.Options(fmt="gptq", bits=4, group_size=64, act_order=True),
    "ct-u4-channel": sy.Options(fmt="compressed-tensors", bits=4, group_size=-1, sym=False),
    "block-fp8": sy.Options(fmt="block-fp8"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_numba_backend_writes_the_numpy_bytes(case, tmp_path):
    from workbench import ops

    try:
        ops.marlin_permute_scales(np.ones((1, 64), np.float16), 16, 64, -1, backend="numba")
    except NotImplementedError as exc:
        pytest.skip(f"workbench.ops has no Numba backend yet: {exc}")
    opt = CASES[case]
    src = sy.random_model(str(tmp_path / "src"), opt, {"model.layers.0.mlp.up_proj": (128, 64)}, seed=3)
    messages = []
    repack(src, tmp_path / "numba", backend="numba", progress=False, log=messages.append)
    assert "Numba CUDA kernels" in messages[0]
    repack(src, tmp_path / "numpy", backend="numpy", progress=False, log=lambda m: None)
    assert verify(tmp_path / "numba", src, progress=False).ok
    a, b = load(tmp_path / "numba"), load(tmp_path / "numpy")
    for name in b:
        for field in ("qweight", "scales", "zeros", "g_idx", "perm"):
            x, y = getattr(a[name], field), getattr(b[name], field)
            assert (x is None) == (y is None), field
            assert x is None or np.array_equal(x.view(np.uint8), y.view(np.uint8)), field
