"""kernels_cuda/hopper_gemm.cu (the wgmma family) builds offline for sm_90a with nvcc, with no warnings, no register
spills and no serialized wgmma pipeline, for every tile the default policy can choose; the host's shared-memory
figure is the kernel's (a static_assert in the instantiating file); and the host-side choices (tile, grid, family,
refusals) need no GPU. One nvcc run of three instantiations: a few seconds."""
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


def test_tile_and_grid_choice():
    p = DEFAULT_GEMM_POLICY
    assert hopper.choose_config(S.F16, S.U4B8, 32, p).block_m == 32
    assert hopper.choose_config(S.F16, S.U4B8, 33, p).block_m == 64
    big = hopper.choose_config(S.F16, S.U4B8, 1000, p)
    assert big.block_m == 128 and big.split_m
    # 16 column blocks of a 4096-wide layer: K split 8 ways fills 128 of 132 SMs; a 28672-wide one needs no split
    assert hopper.grid(64, 4096, 4096, 64, 132, p) == (16, 1, 8)
    assert hopper.grid(64, 28672, 8192, 64, 132, p) == (112, 1, 1)
    # each split keeps at least wgmma_min_split_stages k steps of 64, in whole stages
    assert hopper.grid(32, 256, 512, 32, 132, p) == (1, 1, 2)
    assert hopper.grid(32, 256, 1024, 32, 132, p, stage_k=128) == (1, 1, 4)
    assert hopper.grid(32, 256, 512, 32, 132, p, stage_k=128) == (1, 1, 2)
    assert hopper.grid(1024, 4096, 4096, 128, 132, p) == (16, 8, 1)


def test_family_choice_and_refusals():
    assert hopper.choose_family(0, 64) == "mma_sync"  # the default table is empty: no device query
    with pytest.raises(ValueError, match=r"family = 'mma': one of mma_sync, wgmma"):
        hopper.choose_family(0, 64, family="mma")
    ok = dict(act=S.F16, weight=S.U4B8, size_n=4096, size_k=4096, group_size=128, act_order=False, lda=4096, cc=90)
    assert hopper.unsupported(**ok) is None
    for change, words in ((dict(cc=80), "compute capability 9.0); this one is 8.0"),
                          (dict(weight=S.U4), "u4b8 weights so far, not u4"),
                          (dict(act=S.BF16), "fp16 activations so far"),
                          (dict(act_order=True), "no act-order"),
                          (dict(group_size=-1), "groups of 64 or 128 rows, not -1"),
                          (dict(size_n=4096 + 64), "multiple of 256, got 4160"),
                          (dict(size_k=4096 + 64), "size_k a multiple of 128, got 4160"),
                          (dict(lda=4100), "multiple of 8 elements, got 4100")):
        assert words in hopper.unsupported(**{**ok, **change})
