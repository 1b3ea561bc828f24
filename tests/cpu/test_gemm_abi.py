"""The GEMM launch ABI (the seed's FerrumMarlinLaunch) and every validation rule, without a GPU.

Validation runs on NumPy stand-ins: shapes and dtypes are checked before anything asks where the memory lives, so
every shape error is reachable here; the last check of a well-formed NumPy call is "A is not on GPU".
"""
import ctypes

import ml_dtypes
import numpy as np
import pytest

from workbench import gemm, gemm_abi
from workbench.policy import DEFAULT_GEMM_POLICY
from workbench.gemm_abi import MarlinLaunch, MarlinMmBuffers, MarlinMmExecution, MarlinMmProblem, MarlinMmRequest
from workbench.scalar_types import ScalarType as S

SM90 = dict(compute_capability=90, device_sms=132, smem_limit=227 * 1024)


# ---- layout (seed: marlin_launch_ffi_layout_and_weight_types_are_stable) ------------------------------------------
def test_launch_record_is_184_bytes_aligned_8():
    assert ctypes.sizeof(MarlinLaunch) == 184
    assert ctypes.alignment(MarlinLaunch) == 8


def test_launch_record_field_offsets_follow_repr_c():
    """repr(C): two u32, 14 pointers at 8..119, then 14 i32 and 2 u32 from 120 on, no padding."""
    names = [f[0] for f in MarlinLaunch._fields_]
    offsets = {name: getattr(MarlinLaunch, name).offset for name in names}
    assert offsets["abi_version"] == 0 and offsets["struct_size"] == 4
    pointers = names[2:16]
    assert [offsets[p] for p in pointers] == [8 + 8 * i for i in range(14)]
    scalars = names[16:]
    assert [offsets[s] for s in scalars] == [120 + 4 * i for i in range(len(scalars))]
    assert 120 + 4 * len(scalars) == 184


def test_scalar_and_flag_codes_are_the_seeds():
    assert (S.F16.abi_code, S.U4.abi_code, S.U4B8.abi_code, S.FE4M3FN.abi_code) == (1, 4, 5, 8)
    assert gemm_abi.ABI_VERSION == 1
    assert (gemm_abi.FLAG_HAS_ACT_ORDER, gemm_abi.FLAG_IS_K_FULL, gemm_abi.FLAG_HAS_ZERO_POINTS,
            gemm_abi.FLAG_USE_ATOMIC_ADD, gemm_abi.FLAG_USE_FP32_REDUCE) == (2, 4, 8, 16, 32)


# ---- request mapping (seed: typed_marlin_request_maps_to_versioned_ffi) ------------------------------------------
def seed_request(**overrides):
    buffers = MarlinMmBuffers(a=1, b=2, c=3, c_tmp=4, a_scales=5, b_scales=6, zero_points=20, group_index=7,
                              permutation=8, a_tmp=9, workspace=10)
    problem = MarlinMmProblem(m=11, n=12, k=13, lda=14, num_groups=15, group_size=16)
    execution = MarlinMmExecution(device=17, stream=18, sms=19, has_act_order=True, is_k_full=True,
                                  use_atomic_add=True, use_fp32_reduce=True)
    args = dict(weight_type=S.U4, buffers=buffers, problem=problem, execution=execution)
    args.update(overrides)
    return MarlinMmRequest(**args)


def test_typed_request_maps_to_versioned_record():
    request = seed_request()
    launch = request.into_launch()
    for name in ("a", "b", "c", "c_tmp", "a_scales", "b_scales", "zero_points", "group_index", "permutation",
                 "a_tmp", "workspace"):
        assert launch.pointer(name) == getattr(request.buffers, name), name
    assert launch.pointer("stream") == 18
    assert (launch.prob_m, launch.prob_n, launch.prob_k, launch.lda) == (11, 12, 13, 14)
    assert (launch.num_groups, launch.group_size, launch.device, launch.sms) == (15, 16, 17, 19)
    assert (launch.abi_version, launch.struct_size) == (1, 184)
    assert (launch.a_type, launch.b_type, launch.c_type, launch.scale_type) == (1, 4, 1, 1)
    assert (launch.thread_k_init, launch.thread_n_init, launch.reserved) == (-1, -1, 0)
    assert launch.pointer("b_bias") == 0 and launch.pointer("global_scale") == 0
    assert launch.flags == (gemm_abi.FLAG_HAS_ACT_ORDER | gemm_abi.FLAG_IS_K_FULL | gemm_abi.FLAG_HAS_ZERO_POINTS
                            | gemm_abi.FLAG_USE_ATOMIC_ADD | gemm_abi.FLAG_USE_FP32_REDUCE)


