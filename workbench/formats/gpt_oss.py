"""gpt-oss's MoE experts as NumPy references (docs/formats.md, "gpt-oss experts").

E experts, hidden size H, intermediate size I. The checkpoint (transformers' GptOss layout, MXFP4):

    gate_up_proj_blocks U8 [E, 2I, H/32, 16]   gate_up_proj_scales U8 [E, 2I, H/32]   gate_up_proj_bias [E, 2I]
    down_proj_blocks    U8 [E, H, I/32, 16]    down_proj_scales    U8 [E, H, I/32]    down_proj_bias    [E, H]

Rows are output features; the 16 bytes of a block are one group of 32 E2M1 codes (element 2j in the low nibble),
its scale an E8M0 code. ``gate_up`` interleaves: row 2i is the gate of intermediate feature i, row 2i + 1 its up.

One expert on a token x (the activation transformers and vLLM call the clamped "swiglu" / "swigluoai"):

    h = W_gu · x + b_gu;   g, u = h[0::2], h[1::2]
    g = min(g, limit);     u = clip(u, -limit, limit)
    a = (u + 1) · g · sigmoid(alpha · g)            alpha = 1.702, limit = config.json swiglu_limit (7.0)
    y = W_d · a + b_d

The router is a biased linear layer; each token takes its top-k logits and softmaxes over those k.
"""
from __future__ import annotations

import numpy as np

from workbench.formats._checks import require
from workbench.formats.microscale import dequantize_mx

ALPHA = 1.702
LIMIT = 7.0
BLOCK_BYTES = 16  # one group of 32 E2M1 codes


def dequantize_stack(blocks, scales) -> np.ndarray:
    """[E, N, K/32, 16] blocks and [E, N, K/32] E8M0 codes -> exact float64 weights [E, N, K]."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    require(blocks.ndim == 4 and blocks.shape[3] == BLOCK_BYTES and blocks.shape[:3] == scales.shape,
            f"blocks {blocks.shape} and scales {scales.shape} are not [E, N, K/32, 16] and [E, N, K/32]")
    e, n, g, _ = blocks.shape
    return np.stack([dequantize_mx(blocks[i].reshape(n, g * BLOCK_BYTES), scales[i], "mxfp4") for i in range(e)])


def swiglu_oai(h, alpha: float = ALPHA, limit: float = LIMIT) -> np.ndarray:
    """[..., 2I] interleaved gate/up pre-activations -> [..., I]."""
    h = np.asarray(h, dtype=np.float64)
    require(h.shape[-1] % 2 == 0, f"gate_up has {h.shape[-1]} features; gate and up interleave, so it must be even")
    gate = np.minimum(h[..., 0::2], limit)
    up = np.clip(h[..., 1::2], -limit, limit)
    return (up + 1) * gate / (1 + np.exp(-alpha * gate))


def route(logits, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """[T, E] router logits -> (weights [T, k], expert ids [T, k]): the k largest (ties: lower expert first), softmax
    over those k."""
    logits = np.asarray(logits, dtype=np.float64)
    require(0 < top_k <= logits.shape[-1], f"top_k = {top_k} is not in 1..{logits.shape[-1]} (experts)")
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]
    picked = np.take_along_axis(logits, ids, axis=-1)
    weights = np.exp(picked - picked.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True), ids


def moe_forward(x, router_w, router_b, w_gate_up, b_gate_up, w_down, b_down, top_k: int, alpha: float = ALPHA,
                limit: float = LIMIT) -> np.ndarray:
    """The expert block on tokens x [T, H]: route, run each token's k experts, sum weighted. float64 throughout.

    ``w_gate_up`` [E, 2I, H] (interleaved rows), ``b_gate_up`` [E, 2I], ``w_down`` [E, H, I], ``b_down`` [E, H],
    ``router_w`` [E, H], ``router_b`` [E].
    """
    x = np.asarray(x, dtype=np.float64)
    weights, ids = route(x @ np.asarray(router_w, np.float64).T + np.asarray(router_b, np.float64), top_k)
    out = np.zeros_like(x)
    for slot in range(top_k):
        for e in np.unique(ids[:, slot]):
            rows = ids[:, slot] == e
            h = x[rows] @ np.asarray(w_gate_up[e], np.float64).T + np.asarray(b_gate_up[e], np.float64)
            y = swiglu_oai(h, alpha, limit) @ np.asarray(w_down[e], np.float64).T + np.asarray(b_down[e], np.float64)
            out[rows] += weights[rows, slot, None] * y
    return out
