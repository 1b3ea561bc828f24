"""The NumPy spec of an MoE layer (``moe_reference``: fp32 math on the exact dequantized weights, rounded to the
activation type where the kernels write activations) and the per-element tolerance those roundings imply
(``moe_error_bound``). No GPU."""
from __future__ import annotations

import numpy as np

from workbench.gemm import UNIT_ROUNDOFF, error_bound_factor
from workbench.moe.activation import SWIGLU_GATE_LIPSCHITZ, activation_of


def _round(x: np.ndarray, act: np.dtype) -> np.ndarray:
    """fp32 -> activation type -> fp32: where a kernel writes an activation-typed value."""
    return np.asarray(x, dtype=np.float32).astype(act).astype(np.float32)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _check_routing(hidden: np.ndarray, w13_ref: np.ndarray, w2_ref: np.ndarray, topk_weights, topk_ids,
                   expert_map=None):
    hidden = np.asarray(hidden)
    topk_ids = np.asarray(topk_ids)
    topk_weights = np.asarray(topk_weights, dtype=np.float32)
    if hidden.ndim != 2:
        raise ValueError(f"hidden must be 2-D (M, K), got shape {hidden.shape}")
    m, k = hidden.shape
    if w13_ref.ndim != 3 or w13_ref.shape[1] != k or w13_ref.shape[2] % 2:
        raise ValueError(f"w13_ref has shape {w13_ref.shape}, expected (E, K = {k}, 2N)")
    e, _, n2 = w13_ref.shape
    if w2_ref.shape != (e, n2 // 2, k):
        raise ValueError(f"w2_ref has shape {w2_ref.shape}, expected (E, N, K) = {(e, n2 // 2, k)}")
    if topk_ids.ndim != 2 or topk_ids.shape[0] != m or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {topk_ids.shape} and topk_weights {topk_weights.shape} must both be "
                         f"(M = {m}, top_k)")
    local = topk_ids.astype(np.int64)
    if expert_map is not None:
        emap = np.asarray(expert_map)
        valid = (local >= 0) & (local < emap.shape[0])
        local = np.where(valid, emap[np.clip(local, 0, emap.shape[0] - 1)], -1)
    local = np.where((local >= 0) & (local < e), local, -1)
    return hidden, topk_weights, local


def _biases(w13_bias, w2_bias, e: int, n2: int, k: int):
    """The per-expert biases as float32 [E, 2N] / [E, K] (zeros where None), shapes checked."""
    out = []
    for name, b, width in (("w13_bias", w13_bias, n2), ("w2_bias", w2_bias, k)):
        if b is None:
            out.append(np.zeros((e, width), np.float32))
            continue
        b = np.asarray(b)
        if b.shape != (e, width):
            raise ValueError(f"{name} has shape {b.shape}, expected (E, {width}) = {(e, width)}")
        out.append(b.astype(np.float32))
    return out


def moe_reference(hidden, w13_ref, w2_ref, topk_weights, topk_ids, act_dtype=None, expert_map=None, w13_bias=None,
                  w2_bias=None, activation=None) -> np.ndarray:
    """The MoE layer in NumPy: ``out[t] = Σ_j w[t, j] · (silu(g) · u)(hidden[t] @ W13[e]) @ W2[e]``, e = ids[t, j].

    hidden [M, K] (fp16/bf16), w13_ref [E, K, 2N] and w2_ref [E, N, K] float32 exact dequantized weights
    (``QuantizedWeight.w_ref``; gate = the first N columns of W13, up = the last N), topk_weights [M, top_k]
    float32, topk_ids [M, top_k] int. Entries whose expert is not local (``expert_map`` gives -1, or the id is out
    of range) contribute nothing. Rounded to the activation type where the kernels write activations:

      g = rnd(hidden @ W13[e] + b13[e])   GEMM 1 writes its C (the bias added in its epilogue, before the rounding)
      h = rnd(silu(g_gate) · g_up)        the activation kernel writes its output (fp32 math inside)
      y = rnd(w · (h @ W2[e] + b2[e]))    GEMM 2 adds the bias, multiplies by the router weight in fp32, writes C
      out = rnd(Σ_j y_j)                  the top-k sum adds in fp32, then writes

    ``w13_bias`` [E, 2N] / ``w2_bias`` [E, K]: per-expert biases (the seed's expert-linear bias, gpt-oss's), None = 0.
    ``activation``: workbench.moe.activation's (None: SiLU; "swigluoai" / ``Activation("swigluoai", alpha, limit)``:
    gpt-oss's clamped SwiGLU on the de-interleaved gate | up halves), computed in float64, then rounded.
    """
    act_fn = activation_of(activation)
    hidden, weights, local = _check_routing(hidden, np.asarray(w13_ref), np.asarray(w2_ref), topk_weights,
                                            topk_ids, expert_map)
    act = np.dtype(act_dtype or hidden.dtype)
    a = hidden.astype(np.float32)
    m, top_k = local.shape
    n = w2_ref.shape[1]
    b13, b2 = _biases(w13_bias, w2_bias, w13_ref.shape[0], 2 * n, hidden.shape[1])
    total = np.zeros((m, hidden.shape[1]), np.float32)
    for e in np.unique(local[local >= 0]):
        rows, slots = np.nonzero(local == e)
        g = _round(a[rows] @ w13_ref[e] + b13[e], act)
        h = _round(act_fn.reference(g), act)
        y = _round(weights[rows, slots, None] * (h @ w2_ref[e] + b2[e]), act)
        np.add.at(total, rows, y)
    return total.astype(act)