def test_fp8_request_has_no_act_order_or_zero_point_flags():
    base = seed_request()
    fp8 = seed_request(
        weight_type=S.FE4M3FN,
        buffers=MarlinMmBuffers(**{**base.buffers.__dict__, "zero_points": 0}),
        problem=MarlinMmProblem(m=1, n=128, k=256, lda=256, num_groups=2, group_size=128),
        execution=MarlinMmExecution(**{**base.execution.__dict__, "has_act_order": False}),
    ).into_launch()
    assert fp8.b_type == 8 and fp8.num_groups == 2 and fp8.group_size == 128
    assert fp8.flags & (gemm_abi.FLAG_HAS_ACT_ORDER | gemm_abi.FLAG_HAS_ZERO_POINTS) == 0


def test_bf16_activations_set_a_c_and_scale_types():
    launch = seed_request(act_type=S.BF16).into_launch()
    assert (launch.a_type, launch.c_type, launch.scale_type) == (2, 2, 2)


def test_deterministic_flag_is_ours_and_separate():
    ex = MarlinMmExecution(deterministic=True, use_fp32_reduce=False, is_k_full=False)
    launch = seed_request(execution=ex, buffers=MarlinMmBuffers(a=16, b=32, c=48)).into_launch()
    assert launch.flags == gemm_abi.FLAG_DETERMINISTIC


def test_request_rejects_non_marlin_types():
    with pytest.raises(ValueError, match="weight_type"):
        seed_request(weight_type=S.F16).into_launch()
    with pytest.raises(ValueError, match="act_type"):
        seed_request(act_type=S.U4).into_launch()


# ---- record-level checks ---------------------------------------------------------------------------------------
def good_record(**changes):
    """A valid u4b8 g128 record (aligned fake addresses); `changes` edit fields of the ctypes struct."""
    req = MarlinMmRequest(
        weight_type=S.U4B8,
        buffers=MarlinMmBuffers(a=0x1000, b=0x2000, c=0x3000, c_tmp=0x4000, b_scales=0x5000, workspace=0x6000),
        problem=MarlinMmProblem(m=16, n=256, k=512, lda=512, num_groups=4, group_size=128),
        execution=MarlinMmExecution(sms=132))
    launch = req.into_launch()
    for name, value in changes.items():
        setattr(launch, name, value)
    return launch


def check(launch):
    return gemm.check_launch(launch, **SM90)


def test_records_of_shapes_that_are_not_tile_multiples_are_accepted():
    """The storage rule (docs/formats.md, "Shapes that are not tile multiples"): any N, K a multiple of the pack
    factor, a partial last group (K = 520, group 128: ceil(520 / 128) = 5 groups); the plan tiles the padded width."""
    for changes in (dict(prob_n=96), dict(prob_n=7392), dict(prob_n=97),
                    dict(prob_k=520, lda=520, num_groups=5, group_size=128),
                    dict(prob_k=10944, lda=10944, num_groups=86, group_size=128)):
        cfg, _, grid = check(good_record(**changes))
        n = changes.get("prob_n", 256)
        assert gemm.tiled_n(n) % cfg.block_n == 0 and grid >= 1, changes


def test_good_record_picks_a_config():
    cfg, sms, grid = check(good_record())
    assert (cfg.block_k, cfg.block_n) in gemm.thread_shapes().values()
    assert sms == 132 and 1 <= grid <= 132


