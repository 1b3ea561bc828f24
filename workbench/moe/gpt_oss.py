"""gpt-oss's experts on the fused Marlin MoE: its MXFP4 checkpoint tensors -> two expert stacks with their biases,
the de-interleaved gate_up, the clamped SwiGLU and the top-k-softmax router (workbench.formats.gpt_oss is the
NumPy reference this must match; docs/formats.md, "gpt-oss experts on the fused MoE").

Where the de-interleave happens: once, here, when the stacks are built. gpt-oss's ``gate_up_proj`` rows interleave
(row 2i the gate of intermediate feature i, row 2i + 1 its up); the MoE's activation kernels read a gate_up row as
``[gate (I columns) | up (I columns)]`` (as vLLM's Marlin MoE w13 and every other MoE checkpoint). A permutation of
the output features is a permutation of the checkpoint's rows — of the blocks, of their E8M0 scales (one per row
and group) and of the bias alike — so it is applied to those three tensors before the Marlin repack
(``gate_up_permutation``): nothing is permuted per call, and the kernels are the same as every other stack's.
(vLLM instead keeps the interleave in the weight and reads it in its ``swigluoai_and_mul``; the two give the same
numbers, since the GEMM's columns are independent.)
"""
from __future__ import annotations

import numpy as np

from workbench.formats._checks import require
from workbench.moe.activation import GPT_OSS_ALPHA, GPT_OSS_LIMIT, Activation

BLOCK_BYTES = 16  # one group of 32 E2M1 codes


def gate_up_permutation(n2: int) -> np.ndarray:
    """The row order that de-interleaves gpt-oss's gate_up: new row j is checkpoint row perm[j], gates (even rows)
    first, then ups (odd rows). Its inverse is ``np.argsort(perm)``."""
    require(isinstance(n2, (int, np.integer)) and n2 > 0 and n2 % 2 == 0,
            f"gate_up has {n2} rows; gate and up interleave, so it must be a positive even count")
    return np.concatenate([np.arange(0, n2, 2), np.arange(1, n2, 2)])


def deinterleave_gate_up(x, axis: int = 1) -> np.ndarray:
    """gpt-oss's interleaved gate_up rows along ``axis`` (1 for [E, 2I, ...] blocks, scales and bias) ->
    gates first, then ups (a copy)."""
    x = np.asarray(x)
    return np.take(x, gate_up_permutation(x.shape[axis]), axis=axis)


