"""kernels_cuda/hopper_gemm.cu (the wgmma family) builds offline for sm_90a with nvcc, with no warnings, no register
spills and no serialized wgmma pipeline, for every tile the default policy can choose and the 64-deep stages; the
host's shared-memory figure is the kernel's (a static_assert in the instantiating file). One nvcc run of five
instantiations: about 15 s on two cores."""
import re
import shutil
import subprocess

import pytest

from workbench import gemm
from workbench.gemm import hopper
from workbench.policy import DEFAULT_GEMM_POLICY
from workbench.scalar_types import ScalarType as S

# the default tiles, and one of 64-deep stages per warpgroup split (the policy's other stage length)
CONFIGS = sorted({hopper.choose_config(S.F16, S.U4B8, m, DEFAULT_GEMM_POLICY) for m in (32, 64, 128, 1024)}
                 | {hopper.WgmmaConfig(S.F16, S.U4B8, 64, False, 8, 64), hopper.WgmmaConfig(S.F16, S.U4B8, 128, True,
                                                                                            6, 64)},
                 key=lambda c: c.name_expression)


def test_nvcc_builds_every_default_tile_for_sm90a(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed on this machine")
    lines = [f'#include "{hopper.KERNEL_SOURCE}"']
    for i, cfg in enumerate(CONFIGS):
        tile = cfg.name_expression.replace("hopper_gemm<", "Tile<")
        lines.append(f"static_assert({tile}::kSmemBytes == {cfg.smem_bytes}, \"WgmmaConfig.smem_bytes\");")
    lines.append("const void* kInstances[] = {")
    lines += [f"  reinterpret_cast<const void*>(&{cfg.name_expression})," for cfg in CONFIGS]
    lines.append("};")
    (tmp_path / "instantiate.cu").write_text("\n".join(lines) + "\n")
    cmd = [nvcc, "-std=c++17", "-cubin", "-gencode", "arch=compute_90a,code=sm_90a", "-I", str(gemm.KERNEL_DIR),
           "-Werror", "all-warnings", "-Xptxas", "-v", "-o", str(tmp_path / "out.cubin"),
           str(tmp_path / "instantiate.cu")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "warning" not in log.lower(), log[-4000:]
    # ptxas says so (C7515 and kin) when it must serialize the wgmma pipeline: every wgmma waits for the one before
    assert "Potential Performance Loss" not in log, log[-4000:]
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", log)]
    assert len(spills) == len(CONFIGS) and max(spills) == 0, log[-4000:]