@pytest.mark.parametrize("changes,message", [
    (dict(abi_version=2), "abi_version = 2"),
    (dict(struct_size=176), "struct_size = 176"),
    (dict(flags=1 << 9), "unknown bits"),
    (dict(a_type=4), "a_type = 4"),
    (dict(c_type=2), "c_type = 2"),
    (dict(b_type=1), "b_type = 1"),
    (dict(prob_m=-1), r"Invalid MNK = \[-1, 256, 512\]"),
    (dict(prob_k=516, lda=520), "size_k = 516 is not a multiple of the pack factor 8 of u4b8 weights"),
    (dict(prob_k=520, lda=520), r"520 / 4 = 130 is not one of"),
    (dict(lda=500), "lda = 500"),
    (dict(flags=gemm_abi.FLAG_HAS_ZERO_POINTS | gemm_abi.FLAG_USE_FP32_REDUCE), "HAS_ZERO_POINTS flag = True"),
    (dict(b_type=4), "b_type must be u4b8, u8b128 or fe4m3fn when has_zp = False. Got = u4"),
    (dict(flags=gemm_abi.FLAG_HAS_ACT_ORDER | gemm_abi.FLAG_USE_FP32_REDUCE), "HAS_ACT_ORDER flag = True"),
    (dict(num_groups=3), "num_groups = 3 does not split size_k = 512 into groups"),
    (dict(num_groups=8, group_size=128), "group_size = 128 does not give num_groups = 8 groups over size_k = 512"),
    (dict(num_groups=32, group_size=16), r"group size = size_k / num_groups = 512 / 32 = 16 is not one of \(32, 64, 128\)"),
    (dict(num_groups=1, group_size=128), "group_size = 128 with num_groups = 1"),
    (dict(b_type=8, num_groups=8, group_size=64), "fe4m3fn weights take channelwise or group-128"),
    (dict(flags=gemm_abi.FLAG_USE_ATOMIC_ADD | gemm_abi.FLAG_DETERMINISTIC), "cannot be deterministic"),
    (dict(a=None), "a is null"),
    (dict(workspace=None), "workspace is null"),
    (dict(c_tmp=None), "use_fp32_reduce needs c_tmp"),
    (dict(a=0x1008), r"a must be aligned to 16 bytes \(address 0x1008 % 16 = 8\)"),
    (dict(b_scales=0x5002), "b_scales must be aligned to 16 bytes"),
    (dict(sms=200), "sms = 200 exceeds the device's 132 SMs"),
    (dict(a_scales=0x7000), "a_scales is not supported"),
])
def test_bad_records_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        check(good_record(**changes))


def test_record_type_is_checked():
    with pytest.raises(TypeError, match="MarlinLaunch"):
        gemm.check_launch(object(), **SM90)


def test_old_gpus_are_refused():
    with pytest.raises(ValueError, match="sm_80 or newer; device 0 is sm_75"):
        gemm.check_launch(good_record(), compute_capability=75, device_sms=40, smem_limit=64 * 1024)


def test_act_order_record_needs_tmp_and_more_than_one_group():
    flags = gemm_abi.FLAG_HAS_ACT_ORDER | gemm_abi.FLAG_IS_K_FULL | gemm_abi.FLAG_USE_FP32_REDUCE
    with pytest.raises(ValueError, match="a_tmp"):
        check(good_record(flags=flags, group_index=0x7000, permutation=0x8000))
    with pytest.raises(ValueError, match="For act_order, num_groups must be > 1"):
        check(good_record(flags=flags, group_index=0x7000, permutation=0x8000, a_tmp=0x9000, num_groups=1,
                          group_size=-1))
    cfg, _, _ = check(good_record(flags=flags & ~gemm_abi.FLAG_IS_K_FULL, group_index=0x7000, permutation=0x8000,
                                  a_tmp=0x9000))
    assert cfg.per_row_groups


# ---- configurations --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k,n", [(128, 64), (128 * 11, 64 * 13), (4096, 14336), (128 * 5, 64 * 7)])
def test_k_multiple_of_128_and_n_multiple_of_64_always_has_a_config(k, n):
    for m in (1, 33, 257):
        cfg = gemm.choose_config(S.F16, S.U4B8, m, n, k, 128, False, 163 * 1024)
        assert k % cfg.block_k == 0 and n % cfg.block_n == 0


