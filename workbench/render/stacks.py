"""Pictures of act-order (g_idx -> perm) and of stacked MoE expert buffers."""
from __future__ import annotations

import numpy as np

from workbench.formats.gptq import sort_g_idx
from workbench.quantize import act_order_g_idx
from workbench.render._draw import HTML, html_table, new_figure
from workbench.weight import MarlinWeight


def render_act_order(size_k: int = 64, group_size: int = 16, seed: int = 0):
    """g_idx in checkpoint order (groups scattered), the perm that sorts it, and g_idx in Marlin row order."""
    if size_k % group_size:
        raise ValueError(f"size_k = {size_k} is not divisible by group_size = {group_size}")
    g_idx = act_order_g_idx(size_k, group_size, np.random.default_rng(seed))
    g_sorted, perm = sort_g_idx(g_idx)
    groups = size_k // group_size
    fig, axes = new_figure(12, 3.6, nrows=3)
    for ax, values, title in ((axes[0], g_idx, "g_idx[k] in checkpoint row order: each group's rows are scattered"),
                              (axes[1], g_idx[perm], "after perm = stable argsort(g_idx): Marlin row k holds "
                                                     "checkpoint row perm[k]"),
                              (axes[2], g_sorted, "g_idx_sorted: every group is a contiguous run of group_size rows")):
        ax.imshow(values[None, :], cmap="tab10", vmin=0, vmax=max(groups - 1, 1), aspect="auto",
                  interpolation="nearest")
        ax.set_yticks([])
        ax.set_title(title, fontsize=9)
    axes[1].set_xticks(range(0, size_k, max(1, size_k // 16)))
    axes[1].set_xticklabels([str(int(p)) for p in perm[::max(1, size_k // 16)]], fontsize=7)
    axes[2].set_xlabel("row k")
    return fig


def expert_stack_html(weight: MarlinWeight) -> HTML:
    """Every buffer of a stacked MarlinWeight: shape, and where expert e starts (offset e · stride, in elements)."""
    if weight.num_experts is None:
        raise ValueError("expert_stack_html needs a stacked MarlinWeight (num_experts set)")
    rows = []
    for name in ("qweight", "scales", "zeros", "g_idx", "perm"):
        buf = getattr(weight, name)
        if buf is None:
            rows.append((name, "—", "—", "—"))
            continue
        stride = int(np.prod(buf.shape[1:]))
        rows.append((name, f"{tuple(buf.shape)} {buf.dtype}", f"{stride} elements = {stride * buf.itemsize} bytes",
                     ", ".join(str(e * stride) for e in range(weight.num_experts))))
    return HTML(html_table(["buffer", "shape", "expert stride", "expert offsets"], rows,
                           caption=f"{weight.num_experts} experts, {weight.weight_type}, K={weight.size_k}, "
                                   f"N={weight.size_n}, group_size={weight.group_size}"))


def render_expert_stack(weight: MarlinWeight):
    """The flat qweight buffer of a stack, coloured by expert: expert e is the slice [e·stride, (e+1)·stride)."""
    if weight.num_experts is None:
        raise ValueError("render_expert_stack needs a stacked MarlinWeight (num_experts set)")
    flat = np.asarray(weight.qweight).reshape(weight.num_experts, -1)
    stride = flat.shape[1]
    owner = np.repeat(np.arange(weight.num_experts), stride)
    fig, (ax,) = new_figure(12, 1.6)
    ax.imshow(owner[None, :], cmap="tab10", aspect="auto", interpolation="nearest")
    for e in range(weight.num_experts):
        ax.text(e * stride + stride / 2, 0, f"expert {e}\n[{e * stride}, {(e + 1) * stride})", ha="center",
                va="center", fontsize=8)
    ax.set_yticks([])
    ax.set_xlabel("flat int32 index into qweight")
    ax.set_title("stacked experts: one buffer, expert e at offset e · stride (each slice is a complete Marlin weight)",
                 fontsize=9)
    return fig
