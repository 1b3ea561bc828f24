"""The native Marlin GEMM on a real GPU, against the fp32 NumPy reference ``a.astype(f32) @ q.w_ref``.

Order: identity activations (the output *is* the dequantized weight: exact), arange-coded weights (every output
names its code: exact), then random data over a vLLM-like grid, every reduction mode, determinism, streams, graphs.
Outputs are poisoned (NaN) before every launch so an unwritten element fails.
"""
import dataclasses

import ml_dtypes
import numpy as np
import pytest

from workbench import cuda as rt
from workbench import gemm, hardware
from workbench.policy import DEFAULT_GEMM_POLICY
from workbench.quantize import QuantizedWeight, dequantize
from workbench.scalar_types import ScalarType as S
from workbench.weight import make_marlin_weight, random_marlin_weight

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not hardware.cupy_available(), reason="no CUDA GPU visible to CuPy")]

cp = pytest.importorskip("cupy")
BF16 = np.dtype(ml_dtypes.bfloat16)
ACTS = (np.dtype(np.float16), BF16)
INT_TYPES = (S.U4B8, S.U4, S.U8B128, S.U8)
MODES = {  # name -> keyword arguments of marlin_gemm
    "fp32": dict(use_fp32_reduce=True),
    "in_c": dict(use_fp32_reduce=False),
    "atomic": dict(use_atomic_add=True, use_fp32_reduce=False),
    "deterministic": dict(use_fp32_reduce=True, deterministic=True),
}


def group_sizes(wt):
    return (-1, 128) if wt is S.FE4M3FN else (-1, 32, 64, 128)


def poisoned(m, n, dtype):
    return cp.full((m, n), np.nan, dtype=dtype)


def replay_in_graph(stream, launches, replays: int = 3) -> None:
    """Capture ``launches()`` on ``stream`` as one CUDA graph, replay it ``replays`` times and wait for it."""
    stream.begin_capture()
    launches()
    graph = stream.end_capture()
    for _ in range(replays):
        graph.launch(stream)
    stream.synchronize()


def run(a_host, w_dev, mode="fp32", sms=-1, **kw):
    """Upload a, launch into a poisoned C, return C on the host as float32 (and check the locks are left zero)."""
    a = cp.asarray(a_host)
    c = poisoned(a.shape[0], w_dev.size_n, a.dtype)
    out = gemm.marlin_gemm(a, w_dev, c=c, sms=sms, **MODES[mode], **kw)
    assert out is c
    device = a.device.id
    n_sms = gemm.device_properties(device)[1] if sms <= 0 else sms
    ws, _ = gemm.scratch_buffers(device, cp.cuda.get_current_stream().ptr, n_sms)
    assert int(cp.count_nonzero(ws)) == 0, "lock counters must be left zero for the next launch"
    return cp.asnumpy(out).astype(np.float32)


