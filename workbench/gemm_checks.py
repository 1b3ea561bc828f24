"""The dense Marlin GEMM's rules, each with its one message: ``workbench.gemm``'s array checks
(``check_gemm_shapes``), its record checks (``check_launch``, the launch record of docs/formats.md, "Launch record")
and a prepared launch's address checks (``PreparedLaunch.launch``) all call these, so a rule and its wording exist once.

Pure Python, no GPU: every function raises ValueError naming the values that broke the rule, or returns None.
"""
from __future__ import annotations

from workbench.scalar_types import ScalarType

TILE_N = 64  # Marlin tile width: the weight's columns come in 64-column tiles
TILE_K = 16  # the tensor-core k16 step: the weight's rows come in 16-row tiles
GROUP_SIZES = (32, 64, 128)  # grouped scales the kernel stages per pipeline step

# The pointers of a launch that must be 16-byte aligned (null counts as aligned), in the record's order.
ALIGNED_POINTERS = ("a", "b", "c", "c_tmp", "b_scales", "zero_points", "group_index", "permutation", "a_tmp")
# The pointers every launch needs.
REQUIRED_POINTERS = ("a", "b", "c", "b_scales", "workspace")


def check_mnk(m: int, n: int, k: int) -> None:
    if m < 0 or n <= 0 or k <= 0:
        raise ValueError(f"Invalid MNK = [{m}, {n}, {k}]")


def check_size_k(k: int) -> None:
    """K comes in k16 tiles."""
    if k % TILE_K:
        raise ValueError(f"size_k = {k} is not divisible by tile_size = {TILE_K}")


def check_size_n(n: int) -> None:
    """N comes in 64-column tiles."""
    if n % TILE_N:
        raise ValueError(f"size_n = {n} is not divisible by min_thread_n = {TILE_N}")


def check_sizes(m: int, n: int, k: int) -> None:
    check_mnk(m, n, k)
    check_size_k(k)
    check_size_n(n)


def check_row_stride(lda: int, k: int, name: str) -> None:
    """A's rows: at least K elements apart and 16-byte aligned (the kernel fetches 16-byte words)."""
    if lda < k or lda % 8:
        raise ValueError(f"{name} = {lda} must be >= size_k = {k} and divisible by 8 (16-byte rows)")


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
                 groups_name: str = "num_groups") -> int:
    """num_groups divides K into groups of GROUP_SIZES rows (any size on a K shard of act-order groups); fe4m3fn
    weights take channelwise or group-128 scales. Returns the group size (-1: channelwise). ``groups_name``: what
    the caller calls num_groups (``b_scales.size(0)`` for arrays)."""
    if num_groups <= 0 or k % num_groups:
        raise ValueError(f"size_k = {k}, is not divisible by {groups_name} = {num_groups}")
    group_size = -1 if num_groups == 1 else k // num_groups
    if num_groups > 1 and not (act_order and not is_k_full) and group_size not in GROUP_SIZES:
        raise ValueError(f"group size = size_k / num_groups = {k} / {num_groups} = {group_size} is not one of "
                         f"{GROUP_SIZES} (or channelwise)")
    if weight is ScalarType.FE4M3FN and num_groups > 1 and group_size != 128:
        raise ValueError(f"fe4m3fn weights take channelwise or group-128 scales, got group size {group_size}")
    return group_size


def check_reduction(use_atomic_add: bool, deterministic: bool) -> None:
    if use_atomic_add and deterministic:
        raise ValueError("use_atomic_add cannot be deterministic: atomics sum in arrival order")


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
