"""Every CUDA C++ source in kernels_cuda/ builds for sm_80 and sm_90, with nvcc and with NVRTC (the compiler CuPy
uses, driven here through cuda.core), with no warnings. Needs no GPU: both compilers only generate code.

The instantiations cover every weight type, both activation types, every N_TILES / K_WARP shape, M_BLOCKS 1..4,
several stage depths and every group mode (channelwise, grouped, per-row act-order shard); the template is the same for the rest.
"""
import dataclasses
import re

import pytest

from cuda_build import ARCHS, nvcc_cubin, nvrtc_cubin
from workbench import gemm
from workbench.scalar_types import ScalarType as S

CONFIGS = (
    gemm.KernelConfig(S.F16, S.U4B8, 1, 2, 4, 8, gemm.GROUP_GROUPED),
    gemm.KernelConfig(S.BF16, S.U4, 1, 2, 4, 4, gemm.GROUP_GROUPED, blocks_per_sm=2),
    # what M <= 16 runs on large layers (two blocks per SM, 3 stages): M = 9..16 (no swap) with the finishing inlined
    # (u4b8) or called (zero points, act-order), and M <= 8 with zero points
    gemm.KernelConfig(S.BF16, S.U4B8, 1, 2, 4, 3, gemm.GROUP_GROUPED, blocks_per_sm=2),
    gemm.KernelConfig(S.F16, S.U4B8, 1, 2, 4, 3, gemm.GROUP_PER_ROW, blocks_per_sm=2),
    gemm.KernelConfig(S.F16, S.U4, 1, 2, 4, 3, gemm.GROUP_GROUPED, blocks_per_sm=2),
    gemm.KernelConfig(S.BF16, S.U4, 1, 2, 4, 3, gemm.GROUP_GROUPED, blocks_per_sm=2, swap=True),
    gemm.KernelConfig(S.BF16, S.U4, 4, 4, 2, 4, gemm.GROUP_GROUPED),
    gemm.KernelConfig(S.F16, S.U8B128, 3, 1, 1, 4, gemm.GROUP_PER_ROW),
    gemm.KernelConfig(S.BF16, S.U8, 2, 2, 1, 8, gemm.GROUP_PER_ROW),
    gemm.KernelConfig(S.F16, S.U4, 1, 1, 1, 4, gemm.GROUP_CHANNELWISE, swap=True),
    gemm.KernelConfig(S.F16, S.FE4M3FN, 1, 2, 2, 6, gemm.GROUP_CHANNELWISE),
    gemm.KernelConfig(S.BF16, S.FE4M3FN, 4, 2, 2, 4, gemm.GROUP_GROUPED),
    # the operand-swapped loop (M <= 8): every group mode, both activation types, one and two blocks per SM, 8-bit
    # words
    gemm.KernelConfig(S.BF16, S.U4B8, 1, 2, 4, 4, gemm.GROUP_GROUPED, blocks_per_sm=2, swap=True),
    gemm.KernelConfig(S.F16, S.U8, 1, 1, 2, 6, gemm.GROUP_PER_ROW, swap=True),
    gemm.KernelConfig(S.BF16, S.FE4M3FN, 1, 2, 4, 8, gemm.GROUP_CHANNELWISE, swap=True),
    # every finishing strategy (marlin_gemm.cu Finish): the ring fold (two m16 blocks, out of line) and the split fold
    # (four m16 blocks over two k groups)
    gemm.KernelConfig(S.F16, S.U4B8, 2, 2, 2, 4, gemm.GROUP_GROUPED),
    gemm.KernelConfig(S.F16, S.U4B8, 4, 4, 2, 4, gemm.GROUP_GROUPED),
)
EXTRA_KERNELS = ("mwb::permute_cols<__half>", "mwb::permute_cols<__nv_bfloat16>")
# sm_90 only: kernels launched in thread-block clusters, slices summed in distributed shared memory (the host picks
# them on sm_90+ only, gemm.cluster_blocks): swapped and row layouts, one and two blocks per SM, 2 / 4 / 8 blocks.
CLUSTER_NAMES = [dataclasses.replace(c, cluster=s).name_expression for c, s in (
    (gemm.KernelConfig(S.F16, S.U4B8, 1, 2, 4, 6, gemm.GROUP_GROUPED, swap=True), 2),
    (gemm.KernelConfig(S.F16, S.U4B8, 1, 2, 4, 3, gemm.GROUP_GROUPED, blocks_per_sm=2, swap=True), 2),
    (gemm.KernelConfig(S.BF16, S.U4B8, 1, 2, 4, 3, gemm.GROUP_GROUPED, blocks_per_sm=2), 4),
    (gemm.KernelConfig(S.F16, S.U4, 1, 2, 4, 3, gemm.GROUP_GROUPED, blocks_per_sm=2, swap=True), 4),
    (gemm.KernelConfig(S.F16, S.U4B8, 1, 2, 4, 6, gemm.GROUP_PER_ROW), 4),
    (gemm.KernelConfig(S.BF16, S.FE4M3FN, 1, 4, 2, 4, gemm.GROUP_CHANNELWISE), 8),
    (gemm.KernelConfig(S.F16, S.U8B128, 1, 1, 1, 6, gemm.GROUP_GROUPED, swap=True), 8))]