def _mxfp4_stack(blocks, scales, name: str):
    """gpt-oss's [E, N, K/32, 16] blocks and [E, N, K/32] codes -> ([E, N, K/2] packed bytes, codes, K, N)."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    require(blocks.ndim == 4 and blocks.shape[3] == BLOCK_BYTES and blocks.shape[:3] == scales.shape,
            f"{name}: blocks {blocks.shape} and scales {scales.shape} are not [E, N, K/32, 16] and [E, N, K/32]")
    require(blocks.dtype == np.uint8, f"{name}_blocks dtype {blocks.dtype} is not uint8")
    e, n, g, _ = blocks.shape
    return blocks.reshape(e, n, g * BLOCK_BYTES), scales.view(np.uint8), g * 32, n


def gpt_oss_expert_weights(gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias, *,
                           act_dtype=None, backend: str = "numpy"):
    """gpt-oss's expert tensors (transformers' GptOss layout, see workbench.formats.gpt_oss) -> host
    ``(w13, b13, w2, b2)``: the gate_up stack de-interleaved (``gate_up_permutation`` on its blocks, scales and bias)
    and the down stack, as MXFP4 ``MarlinWeight`` stacks (bf16), the biases [E, 2I] / [E, H] in bf16."""
    import ml_dtypes

    from workbench.moe.microscale import microscale_expert_stack

    act = np.dtype(act_dtype or ml_dtypes.bfloat16)
    gu, gu_s, h, n2 = _mxfp4_stack(gate_up_blocks, gate_up_scales, "gate_up_proj")
    dn, dn_s, inter, h_out = _mxfp4_stack(down_blocks, down_scales, "down_proj")
    e = gu.shape[0]
    require(dn.shape[0] == e, f"gate_up_proj has {e} experts, down_proj {dn.shape[0]}")
    require(n2 == 2 * inter and h_out == h, f"gate_up_proj is [E, {n2}, {h}] and down_proj [E, {h_out}, {inter}]: "
            f"expected [E, 2I, H] and [E, H, I]")
    biases = []
    for name, b, width in (("gate_up_proj_bias", gate_up_bias, n2), ("down_proj_bias", down_bias, h)):
        b = np.zeros((e, width), np.float32) if b is None else np.asarray(b, np.float32)
        require(b.shape == (e, width), f"{name} has shape {b.shape}, expected {(e, width)}")
        biases.append(b)
    perm = gate_up_permutation(n2)
    w13, _, _ = microscale_expert_stack("mxfp4", np.ascontiguousarray(gu[:, perm]),
                                        np.ascontiguousarray(gu_s[:, perm]), None, h, n2, act, backend=backend,
                                        ref_dtype=None)
    w2, _, _ = microscale_expert_stack("mxfp4", dn, dn_s, None, inter, h, act, backend=backend, ref_dtype=None)
    # (contiguous: a column-indexed copy may come back in another order, and a stack's bias rows must be contiguous)
    return w13, np.ascontiguousarray(biases[0][:, perm].astype(act)), w2, np.ascontiguousarray(biases[1].astype(act))


def deinterleave_marlin_stack(weight):
    """A loaded gpt-oss gate_up stack (workbench.load's MicroscaleMarlinWeight with ``gate_up = "interleaved"``:
    the repacked checkpoint keeps gpt-oss's row order, as vLLM's) -> the same stack with its output features
    de-interleaved, on the host: each expert's Marlin tiles and E8M0 scales unpacked to the checkpoint layout
    (``ops.marlin_to_fp4``, ``ops.marlin_to_mx_scales``), rows permuted by ``gate_up_permutation``, repacked. Load
    time only; its bias (a separate tensor) takes ``deinterleave_gate_up``."""
    import dataclasses

    from workbench import ops

    require(getattr(weight, "microscale", "") == "mxfp4" and weight.num_experts is not None,
            f"deinterleave_marlin_stack takes an MXFP4 expert stack, got microscale = "
            f"{getattr(weight, 'microscale', None)!r} with num_experts = {weight.num_experts}")
    require(getattr(weight, "gate_up", "") == "interleaved", "the stack's gate_up is not marked interleaved")
    k, n = int(weight.size_k), int(weight.size_n)
    perm = gate_up_permutation(n)
    qweights, scales = [], []
    for e in range(int(weight.num_experts)):
        packed = ops.marlin_to_fp4(np.asarray(weight.qweight[e]), k, n, backend="numpy")[perm]
        codes = np.asarray(ops.marlin_to_mx_scales(np.asarray(weight.scales[e]), k, n, "mxfp4", backend="numpy"))
        qweights.append(ops.fp4_marlin_repack(packed, k, n, backend="numpy"))
        scales.append(np.ascontiguousarray(ops.mx_marlin_scales(codes.view(np.uint8)[perm], k, n, "mxfp4",
                                                                backend="numpy")).view(np.uint8))
    return dataclasses.replace(weight, qweight=np.stack(qweights), scales=np.stack(scales), gate_up="")


def route_topk_softmax(logits, top_k: int):
    """The gpt-oss router on the device: each token's ``top_k`` largest logits (CuPy arrays [T, E]), softmax over
    those k in fp32 -> (topk_weights [T, k] float32, topk_ids [T, k] int32), as
    workbench.formats.gpt_oss.route (ties: the order of CuPy's sort)."""
    from workbench import cuda as rt

    cupy = rt.cupy()
    e = int(logits.shape[-1])
    require(0 < top_k <= e, f"top_k = {top_k} is not in 1..{e} (experts)")
    x = logits.astype(cupy.float32)
    ids = cupy.argsort(-x, axis=-1)[:, :top_k]
    picked = cupy.take_along_axis(x, ids, axis=-1)
    w = cupy.exp(picked - picked.max(axis=-1, keepdims=True))
    return cupy.ascontiguousarray(w / w.sum(axis=-1, keepdims=True)), cupy.ascontiguousarray(ids.astype(cupy.int32))


class GptOssExperts:
    """A gpt-oss expert block on the GPU: ``experts(hidden, router_logits)`` = route (top-k softmax over the k) ->
    gate_up (MXFP4, + bias) -> clamped SwiGLU -> down (+ bias, × router weight) -> sum over the k, through
    ``workbench.moe.fused_moe`` (any of its paths)."""

    def __init__(self, gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias, *,
                 top_k: int = 4, alpha: float = GPT_OSS_ALPHA, limit: float = GPT_OSS_LIMIT, act_dtype=None):
        from workbench import gemm
        from workbench import cuda as rt
        from workbench.moe.stack import MarlinExpertStack

        cupy = rt.cupy()
        w13, b13, w2, b2 = gpt_oss_expert_weights(gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks,
                                                  down_scales, down_bias, act_dtype=act_dtype)
        self.w13 = MarlinExpertStack(gemm.upload_weight(w13), bias=cupy.asarray(b13))
        self.w2 = MarlinExpertStack(gemm.upload_weight(w2), bias=cupy.asarray(b2))
        self.activation = Activation("swigluoai", alpha, limit)
        self.top_k = int(top_k)

    def __call__(self, hidden, router_logits, *, path: str = "fused", **kw):
        from workbench.moe.layer import fused_moe

        weights, ids = route_topk_softmax(router_logits, self.top_k)
        return fused_moe(hidden, self.w13, self.w2, weights, ids, path=path, activation=self.activation, **kw)