def test_odd_multiples_of_64_plan_a_tile_whose_last_step_runs_past_k():
    """(192, 192) has no tile dividing both (N = 3 tiles: 64 wide only, K = 192: no 64 x 64 tile): the last resort
    plans K as 256 (one 256-row step, its last 64 rows past K: clamped weight rows, zero-filled A)."""
    cfg = gemm.choose_config(S.F16, S.U4B8, 1, 192, 192, -1, False, 163 * 1024)
    assert cfg.block_n == 64 and gemm.k_steps(192, cfg.block_k) * cfg.block_k >= 192
    with pytest.raises(ValueError, match=r"Invalid thread config: .* \(size_k, size_n\) = \(192, 192\)"):
        gemm.choose_config(S.F16, S.U4B8, 1, 192, 192, -1, False, 16 * 1024)


def test_grid_never_exceeds_sms_or_work():
    cfg = gemm.choose_config(S.F16, S.U4B8, 1, 64, 128, 128, False, 227 * 1024)
    assert gemm.grid_blocks(cfg, 1, 64, 128, 132) == 1
    cfg = gemm.choose_config(S.F16, S.U4B8, 1, 8192, 8192, 128, False, 227 * 1024)
    assert gemm.grid_blocks(cfg, 1, 8192, 8192, 132) == 128  # 64 slices x 2 blocks: slice-aligned, 16 steps each


@pytest.mark.parametrize("sms", [1, 3, 7, 64, 132])
@pytest.mark.parametrize("m, n, k", [(1, 4096, 4096), (1, 4096, 14336), (16, 8192, 28672), (64, 4096, 4096),
                                     (33, 512, 1024), (1, 64, 128)])