NAMES = [c.name_expression for c in CONFIGS] + list(EXTRA_KERNELS)
# The batch-invariant kernels (marlin_gemm_invariant, marlin_gemm_cluster_invariant: never late-scaled; WALK: one
# launch over every 64-row chunk): what the mode runs on the bench layers, swapped and not, in a cluster, the walk.
INVARIANT_CONFIGS = (
    gemm.KernelConfig(S.F16, S.U4B8, 1, 4, 2, 6, gemm.GROUP_GROUPED, swap=True, invariant=True),
    gemm.KernelConfig(S.BF16, S.U4, 1, 4, 2, 6, gemm.GROUP_GROUPED, invariant=True),
    gemm.KernelConfig(S.F16, S.U4B8, 4, 4, 2, 4, gemm.GROUP_GROUPED, invariant=True, walk=True),
    gemm.KernelConfig(S.F16, S.FE4M3FN, 4, 4, 2, 4, gemm.GROUP_CHANNELWISE, invariant=True, walk=True),
    gemm.KernelConfig(S.F16, S.U8B128, 2, 4, 2, 8, gemm.GROUP_GROUPED, invariant=True),
    # merged stages (k_base): four stages of the 64 x 256 tile per pipeline stage, swapped and not
    gemm.KernelConfig(S.F16, S.U4B8, 1, 4, 8, 4, gemm.GROUP_GROUPED, swap=True, invariant=True, k_base=2),
    gemm.KernelConfig(S.BF16, S.U4, 1, 4, 8, 4, gemm.GROUP_CHANNELWISE, invariant=True, k_base=2),
)
INVARIANT_NAMES = [c.name_expression for c in INVARIANT_CONFIGS]
INVARIANT_CLUSTER_NAMES = [dataclasses.replace(INVARIANT_CONFIGS[i], cluster=2).name_expression for i in (0, 5)]


def test_every_cu_file_is_the_one_we_build():
    sources = sorted(p.name for p in gemm.KERNEL_DIR.glob("*.cu"))
    # marlin_moe.cu and hopper_gemm.cu have their own compile checks (tests/compile/test_moe_compile.py,
    # test_hopper_compile.py)
    from workbench.gemm import hopper

    assert sources == sorted([gemm.KERNEL_SOURCE, "marlin_moe.cu", hopper.KERNEL_SOURCE]), (
        f"a new .cu file needs a compile check: {sources}")


def test_kernel_source_inlines_its_headers():
    src = gemm.kernel_source()
    assert '#include "' not in src
    for header in gemm.KERNEL_DIR.glob("*.cuh"):
        assert header.read_text().splitlines()[0] in src, header.name


