"""The microscaled formats (NVFP4, MXFP4, MXFP8) in an expert stack: which format a stack is, by the dense GEMM's
rules (``workbench.gemm.checks``' ``MICROSCALE_RULES``: one place says which (weight, scale type, group, activation,
global scale) combinations the kernels run), and NVFP4's per-expert global scales. Pure: no GPU.

A stack's format comes from its arrays as the dense GEMM reads a layer's (``scale_type_of``): ``scales`` in the
activation type are the integer / FP8 formats; uint8 scale bytes of fe2m1f weights are NVFP4's S0E5M3 bytes where a
global scale is given or the group is 16, else MXFP4's E8M0 codes; uint8 scales of fe4m3fn weights are MXFP8's E8M0
codes. NVFP4 takes one fp32 global scale per expert (vLLM's Marlin MoE: ``global_scale`` [E]), each with the
kernel's exponent correction folded in (``ops.nvfp4_marlin_global_scale``); the kernel multiplies an item's fp32
sums by its expert's before the bias (kernels_cuda/marlin_moe.cu).
"""
from __future__ import annotations

import numpy as np

from workbench.gemm import act_scalar_type, check_groups
from workbench.gemm.checks import MicroscaleRule, check_microscale, microscale_rule, scale_type_of


def _shape(x) -> tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


def check_expert_global_scale(global_scale, num_experts: int) -> None:
    """NVFP4's global scales of a stack: float32, one per expert ([E] or [E, 1]), contiguous."""
    shape = _shape(global_scale)
    if np.dtype(global_scale.dtype) != np.float32 or shape not in ((num_experts,), (num_experts, 1)):
        raise ValueError(f"global_scale of an expert stack must be float32 with one value per expert, [E] or [E, 1] "
                         f"for E = {num_experts}; got dtype {np.dtype(global_scale.dtype)} and shape {shape}")
    flags = getattr(global_scale, "flags", None)
    if flags is not None and not flags["C_CONTIGUOUS"]:
        raise ValueError("global_scale is not contiguous")


def stack_format(weight, has_global_scale: bool) -> tuple[MicroscaleRule | None, int]:
    """(the stack's microscaled format or None, its group size) by the dense rules; ValueError / TypeError naming
    the values for a combination the kernels do not run (the format's fixed group, its activation types, its global
    scale, act-order)."""
    act = act_scalar_type(weight.act_dtype)
    wt = weight.weight_type
    k = int(weight.size_k)
    ng = _shape(weight.scales)[1] if len(_shape(weight.scales)) == 3 else 0
    tentative = k // ng if ng and k % ng == 0 else 0
    scale = scale_type_of(weight.scales, wt, act, has_global_scale, tentative)
    rule = microscale_rule(wt, scale, act)
    if rule is None:
        check_microscale(wt, scale, act, tentative, has_global_scale, weight.has_act_order)  # (refuses a global scale)
        return None, tentative
    if len(_shape(weight.scales)) != 3:
        raise ValueError(f"{rule.name} expert scales must be [E, K / {rule.group_size}, N_pad] bytes, got shape "
                         f"{_shape(weight.scales)}")
    group = check_groups(wt, k, ng, False, True, "scales.size(1)", microscaled=True)
    try:
        check_microscale(wt, scale, act, group, has_global_scale, weight.has_act_order, int(weight.size_n))
    except ValueError as err:
        if rule.global_scale and not has_global_scale:
            raise ValueError(f"{rule.name} expert stack needs global_scale: float32 [E = {weight.num_experts}], one "
                             f"per expert with the kernel's exponent correction (ops.nvfp4_marlin_global_scale); "
                             f"the dense rule: {err}") from None
        raise
    return rule, group


def check_stack(weight, global_scale) -> tuple[MicroscaleRule | None, object]:
    """A stack's format and its checked global scales (None unless NVFP4)."""
    rule, _ = stack_format(weight, global_scale is not None)
    if global_scale is not None:
        check_expert_global_scale(global_scale, int(weight.num_experts))
    return rule, global_scale