def test_slice_aligned_grid_keeps_blocks_in_one_slice_without_lengthening_any(sms, m, n, k):
    """The kernel gives block b iterations [b T / G, (b + 1) T / G); mirrored here for every block. An aligned grid
    may lengthen the longest range by up to GemmPolicy.aligned_max_longer (a straddled slice end costs more than the
    extra steps)."""
    cfg = gemm.choose_config(S.F16, S.U4B8, m, n, k, 128, False, 227 * 1024)
    slices = -(-m // cfg.block_m) * (n // cfg.block_n)
    ki = k // cfg.block_k
    total = slices * ki
    grid = gemm.grid_blocks(cfg, m, n, k, sms)
    striped = min(sms, total)
    assert 1 <= grid <= striped
    ranges = [(b * total // grid, (b + 1) * total // grid) for b in range(grid)]
    longest = max(e - s for s, e in ranges)
    p = DEFAULT_GEMM_POLICY
    assert longest <= -(-total // striped) * p.aligned_max_longer + p.aligned_extra_steps
    if grid != striped:
        assert all(e > s and s // ki == (e - 1) // ki for s, e in ranges)


# ---- array-level validation (NumPy stand-ins) --------------------------------------------------------------------
def arrays(m=16, k=256, n=128, wt=S.U4B8, ng=2, act=np.float16, zeros=None, g_idx=None, perm=None):
    """Stand-ins of the arrays of a (k, n) weight: those of the weight zero-padded to whole 16 x 64 tiles."""
    pf = wt.pack_factor
    k_pad, n_pad = gemm.padded_shape(k, n)
    a = np.zeros((m, k), dtype=act)
    b = np.zeros((k_pad // 16, n_pad * 16 // pf), dtype=np.int32)
    s = np.zeros((ng, n_pad), dtype=act)
    if zeros is True:
        zeros = np.zeros((ng, n_pad // pf), dtype=np.int32)
    return dict(a=a, b_q_weight=b, b_scales=s, b_zeros=zeros, g_idx=g_idx, perm=perm,
                workspace=np.zeros(264, np.int32), b_q_type=wt, size_m=m, size_n=n, size_k=k)


def call(**kw):
    args = arrays(**{k: kw.pop(k) for k in list(kw) if k in ("m", "k", "n", "wt", "ng", "act", "zeros", "g_idx",
                                                             "perm")})
    args.update(kw)
    return gemm.gptq_marlin_gemm(**args)


def test_well_formed_numpy_call_stops_at_the_device_check():
    with pytest.raises(TypeError, match="A is not on GPU"):
        call()
    with pytest.raises(TypeError, match="A is not on GPU"):
        call(wt=S.U4, zeros=True, act=ml_dtypes.bfloat16)


@pytest.mark.parametrize("kw", [
    dict(n=7392),  # Qwen2-72B's 29568 at TP4: 115.5 tiles of 64
    dict(n=97, k=40, ng=1),  # an odd N, a K of 2.5 k16 tiles
    dict(k=10944, ng=86),  # DeepSeek-V2-Lite's 10944 with group 128: 85.5 groups
    dict(k=10944, ng=86, wt=S.U4, zeros=True, n=200),
    dict(k=260, ng=3, wt=S.U8B128, a=np.zeros((16, 264), np.float16)[:, :260]),  # 8-bit: K % 4; A's rows padded
    dict(k=4100, ng=33, wt=S.FE4M3FN, m=1, n=7392),  # block FP8: partial blocks at both edges
])
def test_shapes_the_storage_rule_allows_stop_at_the_device_check(kw):
    """Any N, K a multiple of the pack factor, a partial last group: the checks pass them (docs/formats.md, "Shapes
    that are not tile multiples"); the numpy call then stops at the device check."""
    with pytest.raises(TypeError, match="A is not on GPU"):
        call(**kw)


def test_one_row_with_an_8_bit_k_ending_mid_chunk_makes_a_record_the_launch_accepts():
    """M = 1 has no row stride; the plan's lda is K rounded up to whole 16-byte chunks, so the record's row-stride rule
    (lda % 8 == 0) holds for K = 4100 too (it refused such a record before the launch)."""
    args = arrays(m=1, k=4100, n=7392, wt=S.U8B128, ng=33)
    plan = gemm.check_gemm_shapes(args["a"], args["b_q_weight"], args["b_scales"], None, None, None, S.U8B128, 1,
                                  7392, 4100, True)
    assert plan.lda == 4104 and plan.group_size == 128
    record = MarlinMmRequest(weight_type=S.U8B128, buffers=MarlinMmBuffers(
        a=0x1000, b=0x2000, c=0x3000, c_tmp=0x4000, b_scales=0x5000, workspace=0x6000), problem=plan.problem,
        execution=MarlinMmExecution(sms=132)).into_launch()
    cfg, _, grid = check(record)
    assert grid >= 1 and gemm.tiled_n(7392) % cfg.block_n == 0


@pytest.mark.parametrize("kw,exc,message", [
    (dict(bias=np.zeros(127, np.float16)), ValueError, r"bias has shape \(127,\), expected \(128,\)"),
    (dict(bias=np.zeros(128, np.float32)), TypeError, "bias dtype = float32 must equal the activation dtype"),
    (dict(bias=np.zeros(256, np.float16)[::2]), ValueError, "bias is not contiguous"),
    (dict(k=260, ng=3, wt=S.U8B128), ValueError,
     r"A.stride\(0\) = 260 must be >= size_k = 260 and divisible by 8 \(16-byte rows; for a K that is not, pass A as "
     r"a view of rows padded"),
    (dict(k=260, ng=3, wt=S.U8B128, m=1, g_idx=np.zeros(260, np.int32), perm=np.zeros(260, np.int32)), ValueError,
     "act-order needs size_k % 8 == 0"),
    (dict(k=10944, ng=85), ValueError, "b_scales.size\\(0\\) = 85 does not split size_k = 10944 into groups"),
    (dict(k=4100, ng=65, wt=S.FE4M3FN, m=1), ValueError, "fe4m3fn weights take channelwise or group-128 scales"),
])
def test_bias_and_edge_shape_rules_name_their_values(kw, exc, message):
    with pytest.raises(exc, match=message):
        call(**kw)


@pytest.mark.parametrize("kw,exc,message", [
    (dict(act=np.float32), TypeError, "unsupported `a` dtype = float32"),
    (dict(b_q_type="u8"), ValueError, "size_n = 128, actual_size_n = 64"),
    (dict(b_q_type="f16"), ValueError, "b_q_type = f16 is not a Marlin weight type"),
    (dict(size_m=15), ValueError, "Shape mismatch: a.size\\(0\\) = 16, size_m = 15"),
    (dict(size_k=128), ValueError, "Shape mismatch: a.size\\(1\\) = 256, size_k = 128"),
    (dict(size_m=-1), ValueError, "Invalid MNK"),
    (dict(size_n=1.5), TypeError, "size_n must be an int"),
    (dict(k=260), ValueError, "size_k = 260 is not a multiple of the pack factor 8 of u4b8 weights"),
    (dict(b_q_weight=np.zeros((16, 256), np.int64)), TypeError, "b_q_weight dtype = int64"),
    (dict(b_q_weight=np.zeros((15, 256), np.int32)), ValueError, "b_q_weight.size\\(0\\) = 15, size_k = 256"),
    (dict(b_q_weight=np.zeros((16, 256), np.int32), k=264, a=np.zeros((16, 264), np.float16)), ValueError,
     "b_q_weight.size\\(0\\) = 16, size_k = 264: expected ceil\\(size_k / tile_size = 16\\) = 17"),
    (dict(b_q_weight=np.zeros((16, 250), np.int32)), ValueError, "b_q_weight.size\\(1\\) = 250 is not divisible"),
    (dict(b_q_weight=np.zeros((16, 96 * 16 // 8), np.int32), size_n=96, a=np.zeros((16, 256), np.float16),
          b_scales=np.zeros((2, 96), np.float16)), ValueError,
     r"actual_size_n = 96 .* the weight's arrays are ceil\(size_n / 64\) \* 64 = 128 columns wide"),
    (dict(a=np.zeros((16, 512), np.float16)[:, ::2]), ValueError, "A.stride\\(1\\) is not 1"),
    (dict(a=np.zeros((16, 260), np.float16)[:, :256]), ValueError, "A.stride\\(0\\) = 260 must be"),
    (dict(b_q_weight=np.zeros((32, 256), np.int32)[::2]), ValueError, "b_q_weight is not contiguous"),
    (dict(c=np.zeros((16, 64), np.float16)), ValueError, "Shape mismatch: c.size\\(0\\)"),
    (dict(c=np.zeros((16, 128), np.float32)), TypeError, "c dtype = float32"),
    (dict(b_scales=np.zeros((2, 128, 1), np.float16)), ValueError, "b_scales rank = 3 is not 2"),
    (dict(b_scales=np.zeros((2, 64), np.float16)), ValueError,
     r"b_scales dim 1 = 64 is not ceil\(size_n / 64\) \* 64 = 128 \(size_n = 128\)"),
    (dict(b_scales=np.zeros((2, 128), np.float32)), TypeError, "b_scales dtype = float32"),
    (dict(b_scales=np.zeros((3, 128), np.float16)), ValueError,
     r"b_scales.size\(0\) = 3 does not split size_k = 256 into groups"),
    (dict(b_scales=np.zeros((16, 128), np.float16)), ValueError, "group size = size_k / num_groups = 256 / 16 = 16"),
    (dict(g_idx=np.zeros(256, np.int32)), ValueError, "Unexpected g_idx.size\\(-1\\) = 256 and perm.size\\(-1\\) = 0"),
    (dict(g_idx=np.zeros(255, np.int32), perm=np.zeros(255, np.int32)), ValueError, "where size_k = 256"),
    (dict(g_idx=np.zeros(256, np.int64), perm=np.zeros(256, np.int32)), TypeError, "g_idx dtype = int64"),
    (dict(g_idx=np.zeros(256, np.int32), perm=np.zeros(256, np.int32), ng=1), ValueError,
     "For act_order, num_groups must be > 1"),
    (dict(wt=S.FE4M3FN, g_idx=np.zeros(256, np.int32), perm=np.zeros(256, np.int32)), ValueError,
     "not defined for fe4m3fn"),
    (dict(wt=S.FE4M3FN, ng=4), ValueError, "fe4m3fn weights take channelwise or group-128 scales, got group size 64"),
    (dict(zeros=True), ValueError, "b_type must be u4 or u8 when has_zp = True. Got = u4b8"),
    (dict(wt=S.U4), ValueError, "b_type must be u4b8, u8b128 or fe4m3fn when has_zp = False. Got = u4"),
    (dict(wt=S.U4, zeros=np.zeros((2, 16), np.int64)), TypeError, "b_zeros dtype = int64"),
    (dict(wt=S.U4, zeros=np.zeros((2, 16, 1), np.int32)), ValueError, "b_zeros rank = 3 is not 2"),
    (dict(wt=S.U4, zeros=np.zeros((3, 16), np.int32)), ValueError, "b_zeros dim 0 = 3 is not num_groups = 2"),
    (dict(wt=S.U4, zeros=np.zeros((2, 32), np.int32)), ValueError,
     r"b_zeros dim 1 = 32 is not ceil\(size_n / 64\) \* 64 / pack_factor = 16"),
    (dict(use_atomic_add=True, deterministic=True), ValueError, "cannot be deterministic"),
])
def test_every_shape_rule_names_its_values(kw, exc, message):
    with pytest.raises(exc, match=message):
        call(**kw)


def test_inputs_are_not_mutated():
    args = arrays(wt=S.U4, zeros=True)
    for x in (args["a"], args["b_q_weight"], args["b_scales"], args["b_zeros"]):
        x[...] = 7
    snapshot = {k: v.copy() for k, v in args.items() if isinstance(v, np.ndarray)}
    with pytest.raises(TypeError):
        gemm.gptq_marlin_gemm(**args)
    for k, v in snapshot.items():
        np.testing.assert_array_equal(args[k], v)


def test_scratch_sizes_are_checked_with_their_minimums():
    plan = gemm.check_gemm_shapes(np.zeros((4, 256), np.float16), np.zeros((16, 256), np.int32),
                                  np.zeros((2, 128), np.float16), None, None, None, "u4b8", 4, 128, 256, True)
    with pytest.raises(ValueError, match="workspace.numel = 10 is below min_workspace_size = 264"):
        gemm.checks.check_scratch(plan, np.zeros(10, np.int32), None, None, 132, False, False)
    with pytest.raises(ValueError, match="c_tmp.numel = 5 is below"):
        gemm.checks.check_scratch(plan, np.zeros(264, np.int32), np.zeros(5, np.float32), None, 132, True, False)
    with pytest.raises(TypeError, match="workspace dtype = int64"):
        gemm.checks.check_scratch(plan, np.zeros(264, np.int64), None, None, 132, False, False)


def test_marlin_gemm_refuses_expert_stacks_and_host_weights():
    from workbench.weight import random_marlin_weight

    mw, _ = random_marlin_weight(128, 64, S.U4B8, 128)
    with pytest.raises(TypeError, match="upload_weight"):
        gemm.marlin_gemm(np.zeros((1, 128), np.float16), mw)


def test_small_m_prefers_two_resident_blocks_when_shared_memory_allows():
    """H200: 233472 B of shared memory per SM; M <= 16 kernels are cut to 128 registers so two blocks fit."""
    cfg = gemm.choose_config(S.F16, S.U4B8, 1, 8192, 8192, 128, False, 232448, sm_smem=233472)
    assert cfg.blocks_per_sm == 2 and 2 * (cfg.smem_bytes + 1088) <= 233472
    assert gemm.grid_blocks(cfg, 1, 8192, 8192, 132) == 256  # 64 slices x 4 blocks (slice-aligned)
    assert gemm.workspace_numel(132) >= 264
    big = gemm.choose_config(S.F16, S.U4B8, 64, 8192, 8192, 128, False, 232448, sm_smem=233472)
    assert big.blocks_per_sm == 1


def test_error_bound_factor_terms():
    """One output rounding + the weight rounding late scaling skips + K 2^-22; in-C / atomic add one per block."""
    u16, u_bf = 2.0 ** -11, 2.0 ** -8
    assert gemm.error_bound_factor(np.float16, 1024) == 2 * u16 + 1024 * 2.0 ** -22
    assert gemm.error_bound_factor("bfloat16", 128, weight_rounding=False) == u_bf + 128 * 2.0 ** -22
    assert gemm.error_bound_factor(np.float16, 4096, output_roundings=1 + 64) == 66 * u16 + 4096 * 2.0 ** -22