# Spill bytes ptxas reports per entry function that are known (arch, mangled-name fragment) -> bytes: the 64-row bf16
# kernel with zero points sits at the 255-register cap on sm_80 (none at sm_90, the H200's). The 128-register
# two-block kernels with zero points or act-order groups spill a little (docs/performance.md, "Open"); what these
# spills cost is not measured.
KNOWN_SPILLS = {(80, "marlin_gemmI13__nv_bfloat16Li4ELi4ELi4ELi2ELi4ELi1ELi1ELi0EE"): 8,
                (80, "marlin_gemmI6__halfLi4ELi1ELi2ELi4ELi3ELi1ELi2ELi0EE"): 64,
                (80, "marlin_gemmI6__halfLi5ELi1ELi2ELi4ELi3ELi2ELi2ELi0EE"): 28,
                (90, "marlin_gemmI6__halfLi5ELi1ELi2ELi4ELi3ELi2ELi2ELi0EE"): 48,
                (80, "marlin_gemmI13__nv_bfloat16Li4ELi1ELi2ELi4ELi3ELi1ELi2ELi1EE"): 8,
                # the chunk-walking u4b8 kernel sits at the cap beside the 64-row loop's accumulators (nvcc 13)
                (80, "marlin_gemm_invariantI6__halfLi4ELi4ELi4ELi2ELi4ELi1ELi1ELi0ELi1EE"): 16,
                (90, "marlin_gemm_invariantI6__halfLi4ELi4ELi4ELi2ELi4ELi1ELi1ELi0ELi1EE"): 8}


def spills_per_function(log: str) -> dict[str, int]:
    """Spill-store bytes of every entry function in an `-Xptxas -v` log."""
    spills, function = {}, None
    for line in log.splitlines():
        entry = re.search(r"Compiling entry function '(\S+)'", line)
        if entry:
            function = entry.group(1)
        stores = re.search(r"(\d+) bytes spill stores", line)
        if stores and function is not None:
            spills[function] = max(spills.get(function, 0), int(stores.group(1)))
    return spills


@pytest.mark.parametrize("arch", ARCHS)
def test_nvcc_builds_cubin_without_warnings_or_new_spills(arch, tmp_path):
    """No warnings, and no spills beyond KNOWN_SPILLS (a spill in the hot loop costs more than any instruction cut)."""
    spills = spills_per_function(nvcc_cubin(gemm.KERNEL_SOURCE, NAMES, arch, tmp_path))
    assert any(name.startswith("_ZN3mwb11marlin_gemm") for name in spills), "the log lists no GEMM entry function"
    for name, nbytes in spills.items():
        allowed = max([b for (a, fragment), b in KNOWN_SPILLS.items() if a == arch and fragment in name], default=0)
        assert nbytes <= allowed, f"sm_{arch}: {name} spills {nbytes} bytes (allowed {allowed})"


@pytest.mark.parametrize("arch", ARCHS)
def test_nvrtc_builds_cubin_without_warnings(arch):
    nvrtc_cubin(gemm.kernel_source(), NAMES, arch)


def test_cluster_kernels_build_for_sm90_without_warnings_or_spills(tmp_path):
    spills = spills_per_function(nvcc_cubin(gemm.KERNEL_SOURCE, CLUSTER_NAMES, 90, tmp_path))
    assert sum(name.startswith("_ZN3mwb19marlin_gemm_cluster") for name in spills) == len(CLUSTER_NAMES), spills
    assert not any(spills.values()), spills
    nvrtc_cubin(gemm.kernel_source(), CLUSTER_NAMES, 90)


@pytest.mark.parametrize("arch", ARCHS)
def test_invariant_kernels_build_without_warnings_or_new_spills(arch, tmp_path):
    """The batch-invariant kernels with nvcc (spills within KNOWN_SPILLS) and NVRTC; the cluster form on sm_90."""
    names = INVARIANT_NAMES + (INVARIANT_CLUSTER_NAMES if arch >= 90 else [])
    spills = spills_per_function(nvcc_cubin(gemm.KERNEL_SOURCE, names, arch, tmp_path))
    assert sum("marlin_gemm" in name and "invariant" in name for name in spills) == len(names), spills
    for name, nbytes in spills.items():
        allowed = max([b for (a, fragment), b in KNOWN_SPILLS.items() if a == arch and fragment in name], default=0)
        assert nbytes <= allowed, f"sm_{arch}: {name} spills {nbytes} bytes (allowed {allowed})"
    nvrtc_cubin(gemm.kernel_source(), names, arch)