# ---------------------------------------------------------------------------------------------------------------
# building microscaled stacks from checkpoint-layout tensors (host, NumPy): the dense layer's ops, per expert
# ---------------------------------------------------------------------------------------------------------------
def _dequantize_f32(f, elements, scales, global_scale) -> np.ndarray:
    """One expert's values [N, K] in float32 by broadcasting (no float64 copies): exact for the MX formats (a power
    of two times an element); NVFP4's e2m1 · e4m3 · fp32 global rounds once (relative 2^-24)."""
    from workbench.formats import microscale as ms

    if f.element_bits == 4:
        vals = ms.E2M1_VALUES[ms.unpack_fp4(elements)]
    else:
        vals = np.asarray(elements).view(np.uint8).view(ms.E4M3).astype(np.float32)
    n, k = vals.shape
    if f.name == "nvfp4":
        s = ms.e4m3_value(scales).astype(np.float32) * np.float32(global_scale)
    else:
        s = np.ldexp(np.float32(1), np.asarray(scales).view(np.uint8).astype(np.int32) - ms.E8M0_BIAS)
    return (vals.reshape(n, k // f.group_size, f.group_size) * s[:, :, None]).reshape(n, k)


def microscale_expert_stack(fmt: str, elements, scales, global_scale, size_k: int, size_n: int, act_dtype, *,
                            backend: str = "numpy", ref_dtype=np.float64):
    """E experts' checkpoint tensors (rows = output features, as every producer writes them) -> (stacked
    ``MarlinWeight`` on the host, the kernel's per-expert global scales [E] float32 or None, the exact weights
    w_ref [E, K, N] float64).

    ``fmt``: "nvfp4" (``elements`` packed E2M1 bytes [E, N, K/2], ``scales`` E4M3 bytes [E, N, K/16],
    ``global_scale`` [E] fp32 = ModelOpt's weight_scale_2, value = e2m1 · scale · global), "mxfp4" (packed E2M1
    [E, N, K/2], E8M0 codes [E, N, K/32], no global scale) or "mxfp8" (E4M3 bytes [E, N, K], E8M0 codes). Each expert
    goes through the dense layer's ops (``ops.fp4_marlin_repack`` / ``mxfp8_marlin_repack``, ``nvfp4_marlin_scales`` /
    ``mx_marlin_scales``, ``nvfp4_marlin_global_scale`` with the expert's own scale factor), so an expert of the stack
    is bit for bit the dense layer of the same tensors. ``ref_dtype`` float32: w_ref by a faster float32 dequantizer
    (exact for MX; NVFP4 rounded once, relative 2^-24); None: no w_ref (returned as None).
    """
    from workbench import ops
    from workbench.formats import microscale as ms
    from workbench.formats._checks import require
    from workbench.scalar_types import ScalarType
    from workbench.weight import MarlinWeight

    f = ms.microscale_format(fmt)
    act = np.dtype(act_dtype)
    require(act in f.act_dtypes, f"{f.name} runs with {' or '.join(d.name for d in f.act_dtypes)} activations in "
            f"Marlin (as vLLM), got {act.name}")
    elements, scales = np.asarray(elements), np.asarray(scales)
    require(elements.ndim == 3 and scales.ndim == 3 and elements.shape[0] == scales.shape[0],
            f"elements {elements.shape} and scales {scales.shape} must be [E, N, ...] stacks of the same E")
    e = elements.shape[0]
    require(e > 0, "an expert stack needs at least one expert")
    if f.has_global_scale:
        require(global_scale is not None, f"{f.name} needs a global scale per expert ([E = {e}] float32)")
        g = np.asarray(global_scale, np.float32).reshape(-1)
        require(g.shape == (e,), f"global_scale has {g.size} values, expected one per expert (E = {e})")
    else:
        require(global_scale is None, f"{f.name} has no global scale; global_scale must be None")
    qweights, marlin_scales, gs, refs = [], [], [], []
    for i in range(e):
        if f.name == "nvfp4":
            qweights.append(ops.fp4_marlin_repack(elements[i], size_k, size_n, backend=backend))
            s, sf = ops.nvfp4_marlin_scales(scales[i], size_k, size_n, act, backend=backend)
            marlin_scales.append(np.ascontiguousarray(s).view(np.uint8))
            gs.append(ops.nvfp4_marlin_global_scale(g[i], act, sf))
            if ref_dtype is not None:
                refs.append((ms.dequantize_nvfp4(elements[i], scales[i], g[i]) if np.dtype(ref_dtype) == np.float64
                             else _dequantize_f32(f, elements[i], scales[i], g[i])).T)
        else:
            repack = ops.fp4_marlin_repack if f.name == "mxfp4" else ops.mxfp8_marlin_repack
            qweights.append(repack(elements[i], size_k, size_n, backend=backend))
            marlin_scales.append(np.ascontiguousarray(
                ops.mx_marlin_scales(scales[i], size_k, size_n, f.name, backend=backend)).view(np.uint8))
            if ref_dtype is not None:
                refs.append((ms.dequantize_mx(elements[i], scales[i], f.name) if np.dtype(ref_dtype) == np.float64
                             else _dequantize_f32(f, elements[i], scales[i], None)).T)
    wt = ScalarType.FE4M3FN if f.name == "mxfp8" else ScalarType.FE2M1F
    weight = MarlinWeight(np.stack(qweights), np.stack(marlin_scales), None, None, None, int(size_k), int(size_n),
                          f.group_size, wt, act, True, num_experts=e)
    return weight, (np.array(gs, np.float32) if f.has_global_scale else None), \
        (np.stack(refs) if ref_dtype is not None else None)


def random_microscale_experts(fmt: str, num_experts: int, size_k: int, size_n: int, rng, *, scale_log2: int = -5):
    """Random checkpoint-layout tensors of one format (elements, scales, global scale or None), each value drawn
    directly (no quantizer: fast at gpt-oss-like shapes): every E2M1 code / finite E4M3 byte, scales around
    2^scale_log2 (E8M0 codes scale_log2 + 127 + {-1, 0, 1}; NVFP4: E4M3 block scales in [0.5, 2] and global
    2^scale_log2), so that K random products sum to a few units."""
    from workbench.formats import microscale as ms

    f = ms.microscale_format(fmt)
    e, n, k = num_experts, size_n, size_k
    if f.element_bits == 4:
        elements = rng.integers(0, 256, size=(e, n, k // 2), dtype=np.uint8)
    else:  # E4M3 bytes without the NaNs (0x7F, 0xFF) and capped at 2^4 magnitude (exponent field <= 10)
        mag = rng.integers(0, 0x58, size=(e, n, k), dtype=np.uint8)
        elements = mag | (rng.integers(0, 2, size=(e, n, k), dtype=np.uint8) << 7)
    groups = k // f.group_size
    if f.name == "nvfp4":
        # E4M3 bytes 0x30..0x40: 0.5 .. 2.0 (exponent field 6..8)
        scales = rng.integers(0x30, 0x41, size=(e, n, groups), dtype=np.uint8)
        return elements, scales, np.full(e, 2.0 ** scale_log2, np.float32) * rng.uniform(0.75, 1.25, e).astype(
            np.float32)
    delta = -3 if f.element_bits == 8 else 0  # (E4M3 elements reach 16 here, E2M1 6)
    codes = rng.integers(-1, 2, size=(e, n, groups)) + 127 + scale_log2 + delta
    return elements, codes.astype(np.uint8), None