def error_bound(a, w_ref, act, mode, k):
    """Per-element bound for |C - ref|, ref = a @ w_ref in fp32 with exact fp32 products (fp16/bf16 x fp16/bf16):
    * one rounding of the output to the activation type: u * S, S = |a| @ |w| bounds every partial sum;
    * one rounding of each weight that the kernel does not make: with one m16 block it applies the scales to fp32
      partial sums (WarpLoop::kLateScale) where w_ref holds scale x (code - zero) rounded to the activation type: u S;
    * in-C / atomic reductions round each block's partial to the activation type before adding: up to one more
      rounding per contributing block — at most K/64 of them (a block holds >= 64 rows of K): (K/64) u S;
    * fp32 accumulation in the tensor cores (Hopper aligns products before adding, losing low bits): K 2^-22 S."""
    s = np.abs(a.astype(np.float32)) @ np.abs(w_ref)
    roundings = 1 + (k // 64 if mode in ("in_c", "atomic") else 0)
    return gemm.error_bound_factor(act, k, output_roundings=roundings) * s + 1e-30


# ------------------------------------------------------------------------------------------------------------------
# structured inputs: exact
# ------------------------------------------------------------------------------------------------------------------
IDENTITY_CASES = [(wt, gs, act_order, act) for act in ACTS for wt in INT_TYPES + (S.FE4M3FN,)
                  for gs in group_sizes(wt) for act_order in ((False, True) if gs > 0 and wt is not S.FE4M3FN
                                                              else (False,))]


@pytest.mark.parametrize("wt,gs,act_order,act", IDENTITY_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("mode", ["fp32", "in_c", "atomic"])
def test_identity_activations_give_the_dequantized_weight_exactly(wt, gs, act_order, act, mode):
    k, n = 256, 256
    mw, q = random_marlin_weight(k, n, wt, gs, act_order=act_order, act_dtype=act, seed=k + n + gs)
    w_dev = gemm.upload_weight(mw)
    a = np.eye(k, dtype=np.float32).astype(act)  # (K, K): C[i] = row i of the dequantized weight
    for k_full in ((True, False) if act_order else (True,)):
        out = run(a, w_dev, mode, is_k_full=k_full)
        # exact: each output is one product 1 * w (exact in fp32), the other partial sums are exact zeros, and w is
        # representable in the activation type
        np.testing.assert_array_equal(out, q.w_ref)


# (weight, group size, act-order shard: is_k_full False, the per-row group mode)
SWAP_CASES = [(S.U4B8, 128, False), (S.U4, 64, False), (S.U8B128, -1, False), (S.FE4M3FN, 128, False),
              (S.U8, 32, True)]


# The swapped loop (KernelConfig.swap, M <= 8): the rows checked, (M, first identity row).
SWAP_ROWS = ((8, 0), (8, 120), (1, 255), (5, 37))


@pytest.mark.parametrize("wt,gs,shard", SWAP_CASES, ids=str)
@pytest.mark.parametrize("act", ACTS, ids=str)
def test_identity_rows_exact_on_the_swapped_loop(wt, gs, shard, act):
    """M <= 8 runs the operand-swapped loop (KernelConfig.swap: C^T = W^T A^T, transposed back across lanes): rows
    i0 .. i0 + M - 1 of the identity must give exactly those rows of the dequantized weight, in every reduction mode
    (a wrong lane or register in the transpose moves a value: caught bit for bit)."""
    k, n = 256, 256
    mw, q = random_marlin_weight(k, n, wt, gs, act_order=shard, act_dtype=act, seed=k + n + gs + 8)
    w_dev = gemm.upload_weight(mw)
    assert gemm.config_for(gemm.act_scalar_type(act), wt, 8, n, k, gs, shard).swap == 1
    eye = np.eye(k, dtype=np.float32).astype(act)
    for m, i0 in SWAP_ROWS:
        for mode in ("fp32", "in_c", "atomic", "deterministic"):
            kw = dict(is_k_full=False) if shard else {}
            out = run(eye[i0:i0 + m], w_dev, mode, **kw)
            # exact: one product 1 * w per output, the rest exact zeros (as the full identity test above)
            np.testing.assert_array_equal(out, q.w_ref[i0:i0 + m], err_msg=f"M={m} rows from {i0}, {mode}")


# Row counts that leave padding rows in the block tile: one m16 chunk (the kernel copies rows < M only; the others
# keep whatever shared memory held, which no stored element reads), two and more chunks (padding rows zero-filled by
# their copies); (M, first identity row).
ROW_COUNTS = ((9, 3), (12, 100), (15, 241), (17, 0), (40, 77), (80, 160))
ROW_COUNT_CASES = ((S.U4B8, 128), (S.FE4M3FN, -1), (S.U4, 64))


@pytest.mark.parametrize("wt,gs", ROW_COUNT_CASES, ids=str)
def test_identity_rows_exact_for_row_counts_with_padding(wt, gs):
    """Rows i0 .. i0 + M - 1 of the identity give exactly those rows of the dequantized weight for M that do not
    fill the block tile: every real A row lands where the mma reads it, whichever copies the kernel makes."""
    k, n = 256, 256
    mw, q = random_marlin_weight(k, n, wt, gs, act_dtype=np.float16, seed=k + n + gs + 16)
    w_dev = gemm.upload_weight(mw)
    eye = np.eye(k, dtype=np.float32).astype(np.float16)
    for m, i0 in ROW_COUNTS:
        for mode in ("fp32", "in_c"):
            out = run(eye[i0:i0 + m], w_dev, mode)
            np.testing.assert_array_equal(out, q.w_ref[i0:i0 + m], err_msg=f"M={m} rows from {i0}, {mode}")


STALE_SMEM_SRC = r"""
extern "C" __global__ void fill_smem(unsigned int value, int words) {
  extern __shared__ unsigned int smem[];
  volatile unsigned int* s = smem;  // volatile: stores to shared memory that nothing reads are otherwise dead
  for (int i = threadIdx.x; i < words; i += blockDim.x) s[i] = value;
}
extern "C" __global__ void count_stale(unsigned int value, int words, unsigned long long* count) {
  extern __shared__ unsigned int smem[];
  volatile unsigned int* s = smem;
  unsigned long long mine = 0;
  for (int i = threadIdx.x; i < words; i += blockDim.x) mine += s[i] == value;
  atomicAdd(count, mine);
}
"""


def leave_nan_in_shared_memory(device: int) -> float:
    """Fill every SM's shared memory with 0xFFFF pairs (NaN in fp16 and in bf16) and return the fraction a later
    block finds still there when it reads its dynamic shared memory before writing it (nothing clears it between
    kernels, but nothing promises that either)."""
    _, sms, smem, _ = gemm.device_properties(device)
    module = cp.RawModule(code=STALE_SMEM_SRC)
    fill, count = module.get_function("fill_smem"), module.get_function("count_stale")
    for f in (fill, count):
        f.max_dynamic_shared_size_bytes = smem
    words, nan2 = smem // 4, np.uint32(0xFFFFFFFF)
    fill((4 * sms,), (1024,), (nan2, np.int32(words)), shared_mem=smem)
    found = cp.zeros(1, dtype=cp.uint64)
    count((sms,), (1024,), (nan2, np.int32(words), found), shared_mem=smem)
    fill((4 * sms,), (1024,), (nan2, np.int32(words)), shared_mem=smem)
    return int(found.get()[0]) / (sms * words)


@pytest.mark.parametrize("wt,gs", ROW_COUNT_CASES, ids=str)
@pytest.mark.parametrize("act", ACTS, ids=str)
def test_nan_left_in_shared_memory_does_not_reach_the_output(wt, gs, act):
    """The one-chunk kernels (M <= 16) do not zero the padding rows (M..15) of A's ring slots: row r of the product
    reads row r of A only and padding rows are never stored. So NaN left in shared memory by the kernel before must
    not reach C: identity rows still give the dequantized weight exactly, on a layer wide enough to use every SM."""
    k, n = 1024, 2048
    mw, q = random_marlin_weight(k, n, wt, gs, act_dtype=act, seed=k + n + gs + 31)
    w_dev = gemm.upload_weight(mw)
    eye = np.eye(k, dtype=np.float32).astype(act)
    for m, i0 in ((1, 5), (7, 300), (15, 1000)):
        stale = leave_nan_in_shared_memory(cp.cuda.Device().id)
        if stale < 0.5:
            pytest.skip(f"shared memory did not keep the filled words between kernels ({stale:.0%} found)")
        out = run(eye[i0:i0 + m], w_dev, "fp32")
        np.testing.assert_array_equal(out, q.w_ref[i0:i0 + m], err_msg=f"M={m} rows from {i0}")


def arange_coded_weight(k, n, wt, gs, act):
    """Codes walk through every value (FP8: every finite byte), scales 1, zero points a second walk."""
    levels = 1 << wt.bits
    codes = (np.arange(k * n, dtype=np.int64).reshape(k, n) * 7 + np.arange(n)) % levels
    ng = 1 if gs == -1 else k // gs
    if wt is S.FE4M3FN:
        codes[(codes & 0x7F) == 0x7F] = 0  # E4M3 has no infinities; 0x7F / 0xFF are NaN
        scales = np.ones((ng, n), dtype=np.float32)
    else:
        scales = np.ones((ng, n), dtype=act)
    codes = codes.astype(np.uint8)
    zeros = ((np.arange(ng * n).reshape(ng, n) * 5) % levels).astype(np.uint8) if wt.has_zero_points else None
    w_ref = dequantize(codes, scales, zeros, wt, gs, None, act)
    return QuantizedWeight(codes, scales, zeros, None, gs, wt, np.dtype(act), w_ref)


@pytest.mark.parametrize("wt", INT_TYPES + (S.FE4M3FN,), ids=str)
@pytest.mark.parametrize("act", ACTS, ids=str)
def test_arange_coded_weights_land_where_the_spec_says(wt, act):
    k, n = 128, 192
    for gs in group_sizes(wt):
        q = arange_coded_weight(k, n, wt, gs, act)
        w_dev = gemm.upload_weight(make_marlin_weight(q))
        out = run(np.eye(k, dtype=np.float32).astype(act), w_dev)
        np.testing.assert_array_equal(out, q.w_ref, err_msg=f"group_size={gs}")


# Kernels with one m16 block scale fp32 partial sums (KernelConfig.late_scale): against the unrounded weight they must
# hold the bound without the weight rounding (one output rounding + fp32 accumulation), swapped and rows layouts,
# grouped (with a group change inside a warp's stage at 32) and channelwise, with and without zero points (not FP8:
# its kernels scale every pair, which the general bound covers).
LATE_SCALE_CASES = [(S.U4B8, 128, np.float16, 1), (S.U4B8, 32, BF16, 5), (S.U4, 64, np.float16, 8),
                    (S.U8B128, 128, BF16, 12), (S.U8B128, -1, np.float16, 3), (S.U8, 32, np.float16, 16),
                    (S.U8, -1, np.float16, 16), (S.U4B8, -1, BF16, 9)]


@pytest.mark.parametrize("wt,gs,act,m", LATE_SCALE_CASES, ids=str)
def test_late_scaling_holds_the_bound_of_the_unrounded_weight(wt, gs, act, m):
    k, n = 1024, 256
    mw, q = random_marlin_weight(k, n, wt, gs, act_dtype=act, seed=k + gs + m)
    cfg = gemm.config_for(gemm.act_scalar_type(act), wt, m, n, k, gs, False)
    assert cfg.late_scale and bool(cfg.swap) == (m <= DEFAULT_GEMM_POLICY.swap_max_m), cfg
    w_exact = dequantize(q.codes, q.scales, q.zeros, wt, gs, None, act, rounded=False)
    a = (np.random.default_rng(m + gs).standard_normal((m, k), dtype=np.float32)).astype(act)
    out = run(a, gemm.upload_weight(mw))
    ref = a.astype(np.float64) @ w_exact
    s = np.abs(a.astype(np.float64)) @ np.abs(w_exact)
    bound = gemm.error_bound_factor(act, k, weight_rounding=False) * s + 1e-30  # no weight rounding to allow for
    assert np.all(np.abs(out - ref) <= bound), float(np.max(np.abs(out - ref) / bound))


# ------------------------------------------------------------------------------------------------------------------
# random data over a vLLM-like grid
# ------------------------------------------------------------------------------------------------------------------
K_VALUES = [128 * f for f in (1, 5, 8, 11)]
N_VALUES = [64 * f for f in (1, 4, 7, 13)]
M_VALUES = [1, 7, 16, 33, 64, 257]


def grid_variants():
    """Every (type, group size, act-order variant, dtype); K and N rotate across variants so that each value meets
    every type, and inside a variant every M runs with the reduction modes rotating (a full cross product would be
    ~30k launches)."""
    variants = []
    for act in ACTS:
        for wt in INT_TYPES + (S.FE4M3FN,):
            for gs in group_sizes(wt):
                orders = [(False, True)]
                if gs > 0 and wt is not S.FE4M3FN:
                    orders += [(True, True), (True, False)]  # (act_order, is_k_full)
                for ao, k_full in orders:
                    variants.append((wt, gs, ao, k_full, act))
    cases = []
    for i, (wt, gs, ao, k_full, act) in enumerate(variants):
        k = K_VALUES[i % len(K_VALUES)]
        n = N_VALUES[(i // len(K_VALUES)) % len(N_VALUES)]
        if ao and k <= gs:
            k = 128 * 5  # act-order needs more than one group (vLLM's tests drop G == K too)
        cases.append((i, wt, gs, ao, k_full, act, k, n))
    return cases


GRID = grid_variants()
SHARED_CASES = [(16, 128 * 11, 64), (33, 128 * 8, 256), (7, 128 * 11, 64), (32, 128 * 11, 64), (2, 128 * 11, 64)]


@pytest.fixture(scope="module", autouse=True)
def compile_everything_once():
    """Compile every instantiation the module needs up front, in parallel (each takes seconds in NVRTC)."""
    device = cp.cuda.Device().id
    wanted = []  # (act, weight, m, n, k, group size, per-row groups)
    for _, wt, gs, ao, k_full, act, k, n in GRID:
        wanted += [(act, wt, m, n, k, gs, ao and not k_full) for m in M_VALUES]
    for wt, gs, ao, act in IDENTITY_CASES:
        wanted += [(act, wt, 256, 256, 256, gs, ao and not kf) for kf in (False, True)]
    for act in ACTS:
        for wt in INT_TYPES + (S.FE4M3FN,):
            wanted += [(act, wt, 128, 192, 128, gs, False) for gs in group_sizes(wt)]
    wanted += [(np.float16, wt, m, n, k, 128, False) for m, k, n in SHARED_CASES for wt in (S.U4B8, S.U4)]
    wanted += [(act, wt, m, 256, 256, gs, shard) for wt, gs, shard in SWAP_CASES for act in ACTS for m in (1, 8)]
    wanted += [(np.float16, wt, m, 256, 256, gs, False) for wt, gs in ROW_COUNT_CASES for m, _ in ROW_COUNTS]
    configs = [gemm.config_for(gemm.act_scalar_type(act), wt, m, n, k, gs, per_row, device)
               for act, wt, m, n, k, gs, per_row in wanted]
    gemm.precompile(configs, device, workers=16)


@pytest.mark.parametrize("i,wt,gs,act_order,k_full,act,k,n", GRID, ids=lambda v: str(v))
def test_random_grid_matches_fp32_reference(i, wt, gs, act_order, k_full, act, k, n, rng):
    mw, q = random_marlin_weight(k, n, wt, gs, act_order=act_order, act_dtype=act,
                                 seed=int(rng.integers(1 << 30)))
    w_dev = gemm.upload_weight(dataclasses.replace(mw, is_k_full=k_full))
    modes = list(MODES)
    for j, m in enumerate(M_VALUES):
        mode = modes[(i + j) % len(modes)]
        a = rng.standard_normal((m, k), dtype=np.float32).astype(act)
        out = run(a, w_dev, mode)
        ref = a.astype(np.float32) @ q.w_ref
        bound = error_bound(a, q.w_ref, act, mode, k)
        excess = np.abs(out - ref) - bound
        where = f"M={m}, mode={mode}"
        assert np.all(np.isfinite(out)), f"{where}: unwritten (poisoned) or overflowing outputs"
        assert excess.max() <= 0, (f"{where}: worst excess {excess.max():.3g} at "
                                   f"{np.unravel_index(excess.argmax(), excess.shape)}")
        # vLLM's own criterion, for comparison with its tests (spec §9.1)
        assert np.mean(np.abs(out - ref)) / np.mean(np.abs(ref)) < 0.04, where


# ------------------------------------------------------------------------------------------------------------------
# reduction modes, determinism, streams, graphs, M edge cases
# ------------------------------------------------------------------------------------------------------------------
# ---- slice sums inside thread-block clusters (sm_90) -------------------------------------------------------------
# (weight, group size, act-order shard, act, M, K, N, sms, pair policy) -> (blocks per SM, blocks per cluster) the
# policy gives with every cluster size the kernel takes: slice-aligned grids with 2, 4 and 8 blocks per slice (pair
# policy off: the grids the policy gave before it), swapped (M <= 8) and row-layout loops, one and two blocks per SM,
# every weight type and group mode; then the pair policy's own choices (one block per SM, two per slice). (The bench
# layers run the default policy: test_gemm_bench_shapes.py.)
CLUSTER_CASES = (
    ((S.U4B8, 128, False, np.float16, 1, 1024, 256, 4, False), (1, 2)),
    ((S.U4B8, 128, False, np.float16, 1, 1024, 256, 8, False), (1, 4)),
    ((S.U4B8, 128, False, BF16, 16, 1024, 256, 8, False), (1, 4)),
    ((S.U4, 64, False, np.float16, 5, 2048, 128, 8, False), (1, 8)),
    ((S.U8B128, -1, False, BF16, 3, 1024, 256, 8, False), (1, 8)),
    ((S.FE4M3FN, 128, False, np.float16, 16, 1024, 512, 8, False), (1, 4)),
    ((S.FE4M3FN, -1, False, np.float16, 8, 2048, 128, 8, False), (1, 8)),
    ((S.U4B8, 32, True, np.float16, 9, 2048, 256, 8, False), (1, 4)),
    ((S.U4B8, 128, False, np.float16, 16, 4096, 512, 4, False), (2, 2)),
    ((S.U4, 128, False, BF16, 3, 4096, 512, 4, False), (2, 2)),
    ((S.U4B8, 128, False, np.float16, 1, 1024, 256, 8, True), (1, 2)),
    ((S.U8B128, -1, False, BF16, 3, 1024, 256, 8, True), (1, 2)),
    ((S.U4B8, 128, False, np.float16, 16, 4096, 512, 4, True), (1, 2)),
)


@pytest.mark.parametrize("case,expect", CLUSTER_CASES, ids=str)
def test_cluster_slice_sums_equal_the_global_fp32_sums_bit_for_bit(case, expect, monkeypatch):
    """On sm_90 a slice-aligned grid with 2, 4 or 8 blocks per slice (every size the kernel takes; the policy's
    CLUSTER_SIZES is a subset) runs as thread-block clusters whose blocks add their partials through distributed
    shared memory (gemm.cluster_blocks), in the fp32 reduction's order: the output must be bitwise the kernel's own
    global-memory sum (CLUSTER_SUMS off), within the fp32 bound of the reference, and the same in the deterministic
    mode; nothing may be left in the lock counters."""
    wt, gs, shard, act, m, k, n, sms, pairs = case
    if gemm.device_properties(cp.cuda.Device().id)[0] < 90:
        pytest.skip("thread-block clusters need sm_90")
    # (the cases were picked for the tiles without the 512 x 128 rows tile, which tests/gpu/
    # test_gemm_bench_shapes.py checks in clusters at full size); every cluster size the kernel takes
    clusters = dataclasses.replace(DEFAULT_GEMM_POLICY, pair_clusters=pairs, rows_wide_first=False, cluster_sums=True,
                                   cluster_sizes=gemm.KERNEL_CLUSTER_SIZES)
    global_sums = dataclasses.replace(clusters, cluster_sums=False)
    mw, q = random_marlin_weight(k, n, wt, gs, act_order=shard, act_dtype=act, seed=k + n + m + sms)
    w_dev = gemm.upload_weight(mw)
    a = np.random.default_rng(m + k).standard_normal((m, k), dtype=np.float32).astype(act)
    kw = dict(is_k_full=False) if shard else {}
    plan = gemm.plan_marlin_gemm(cp.asarray(a), w_dev, c=poisoned(m, n, act), sms=sms,
                                 workspace=cp.zeros(gemm.workspace_numel(sms), dtype=np.int32),
                                 c_tmp=cp.empty(gemm.c_tmp_numel(sms), dtype=np.float32), policy=clusters, **kw)
    assert (plan.cfg.blocks_per_sm, plan.cfg.cluster) == expect, plan.cfg
    assert plan.grid % plan.cfg.cluster == 0 and "marlin_gemm_cluster" in plan.cfg.name_expression
    clustered = run(a, w_dev, "fp32", sms=sms, policy=clusters, **kw)
    deterministic = run(a, w_dev, "deterministic", sms=sms, policy=clusters, **kw)
    global_sum = run(a, w_dev, "fp32", sms=sms, policy=global_sums, **kw)
    np.testing.assert_array_equal(clustered, global_sum)
    np.testing.assert_array_equal(deterministic, global_sum)
    ref = a.astype(np.float32) @ q.w_ref
    assert np.all(np.abs(clustered - ref) <= error_bound(a, q.w_ref, act, "fp32", k))


def shared_slices_case(act=np.float16, wt=S.U4B8, m=16, k=128 * 11, n=64, seed=0):
    """N = 64 and a long K: one output slice shared by every block (K/128 = 11 of them) — the reduction path."""
    mw, q = random_marlin_weight(k, n, wt, 128, act_dtype=act, seed=seed)
    a = np.random.default_rng(seed).standard_normal((m, k), dtype=np.float32).astype(act)
    return a, gemm.upload_weight(mw), q


@pytest.mark.parametrize("mode", ["fp32", "in_c", "deterministic"])
def test_lock_ordered_reductions_are_bitwise_reproducible(mode):
    a, w_dev, q = shared_slices_case()
    first = run(a, w_dev, mode)
    for _ in range(3):
        np.testing.assert_array_equal(run(a, w_dev, mode), first)


def test_deterministic_refuses_atomic_add():
    a, w_dev, _ = shared_slices_case()
    with pytest.raises(ValueError, match="deterministic"):
        gemm.marlin_gemm(cp.asarray(a), w_dev, use_atomic_add=True, deterministic=True)


@pytest.mark.parametrize("sms", [1, 3, 7, 64])
def test_every_partition_gives_the_same_answer_within_rounding(sms):
    a, w_dev, q = shared_slices_case(m=33, k=128 * 8, n=256)
    out = run(a, w_dev, "fp32", sms=sms)
    ref = a.astype(np.float32) @ q.w_ref
    assert np.all(np.abs(out - ref) <= error_bound(a, q.w_ref, np.float16, "fp32", a.shape[1]))


def test_explicit_stream_and_cuda_graph_capture():
    a_host, w_dev, q = shared_slices_case(m=7)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        a = cp.asarray(a_host)
        c = poisoned(a.shape[0], w_dev.size_n, a.dtype)
        sms = gemm.device_properties(a.device.id)[1]
        ws = cp.zeros(gemm.workspace_numel(sms), dtype=np.int32)
        ct = cp.empty(gemm.c_tmp_numel(sms), dtype=np.float32)
        gemm.marlin_gemm(a, w_dev, c=c, workspace=ws, c_tmp=ct, stream=stream)  # warm: compile outside capture
        c.fill(np.nan)
        replay_in_graph(stream, lambda: gemm.marlin_gemm(a, w_dev, c=c, workspace=ws, c_tmp=ct, stream=stream), 2)
    out = cp.asnumpy(c).astype(np.float32)
    ref = a_host.astype(np.float32) @ q.w_ref
    assert np.all(np.abs(out - ref) <= error_bound(a_host, q.w_ref, np.float16, "fp32", a_host.shape[1]))
    assert int(cp.count_nonzero(ws)) == 0


@pytest.mark.parametrize("programmatic", [False, True])
@pytest.mark.parametrize("sms,m", [(-1, 1), (6, 16), (5, 40)])
def test_back_to_back_launches_chain_and_share_a_workspace(sms, m, programmatic, rng, monkeypatch, request):
    """GEMM 2 reads GEMM 1's output as its activations, and both use one workspace (lock counters, fp32 slots),
    launched back to back on one stream without a sync, plain and captured in a CUDA graph; on sm_90 also as
    programmatic launches (GemmPolicy.programmatic_launch): each may start while the one before finishes and must wait
    before it reads A or touches the workspace. Every output equals the same GEMM run alone, bitwise. Few SMs: blocks
    share slices (slots and counts); M = 40: several 16-row chunks (the other prologue)."""
    device = cp.cuda.Device().id
    if programmatic and gemm.device_properties(device)[0] < 90:
        pytest.skip("programmatic dependent launch needs sm_90")
    policy = dataclasses.replace(DEFAULT_GEMM_POLICY, programmatic_launch=programmatic)
    if programmatic:
        assert rt.Launch(0, 4, 256, 0, programmatic=True).supported, "no cuLaunchKernelEx (cuda-python)"
    w1, _ = random_marlin_weight(1024, 512, S.U4B8, 128, act_dtype=np.float16, seed=int(rng.integers(1 << 20)))
    w2, _ = random_marlin_weight(512, 256, S.U8B128, 64, act_dtype=np.float16, seed=int(rng.integers(1 << 20)))
    w1, w2 = gemm.upload_weight(w1), gemm.upload_weight(w2)
    a = cp.asarray((rng.standard_normal((m, 1024)) * 0.5).astype(np.float16))
    n_sms = gemm.device_properties(device)[1] if sms <= 0 else sms
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        ws = cp.zeros(gemm.workspace_numel(n_sms), dtype=np.int32)
        ct = cp.empty(gemm.c_tmp_numel(n_sms), dtype=np.float32)
        c1_alone = gemm.marlin_gemm(a, w1, workspace=ws, c_tmp=ct, sms=sms, stream=stream, policy=policy)
        stream.synchronize()
        c2_alone = gemm.marlin_gemm(c1_alone, w2, workspace=ws, c_tmp=ct, sms=sms, stream=stream, policy=policy)
        stream.synchronize()
        c1, c2 = poisoned(m, 512, np.float16), poisoned(m, 256, np.float16)

        def chain():
            for _ in range(4):  # the second pair's GEMM 1 follows GEMM 2 of the first, and so on
                gemm.marlin_gemm(a, w1, c=c1, workspace=ws, c_tmp=ct, sms=sms, stream=stream, policy=policy)
                gemm.marlin_gemm(c1, w2, c=c2, workspace=ws, c_tmp=ct, sms=sms, stream=stream, policy=policy)

        chain()
        stream.synchronize()
        for got, alone in ((c1, c1_alone), (c2, c2_alone)):
            assert np.array_equal(cp.asnumpy(got).view(np.uint16), cp.asnumpy(alone).view(np.uint16))
        c1.fill(np.nan), c2.fill(np.nan)
        replay_in_graph(stream, chain)
    for got, alone in ((c1, c1_alone), (c2, c2_alone)):
        assert np.array_equal(cp.asnumpy(got).view(np.uint16), cp.asnumpy(alone).view(np.uint16)), "in the graph"
    assert int(cp.count_nonzero(ws)) == 0, "lock counters must be left zero"


def test_m_zero_returns_empty_output_without_launch():
    _, w_dev, _ = shared_slices_case()
    out = gemm.marlin_gemm(cp.empty((0, w_dev.size_k), dtype=np.float16), w_dev)
    assert out.shape == (0, w_dev.size_n)


def test_strided_activation_rows():
    """A row stride larger than K (a column slice of a wider buffer), as vLLM's subset test does."""
    a_wide, w_dev, q = shared_slices_case(m=32)
    k = a_wide.shape[1]
    wide = cp.asarray(np.concatenate([a_wide, a_wide[:, :64]], axis=1))
    view = wide[:, :k]
    c = poisoned(32, w_dev.size_n, np.float16)
    out = cp.asnumpy(gemm.marlin_gemm(view, w_dev, c=c)).astype(np.float32)
    ref = a_wide.astype(np.float32) @ q.w_ref
    assert np.all(np.abs(out - ref) <= error_bound(a_wide, q.w_ref, np.float16, "fp32", k))


def test_misaligned_activation_pointer_is_refused():
    a, w_dev, _ = shared_slices_case(m=2)
    buf = cp.asarray(np.concatenate([a.ravel(), a.ravel()[:8]]))
    shifted = buf[1:1 + a.size].reshape(a.shape)  # 2 bytes off a 16-byte boundary
    with pytest.raises(ValueError, match="aligned to 16 bytes"):
        gemm.marlin_gemm(shifted, w_dev)


def test_host_weight_is_refused_with_a_hint():
    mw, _ = random_marlin_weight(128, 64, S.U4B8, 128)
    with pytest.raises(TypeError, match="upload_weight"):
        gemm.marlin_gemm(cp.zeros((1, 128), dtype=np.float16), mw)


def test_gptq_marlin_gemm_matches_marlin_gemm():
    a_host, w_dev, q = shared_slices_case(m=7, wt=S.U4, seed=3)
    a = cp.asarray(a_host)
    sms = gemm.device_properties(a.device.id)[1]
    ws = cp.zeros(gemm.workspace_numel(sms), dtype=np.int32)
    c1 = gemm.gptq_marlin_gemm(a, w_dev.qweight, w_dev.scales, w_dev.zeros, None, None, ws, "u4", 7,
                               w_dev.size_n, w_dev.size_k)
    c2 = gemm.marlin_gemm(a, w_dev)
    np.testing.assert_array_equal(cp.asnumpy(c1), cp.asnumpy(c2))