def test_invariant_kernels_never_late_scale():
    """GemmTraits<..., LATE_OFF = true>::kLateScale (the invariant kernels) is false where the default kernel of the
    same shape late-scales, as KernelConfig.late_scale says of each: NVRTC evaluates the asserts."""
    checks = []
    for cfg in (gemm.KernelConfig(S.F16, S.U4B8, 1, 4, 2, 6, gemm.GROUP_GROUPED, swap=True),
                gemm.KernelConfig(S.BF16, S.U4, 1, 2, 4, 3, gemm.GROUP_CHANNELWISE),
                gemm.KernelConfig(S.F16, S.U8B128, 1, 4, 2, 4, gemm.GROUP_GROUPED)):
        t = "__half" if cfg.act is S.F16 else "__nv_bfloat16"
        for invariant in (False, True):
            c = dataclasses.replace(cfg, invariant=invariant)
            traits = (f"mwb::GemmTraits<{t}, {c.weight.abi_code}, 1, {c.n_tiles}, {c.k_warp}, {c.stages}, "
                      f"{c.group_mode}, 1, {int(c.swap)}, 1, {str(invariant).lower()}>")
            checks.append(f'static_assert({traits}::kLateScale == {str(c.late_scale).lower()}, "{c}");')
            assert c.late_scale is not invariant
    nvrtc_cubin(gemm.kernel_source() + "\n" + "\n".join(checks) + "\n", list(EXTRA_KERNELS), 90)


def test_shared_memory_of_every_config_fits_sm80():
    """sm_80 allows 163 KiB of opt-in shared memory per block; choose_config must never pick more."""
    for act in (S.F16, S.BF16):
        for weight in gemm.GEMM_WEIGHT_TYPES:
            for m in (1, 17, 33, 64, 300):
                for per_row in (False, True):
                    cfg = gemm.choose_config(act, weight, m, 1024, 1024, 128, per_row, 163 * 1024)
                    assert cfg.smem_bytes <= 163 * 1024


def test_python_late_scale_mirrors_the_kernels_rule():
    """KernelConfig.late_scale (which kernels scale fp32 partial sums, so whose bits differ from scaling each weight)
    equals WarpLoop::kLateScale with late_scale_pays, as both kernels instantiate it: NVRTC evaluates the asserts."""
    checks = []
    for act in (S.F16, S.BF16):
        for weight in gemm.GEMM_WEIGHT_TYPES:
            for n_tiles, k_warp in gemm.thread_shapes():
                for m_blocks, bps, swap in ((1, 1, False), (1, 1, True), (1, 2, False), (1, 2, True), (2, 1, False)):
                    for group_mode in (gemm.GROUP_CHANNELWISE, gemm.GROUP_GROUPED, gemm.GROUP_PER_ROW):
                        cfg = gemm.KernelConfig(act, weight, m_blocks, n_tiles, k_warp, 3, group_mode,
                                                blocks_per_sm=bps, swap=swap)
                        t = "__half" if act is S.F16 else "__nv_bfloat16"
                        sw = str(swap).lower()
                        loop = (f"mwb::WarpLoop<{t}, {weight.abi_code}, {m_blocks}, {n_tiles}, {k_warp}, 3, "
                                f"{group_mode}, {sw}, mwb::late_scale_pays<{bps}, {sw}, {k_warp}>()>")
                        checks.append(f'static_assert({loop}::kLateScale == {str(cfg.late_scale).lower()}, "{cfg}");')
    nvrtc_cubin(gemm.kernel_source() + "\n" + "\n".join(checks) + "\n", list(EXTRA_KERNELS), 90)


def test_python_shared_memory_mirrors_the_kernels_geometry():
    """TileGeometry.smem_bytes (what the host passes as dynamic shared memory) equals Geometry::kSmemBytes for every
    tile shape, m16 block count, weight type and group mode: NVRTC evaluates the static_asserts."""
    checks = []
    for act in (S.F16, S.BF16):
        for weight in gemm.GEMM_WEIGHT_TYPES:
            for n_tiles, k_warp in gemm.thread_shapes():
                for m_blocks in (1, 2, 4):
                    for group_mode in (gemm.GROUP_CHANNELWISE, gemm.GROUP_GROUPED, gemm.GROUP_PER_ROW):
                        cfg = gemm.KernelConfig(act, weight, m_blocks, n_tiles, k_warp, 3, group_mode)
                        t = "__half" if act is S.F16 else "__nv_bfloat16"
                        geometry = (f"mwb::Geometry<{t}, {weight.abi_code}, {m_blocks}, {n_tiles}, {k_warp}, 3, "
                                    f"{group_mode}>")
                        checks.append(f'static_assert({geometry}::kSmemBytes == {cfg.smem_bytes}, "{geometry}");')
    nvrtc_cubin(gemm.kernel_source() + "\n" + "\n".join(checks) + "\n", list(EXTRA_KERNELS), 90)
