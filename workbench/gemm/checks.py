"""Validation of the dense Marlin GEMM, one layer: each rule with its one message (``check_sizes``,
``check_groups``, ...), the array checks of ``gptq_marlin_gemm`` (``check_gemm_shapes``, ``check_scratch``) built on
them, and the activation dtypes. The record checks (workbench.gemm.launch.check_launch) and a prepared launch's
address checks call the same rules, so a rule and its wording exist once.

Pure Python, no GPU: every function raises ValueError/TypeError naming the values that broke the rule.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from workbench.gemm.geometry import c_tmp_numel, tiled_n, workspace_numel
from workbench.gemm_abi import GEMM_WEIGHT_TYPES, MarlinMmProblem
from workbench.scalar_types import ScalarType

TILE_N = 64  # Marlin tile width: the weight's columns come in 64-column tiles (the last one zero-padded)
TILE_K = 16  # the tensor-core k16 step: the weight's rows come in 16-row tiles (the last one zero-padded)
A_CHUNK = 8  # activations per 16-byte chunk: A's rows are read in chunks, so they start 16-byte aligned
GROUP_SIZES = (32, 64, 128)  # grouped scales the kernel stages per pipeline step


@dataclasses.dataclass(frozen=True)
class MicroscaleRule:
    """A microscaled format the GEMM runs, as vLLM's Marlin does: its scale bytes' type, group, activations."""

    name: str
    group_size: int
    acts: tuple[ScalarType, ...]
    global_scale: bool  # an fp32 per-tensor scale (required)


# (weight type, scale type) -> the format (vLLM's marlin.cu: FP4 with E4M3 scales at group 16, fp16 or bf16; FP4 and
# FP8 with E8M0 scales at group 32, bf16 only: E8M0 reaches 2^127, past fp16)
MICROSCALE_RULES = {
    (ScalarType.FE2M1F, ScalarType.FE4M3FN): MicroscaleRule("NVFP4", 16, (ScalarType.F16, ScalarType.BF16), True),
    (ScalarType.FE2M1F, ScalarType.FE8M0FNU): MicroscaleRule("MXFP4", 32, (ScalarType.BF16,), False),
    (ScalarType.FE4M3FN, ScalarType.FE8M0FNU): MicroscaleRule("MXFP8", 32, (ScalarType.BF16,), False),
}


def microscale_rule(weight: ScalarType, scale: ScalarType, act: ScalarType) -> MicroscaleRule | None:
    """The format of (weight, scale type), None where the scales are in the activation type; ValueError for a pair
    the kernel has no format for (fe2m1f weights always need scale bytes)."""
    if scale is act:
        if weight is ScalarType.FE2M1F:
            raise ValueError("b_q_type = fe2m1f takes scale bytes: NVFP4 (float8_e4m3fn scales, group 16, a "
                             "global_scale) or MXFP4 (float8_e8m0fnu scales, group 32), not scales in the activation "
                             f"type {act}")
        return None
    rule = MICROSCALE_RULES.get((weight, scale))
    if rule is None:
        known = ", ".join(f"{w} with {s} ({r.name})" for (w, s), r in MICROSCALE_RULES.items())
        raise ValueError(f"b_q_type = {weight} with {scale} scales is not a Marlin format (known: {known})")
    return rule


def check_microscale(weight: ScalarType, scale: ScalarType, act: ScalarType, group_size: int,
                     has_global_scale: bool, act_order: bool, size_n: int | None = None) -> None:
    """A microscaled format's fixed group, its activation types (vLLM's), its global scale (NVFP4: required; else
    refused), no act-order, and (``size_n`` given) N whole 64-column tiles: the ops, the Numba ports and the
    checkpoint tools take any N for these formats, but the kernels' edge tiles with 1-byte scales have not been run
    on a GPU yet (tests/gpu/test_fp4_gemm.py, test_odd_n_against_the_reference, is the check that lifts this)."""
    rule = microscale_rule(weight, scale, act)
    if rule is None:
        if has_global_scale:
            raise ValueError(f"global_scale is NVFP4's (fe2m1f weights with float8_e4m3fn scales); b_q_type = {weight}"
                             f" with {scale} scales takes none")
        return
    if group_size != rule.group_size:
        msg = f"{rule.name} has groups of {rule.group_size}, got group size {group_size} (size_k / b_scales.size(0))"
        if weight is ScalarType.FE2M1F:
            msg += ("; uint8 scales of fe2m1f weights are read as NVFP4's where a global_scale is given or the group "
                    "is 16, else as MXFP4's E8M0 codes")
        raise ValueError(msg)
    if act not in rule.acts:
        raise ValueError(f"{rule.name} runs with {' or '.join(map(str, rule.acts))} activations in Marlin (as vLLM), "
                         f"got {act}")
    if rule.global_scale and not has_global_scale:
        raise ValueError(f"{rule.name} needs global_scale (one float32: the per-tensor scale with the kernel's exponent"
                         " correction, workbench.ops.nvfp4_marlin_global_scale)")
    if not rule.global_scale and has_global_scale:
        raise ValueError(f"{rule.name} has no global scale; global_scale must be None")
    if act_order:
        raise ValueError(f"act-order (g_idx, perm) is not defined for {rule.name}")
    if size_n is not None and size_n % TILE_N:
        raise ValueError(f"{rule.name} with size_n = {size_n}: the GEMM runs microscaled weights only with N a "
                         f"multiple of {TILE_N} (its padded last tile with 1-byte scales has not been checked on a GPU; the "
                         "repacked arrays themselves are valid)")

# The pointers of a launch that must be 16-byte aligned (null counts as aligned), in the record's order.
ALIGNED_POINTERS = ("a", "b", "c", "c_tmp", "b_scales", "zero_points", "group_index", "permutation", "a_tmp")
# The pointers every launch needs.
REQUIRED_POINTERS = ("a", "b", "c", "b_scales", "workspace")


def check_mnk(m: int, n: int, k: int) -> None:
    if m < 0 or n <= 0 or k <= 0:
        raise ValueError(f"Invalid MNK = [{m}, {n}, {k}]")


def check_size_k(k: int, weight: ScalarType) -> None:
    """K is a multiple of the weight's pack factor (GPTQ rows pack that many codes per int32 word: 8 for 4-bit, 4 for
    8-bit); the kernel predicates the last k16 tile and the last pipeline step (docs/formats.md, "Shapes that are not
    tile multiples")."""
    if k % weight.pack_factor:
        raise ValueError(f"size_k = {k} is not a multiple of the pack factor {weight.pack_factor} of {weight} weights "
                         f"(GPTQ rows pack {weight.pack_factor} codes per int32 word)")


def check_size_n(n: int) -> None:
    """Any N: the weight's arrays are tiled_n(N) wide (the last 64-column tile zero-padded), C is (M, N)."""


def check_sizes(m: int, n: int, k: int, weight: ScalarType) -> None:
    check_mnk(m, n, k)
    check_size_k(k, weight)
    check_size_n(n)


def padded_shape(k: int, n: int) -> tuple[int, int]:
    """The (rows, columns) of a (K, N) weight's Marlin arrays: K and N rounded up to the 16 x 64 tile."""
    return -(-k // TILE_K) * TILE_K, tiled_n(n)


def group_size_of(k: int, num_groups: int) -> int | None:
    """The group size of num_groups > 1 scale rows over K rows: the size in GROUP_SIZES with ceil(K / group) ==
    num_groups (the last group partial or whole; at most one size fits), else K / num_groups where that divides (an
    act-order K shard's groups), else None."""
    fits = next((g for g in GROUP_SIZES if -(-k // g) == num_groups), None)
    if fits is not None:
        return fits
    return k // num_groups if k % num_groups == 0 else None


def check_row_stride(lda: int, k: int, name: str) -> None:
    """A's rows: at least K elements apart and 16-byte aligned (the kernel fetches 16-byte words)."""
    if lda < k or lda % A_CHUNK:
        raise ValueError(f"{name} = {lda} must be >= size_k = {k} and divisible by {A_CHUNK} (16-byte rows; for a K "
                         f"that is not, pass A as a view of rows padded to a multiple of {A_CHUNK})")


def check_zero_points(has_zero_points: bool, weight: ScalarType) -> None:
    """Zero points exactly for the weight types that have them (u4, u8)."""
    if has_zero_points and not weight.has_zero_points:
        raise ValueError(f"b_type must be u4 or u8 when has_zp = True. Got = {weight}")
    if not has_zero_points and weight.has_zero_points:
        raise ValueError(f"b_type must be u4b8, u8b128 or fe4m3fn when has_zp = False. Got = {weight}")


def check_act_order(weight: ScalarType, act_order: bool, is_k_full: bool, num_groups: int) -> None:
    """Act-order groups: not for fe4m3fn weights; on a full K they need more than one group."""
    if not act_order:
        return
    if weight is ScalarType.FE4M3FN:
        raise ValueError("act-order (g_idx, perm) is not defined for fe4m3fn weights")
    if is_k_full and num_groups == 1:
        raise ValueError("For act_order, num_groups must be > 1")


def check_groups(weight: ScalarType, k: int, num_groups: int, act_order: bool, is_k_full: bool,
                 groups_name: str = "num_groups", microscaled: bool = False) -> int:
    """num_groups splits K into groups of GROUP_SIZES rows, the last one possibly partial (num_groups =
    ceil(K / group)); any size on a K shard of act-order groups; fe4m3fn weights take channelwise or group-128 scales
    (block-FP8's partial edge blocks); a microscaled format's fixed group (check_microscale) divides K. Returns the
    group size (-1: channelwise). ``groups_name``: what the caller calls num_groups (``b_scales.size(0)`` for
    arrays)."""
    if microscaled:
        if num_groups <= 0 or k % num_groups:
            raise ValueError(f"size_k = {k}, is not divisible by {groups_name} = {num_groups} (a microscaled "
                             f"format's groups are whole)")
        return -1 if num_groups == 1 else k // num_groups
    per_row = act_order and not is_k_full
    if num_groups <= 0 or (not per_row and group_size_of(k, num_groups) is None) or (per_row and num_groups > k):
        raise ValueError(f"{groups_name} = {num_groups} does not split size_k = {k} into groups: it must be "
                         f"size_k / group or ceil(size_k / group) (a partial last group) for a group size in "
                         f"{GROUP_SIZES}, or 1 (channelwise)")
    group_size = -1 if num_groups == 1 else (group_size_of(k, num_groups) or k // num_groups)
    if num_groups > 1 and not per_row and group_size not in GROUP_SIZES:
        raise ValueError(f"group size = size_k / num_groups = {k} / {num_groups} = {group_size} is not one of "
                         f"{GROUP_SIZES} (or channelwise)")
    if weight is ScalarType.FE4M3FN and num_groups > 1 and group_size != 128:
        raise ValueError(f"fe4m3fn weights take channelwise or group-128 scales, got group size {group_size}")
    return group_size


def check_reduction(use_atomic_add: bool, deterministic: bool, batch_invariant: bool = False) -> None:
    if use_atomic_add and deterministic:
        raise ValueError("use_atomic_add cannot be deterministic: atomics sum in arrival order")
    if use_atomic_add and batch_invariant:
        raise ValueError("use_atomic_add cannot be batch_invariant: atomics sum in arrival order")


def check_pointers(pointers: dict[str, int], *, uses_c_tmp: bool, has_zero_points: bool, act_order: bool) -> None:
    """Every pointer a launch needs is non-null and every pointer is 16-byte aligned (``pointers``: the record's
    names, ints, 0 = null)."""
    for name in REQUIRED_POINTERS:
        if not pointers[name]:
            raise ValueError(f"{name} is null")
    if uses_c_tmp and not pointers["c_tmp"]:
        raise ValueError("use_fp32_reduce needs c_tmp (fp32 partial sums); pass one or clear the flag")
    if has_zero_points and not pointers["zero_points"]:
        raise ValueError("HAS_ZERO_POINTS flag = True needs zero_points (got null)")
    if act_order and not (pointers["group_index"] and pointers["permutation"]):
        raise ValueError(f"HAS_ACT_ORDER flag = True needs group_index and permutation (got "
                         f"{pointers['group_index']:#x}, {pointers['permutation']:#x})")
    if act_order and not pointers["a_tmp"]:
        raise ValueError("act-order needs a_tmp (an M x K activation buffer for the gathered columns)")
    for name in ALIGNED_POINTERS:
        ptr = pointers[name]
        if ptr % 16:
            raise ValueError(f"{name} must be aligned to 16 bytes (address {ptr:#x} % 16 = {ptr % 16})")


def check_pipeline_steps(iterations: int) -> None:
    if iterations >= 2**31:
        raise ValueError(f"problem too large: {iterations} pipeline steps do not fit the kernel's 32-bit counters")


def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)




def act_scalar_type(dtype) -> ScalarType:
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        return ScalarType.F16
    if dtype == _bf16():
        return ScalarType.BF16
    raise TypeError(f"unsupported `a` dtype = {dtype}; the Marlin GEMM takes float16 or bfloat16 activations")


def act_numpy_dtype(act: ScalarType) -> np.dtype:
    return np.dtype(np.float16) if act is ScalarType.F16 else _bf16()


def _shape(x) -> tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


def _numel(x) -> int:
    return int(np.prod(_shape(x))) if x is not None else 0


def _is_empty(x) -> bool:
    return x is None or _numel(x) == 0


def _contiguous(x) -> bool:
    flags = getattr(x, "flags", None)
    return bool(flags["C_CONTIGUOUS"]) if flags is not None else True


def _dtype_is(x, dtype, name: str) -> None:
    if np.dtype(x.dtype) != np.dtype(dtype):
        raise TypeError(f"{name} dtype = {np.dtype(x.dtype)} must be {np.dtype(dtype)}")


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    """What the shape checks concluded: ferrum-kernels' ``MarlinMmProblem`` (m, n, k, lda, groups) plus the types and
    the act-order flags; turned into a ``MarlinMmRequest`` once device pointers are known."""

    act: ScalarType
    weight: ScalarType
    problem: MarlinMmProblem
    has_act_order: bool
    is_k_full: bool
    scale: ScalarType | None = None  # scale bytes' type (microscaled formats), None: the activation type
    has_global_scale: bool = False

    m = property(lambda self: self.problem.m)
    n = property(lambda self: self.problem.n)
    k = property(lambda self: self.problem.k)
    lda = property(lambda self: self.problem.lda)
    num_groups = property(lambda self: self.problem.num_groups)
    group_size = property(lambda self: self.problem.group_size)  # -1 = channelwise


# the scale dtypes that name a scale-byte type (NumPy / ml_dtypes names; torch's are the same)
SCALE_BYTE_DTYPES = {"float8_e4m3fn": ScalarType.FE4M3FN, "float8_e8m0fnu": ScalarType.FE8M0FNU}


def scale_type_of(b_scales, weight: ScalarType, act: ScalarType, has_global_scale: bool,
                  group_size: int) -> ScalarType:
    """What b_scales hold: the activation type, or scale bytes (float8_e4m3fn / float8_e8m0fnu, or uint8 read by the
    weight type: fe2m1f with a global scale or groups of 16 is NVFP4's E4M3-derived bytes, else E8M0 codes)."""
    name = np.dtype(b_scales.dtype).name
    if name in SCALE_BYTE_DTYPES:
        return SCALE_BYTE_DTYPES[name]
    if np.dtype(b_scales.dtype) == np.uint8 and weight in (ScalarType.FE2M1F, ScalarType.FE4M3FN):
        nvfp4 = weight is ScalarType.FE2M1F and (has_global_scale or group_size == 16)
        return ScalarType.FE4M3FN if nvfp4 else ScalarType.FE8M0FNU
    return act


def check_global_scale(global_scale) -> None:
    if global_scale is None:
        return
    if np.dtype(global_scale.dtype) != np.float32 or _numel(global_scale) != 1:
        raise ValueError(f"global_scale must be one float32, got dtype {np.dtype(global_scale.dtype)} and "
                         f"{_numel(global_scale)} elements")


def check_gemm_shapes(a, b_q_weight, b_scales, b_zeros, g_idx, perm, b_q_type, size_m: int, size_n: int,
                      size_k: int, is_k_full: bool, c=None, global_scale=None) -> GemmPlan:
    """The host checks of docs/formats.md, "Host checks", on any array-like with .shape/.dtype/.strides; no GPU
    needed. ``global_scale``: NVFP4's one float32 (None otherwise)."""
    act = act_scalar_type(a.dtype)
    weight = ScalarType.parse(b_q_type)
    if weight not in GEMM_WEIGHT_TYPES:
        raise ValueError(f"b_q_type = {weight} is not a Marlin weight type")
    for name, v in (("size_m", size_m), ("size_n", size_n), ("size_k", size_k)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    check_mnk(size_m, size_n, size_k)
    if len(_shape(a)) != 2:
        raise ValueError(f"a must be 2-D (M, K), got shape {_shape(a)}")
    if _shape(a)[0] != size_m:
        raise ValueError(f"Shape mismatch: a.size(0) = {_shape(a)[0]}, size_m = {size_m}")
    if _shape(a)[1] != size_k:
        raise ValueError(f"Shape mismatch: a.size(1) = {_shape(a)[1]}, size_k = {size_k}")
    check_size_k(size_k, weight)
    check_size_n(size_n)
    # the weight's arrays are those of the weight zero-padded to whole 16 x 64 tiles (docs/formats.md, "Shapes that
    # are not tile multiples"); the true sizes come in size_k / size_n
    k_pad, n_pad = padded_shape(size_k, size_n)
    _dtype_is(b_q_weight, np.int32, "b_q_weight")
    if len(_shape(b_q_weight)) != 2:
        raise ValueError(f"b_q_weight must be 2-D (ceil(K/16), ceil(N/64)*64*16/pack), got shape "
                         f"{_shape(b_q_weight)}")
    if _shape(b_q_weight)[0] != k_pad // TILE_K:
        raise ValueError(f"Shape mismatch: b_q_weight.size(0) = {_shape(b_q_weight)[0]}, size_k = {size_k}: expected "
                         f"ceil(size_k / tile_size = {TILE_K}) = {k_pad // TILE_K}")
    if _shape(b_q_weight)[1] % TILE_K:
        raise ValueError(f"b_q_weight.size(1) = {_shape(b_q_weight)[1]} is not divisible by tile_size = {TILE_K}")
    actual_n = _shape(b_q_weight)[1] // TILE_K * weight.pack_factor
    if n_pad != actual_n:
        raise ValueError(f"size_n = {size_n}, actual_size_n = {actual_n} (b_q_weight.size(1) = "
                         f"{_shape(b_q_weight)[1]}, pack_factor = {weight.pack_factor}): the weight's arrays are "
                         f"ceil(size_n / {TILE_N}) * {TILE_N} = {n_pad} columns wide")
    item = np.dtype(a.dtype).itemsize
    strides = tuple(int(s) for s in a.strides)
    if size_m > 0 and strides[1] != item:
        raise ValueError(f"A.stride(1) is not 1 (strides in elements: {tuple(s // item for s in strides)})")
    # one row: its stride is never used; the record carries K rounded up to whole 16-byte chunks (an 8-bit K may
    # end inside one), which every row-stride rule accepts
    lda = strides[0] // item if size_m > 1 else -(-size_k // A_CHUNK) * A_CHUNK
    if size_m > 1:
        check_row_stride(lda, size_k, "A.stride(0)")
    if not _contiguous(b_q_weight):
        raise ValueError("b_q_weight is not contiguous")
    if c is not None:
        if _shape(c) != (size_m, size_n):
            raise ValueError(f"Shape mismatch: c.size(0) = {_shape(c)[0] if _shape(c) else '?'}, size_m = {size_m}"
                             f" (c has shape {_shape(c)}, expected ({size_m}, {size_n}))")
        if np.dtype(c.dtype) != np.dtype(a.dtype):
            raise TypeError(f"c dtype = {np.dtype(c.dtype)} must equal a dtype = {np.dtype(a.dtype)}")
        if not _contiguous(c):
            raise ValueError("c is not contiguous")
    if len(_shape(b_scales)) != 2:
        raise ValueError(f"b_scales rank = {len(_shape(b_scales))} is not 2")
    if _shape(b_scales)[1] != n_pad:
        raise ValueError(f"b_scales dim 1 = {_shape(b_scales)[1]} is not ceil(size_n / {TILE_N}) * {TILE_N} = {n_pad}"
                         f" (size_n = {size_n})")
    check_global_scale(global_scale)
    has_global = global_scale is not None
    rows = _shape(b_scales)[0]
    scale = scale_type_of(b_scales, weight, act, has_global, size_k // rows if rows and size_k % rows == 0 else 0)
    if scale is act and np.dtype(b_scales.dtype) != np.dtype(a.dtype):
        raise TypeError(f"b_scales dtype = {np.dtype(b_scales.dtype)} must equal a dtype = {np.dtype(a.dtype)}")
    microscaled = microscale_rule(weight, scale, act) is not None
    if not _contiguous(b_scales):
        raise ValueError("b_scales is not contiguous")
    num_groups = _shape(b_scales)[0]
    has_act_order = not (_is_empty(g_idx) and _is_empty(perm))
    if has_act_order:
        g_len = _shape(g_idx)[-1] if g_idx is not None and _shape(g_idx) else 0
        p_len = _shape(perm)[-1] if perm is not None and _shape(perm) else 0
        if g_len != size_k or p_len != size_k:
            raise ValueError(f"Unexpected g_idx.size(-1) = {g_len} and perm.size(-1) = {p_len}, "
                             f"where size_k = {size_k}")
        _dtype_is(g_idx, np.int32, "g_idx")
        _dtype_is(perm, np.int32, "perm")
        if size_k % A_CHUNK:  # (the gathered copy of A is (M, K) contiguous, read in 16-byte chunks)
            raise ValueError(f"act-order needs size_k % {A_CHUNK} == 0 (the gathered activations' rows are read in "
                             f"16-byte chunks), got size_k = {size_k}")
    check_act_order(weight, has_act_order, is_k_full, num_groups)
    group_size = check_groups(weight, size_k, num_groups, has_act_order, is_k_full, "b_scales.size(0)", microscaled)
    check_microscale(weight, scale, act, group_size, has_global, has_act_order, size_n)
    has_zp = not _is_empty(b_zeros)
    check_zero_points(has_zp, weight)
    if has_zp:
        _dtype_is(b_zeros, np.int32, "b_zeros")
        if len(_shape(b_zeros)) != 2:
            raise ValueError(f"b_zeros rank = {len(_shape(b_zeros))} is not 2")
        if _shape(b_zeros)[0] != num_groups:
            raise ValueError(f"b_zeros dim 0 = {_shape(b_zeros)[0]} is not num_groups = {num_groups}")
        if _shape(b_zeros)[1] != n_pad // weight.pack_factor:
            raise ValueError(f"b_zeros dim 1 = {_shape(b_zeros)[1]} is not ceil(size_n / {TILE_N}) * {TILE_N} / "
                             f"pack_factor = {n_pad // weight.pack_factor}")
        if not _contiguous(b_zeros):
            raise ValueError("b_zeros is not contiguous")
    problem = MarlinMmProblem(m=size_m, n=size_n, k=size_k, lda=lda, num_groups=num_groups,
                              group_size=group_size if num_groups > 1 else -1)
    return GemmPlan(act, weight, problem, has_act_order, bool(is_k_full) or not has_act_order,
                    scale if microscaled else None, has_global)


def check_bias(bias, size_n: int, act_dtype, name: str = "bias", lead: tuple[int, ...] = ()) -> None:
    """An optional bias: lead + (size_n,) contiguous, the activation dtype (added in fp32 before C's rounding)."""
    if bias is None:
        return
    if _shape(bias) != lead + (size_n,):
        raise ValueError(f"{name} has shape {_shape(bias)}, expected {lead + (size_n,)}")
    if np.dtype(bias.dtype) != np.dtype(act_dtype):
        raise TypeError(f"{name} dtype = {np.dtype(bias.dtype)} must equal the activation dtype {np.dtype(act_dtype)}")
    if not _contiguous(bias):
        raise ValueError(f"{name} is not contiguous")


def check_scratch(plan: GemmPlan, workspace, c_tmp, a_tmp, sms: int, use_fp32_reduce: bool,
                  use_atomic_add: bool) -> None:
    if workspace is None:
        raise ValueError("workspace is required: a zeroed int32 buffer of at least workspace_numel(sms) elements")
    _dtype_is(workspace, np.int32, "workspace")
    if _numel(workspace) < workspace_numel(sms):
        raise ValueError(f"workspace.numel = {_numel(workspace)} is below min_workspace_size = "
                         f"{workspace_numel(sms)}")
    if use_fp32_reduce and not use_atomic_add:
        if c_tmp is None:
            raise ValueError("use_fp32_reduce needs c_tmp (fp32, at least c_tmp_numel(sms) elements)")
        _dtype_is(c_tmp, np.float32, "c_tmp")
        if _numel(c_tmp) < c_tmp_numel(sms):
            raise ValueError(f"c_tmp.numel = {_numel(c_tmp)} is below c_tmp_numel(sms = {sms}) = {c_tmp_numel(sms)}")
    if plan.has_act_order:
        if a_tmp is None:
            raise ValueError("act-order needs a_tmp (an M x K buffer in the activation dtype)")
        if np.dtype(a_tmp.dtype) != act_numpy_dtype(plan.act):
            raise TypeError(f"a_tmp dtype = {np.dtype(a_tmp.dtype)} must equal the activation dtype")
        if _numel(a_tmp) < plan.m * plan.k:
            raise ValueError(f"a_tmp.numel = {_numel(a_tmp)} is below size_m * size_k = {plan.m * plan.k}")