def moe_error_bound(hidden, w13_ref, w2_ref, topk_weights, topk_ids, act_dtype=None, expert_map=None, w13_bias=None,
                    w2_bias=None, activation=None, gemm_extra: float = 0.0) -> np.ndarray:
    """Per-element bound on |kernel - moe_reference| (float32 [M, K]), derived from where each side rounds.

    With u the activation type's unit roundoff and a GEMM's error <= (2u + K·2^-22)·(|A| @ |W|)
    (error_bound_factor: one output rounding, one for the weight rounding that the reference makes and a kernel
    scaling fp32 partial sums does not, and fp32 tensor-core accumulation that drops low bits when aligning products):
      δg  <= e1 = (2u + K·2^-22)·(|a| @ |W13|)
      δh  <= |silu'(g_gate)|·δg_gate·|g_up| + |silu(g_gate)|·δg_up + u·|h|        (SiLU-and-mul, one rounding)
      δy  <= |w|·(δh @ |W2| + (2u + N·2^-22)·(|h| @ |W2|))                     (GEMM 2, router weight in fp32)
      δout <= Σ_j δy_j + 2u·Σ_j |y_j|                    (a path that rounds y before weighting adds one more u)
    With biases (``moe_reference``'s), each GEMM's rounding also covers its bias: + u·|b| in δg and δy.
    The clamped SwiGLU (``activation`` "swigluoai"): a = (u' + 1)·f(g'), f(g) = g·sigmoid(alpha g), g' = min(g, l),
    u' = clip(u, ±l); min and clip are 1-Lipschitz and |f'| <= 1.1 everywhere, so
      δh  <= 1.1·δg_gate·(|u' + 1| + δg_up) + |f(g')|·δg_up + u·|h|.
    ``gemm_extra``: a relative error each GEMM adds beyond error_bound_factor (NVFP4's fp32 global-scale multiply of
    the fp32 sums: 2^-22 covers its one rounding).
    Both the kernel and the reference carry such an error, so the bound is doubled.
    """
    act_fn = activation_of(activation)
    hidden, weights, local = _check_routing(hidden, np.asarray(w13_ref), np.asarray(w2_ref), topk_weights,
                                            topk_ids, expert_map)
    act = np.dtype(act_dtype or hidden.dtype)
    u = UNIT_ROUNDOFF[act.name]
    a = np.abs(hidden.astype(np.float32))
    k = hidden.shape[1]
    n = w2_ref.shape[1]
    b13, b2 = _biases(w13_bias, w2_bias, w13_ref.shape[0], 2 * n, k)
    bound = np.zeros((hidden.shape[0], k), np.float32)
    for e in np.unique(local[local >= 0]):
        rows, slots = np.nonzero(local == e)
        g = hidden[rows].astype(np.float32) @ w13_ref[e] + b13[e]
        e1 = (error_bound_factor(act, k) + gemm_extra) * (a[rows] @ np.abs(w13_ref[e])) + u * np.abs(b13[e])
        gate, up = g[:, :n], g[:, n:]
        if act_fn.name == "silu":
            sig = 1.0 / (1.0 + np.exp(-gate))
            dsilu = np.abs(sig * (1.0 + gate * (1.0 - sig)))
            h = np.abs(_silu(gate) * up)
            dh = dsilu * e1[:, :n] * (np.abs(up) + e1[:, n:]) + np.abs(_silu(gate)) * e1[:, n:] + u * h
        else:
            gc = np.minimum(gate, act_fn.limit)
            uc = np.clip(up, -act_fn.limit, act_fn.limit)
            f = np.abs(gc / (1.0 + np.exp(-act_fn.alpha * gc)))
            h = np.abs(act_fn.reference(g)).astype(np.float32)
            dh = SWIGLU_GATE_LIPSCHITZ * e1[:, :n] * (np.abs(uc + 1) + e1[:, n:]) + f * e1[:, n:] + u * h
        w2 = np.abs(w2_ref[e])
        w = np.abs(weights[rows, slots, None])
        dy = w * ((dh @ w2) + (error_bound_factor(act, n) + gemm_extra) * (h @ w2) + u * np.abs(b2[e]))
        y = w * (h @ w2 + np.abs(b2[e]))
        np.add.at(bound, rows, dy + 2 * u * y)
    return 2 * bound + np.float32(1e-30)

