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
        check_microscale(wt, scale, act, group, has_global_scale, weight.has_act_order)
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
