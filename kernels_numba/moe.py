"""Stacked MoE experts: E experts' GPTQ tensors -> one Marlin stack, expert e at offset e·stride.

Specified in docs/formats.md, "MoE expert stacks".

    qweight  [E, K/16, N*16/pf] int32   stride = K*N/pf words (same size as one expert's GPTQ qweight)
    scales   [E, ng, N]         act     permuted per expert (P64 grouped / P32 channelwise)
    zeros    [E, ng, N/pf]      int32   only when some expert is asymmetric (else u4b8 / u8b128 needs none)

Two routes, chosen by where the inputs are:

* **already on the device, stacked** (one [E, ...] device array per tensor): one launch per tensor kind for all
  experts (grid z = expert), no extra device memory beyond the outputs.
* **on the host** (a list of per-expert arrays, or a stacked NumPy array): a staging buffer the size of *one*
  expert's input is reused for every expert (upload, launch into slot e, next), so the peak extra device memory is
  one expert's input however many experts there are; everything is queued on one stream and synchronised once.

A list of per-expert *device* arrays is repacked expert by expert straight from where it lies (no staging).
"""
from __future__ import annotations

import numpy as np

from kernels_numba import marlin_repack as _mr
from kernels_numba import scales as _sc
from kernels_numba._launch import Arrays, is_device_array
from workbench.formats._checks import padded_k, padded_n


def _num_groups(size_k: int, group_size: int) -> int:
    return 1 if group_size == -1 else -(-size_k // group_size)


def _symmetric_word(bits: int) -> int:
    field = (1 << (bits - 1)) - 1
    return sum(field << (bits * j) for j in range(32 // bits))


def _experts(x, name: str):
    """A stacked array or a sequence -> list of per-expert items (device arrays stay device arrays)."""
    if is_device_array(x) or isinstance(x, np.ndarray):
        return None  # stacked
    items = list(x)
    if not items:
        raise ValueError(f"{name} is empty: at least one expert is needed")
    return items


def stack_gptq_experts_to_marlin(qweights, scales, qzeros, bits: int, group_size: int, size_k: int,
                                 n_per_expert: int, act_dtype=np.float16, *, stream=None):
    """-> (qweight [E, K_pad/16, N_pad*16/pf] int32, scales [E, ng, N_pad] act_dtype bits, zeros [E, ng, N_pad/pf]
    | None, asymmetric): the padded Marlin arrays of docs/formats.md, "Shapes that are not tile multiples". Inputs: per-expert lists or stacked [E, ...] arrays of GPTQ qweight [K/pf, N], scales [ng, N]
    (float32 or act_dtype), v1 qzeros [ng, N/pf]. NumPy in -> NumPy out; device in -> device out.
    """
    import ml_dtypes

    size_k, n_per_expert, bits = _mr._check_sizes(size_k, n_per_expert, bits, "gptq")
    n_pad = padded_n(n_per_expert)
    act = np.dtype(act_dtype)
    if act not in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)):
        raise TypeError(f"act_dtype must be float16 or bfloat16, got {act}")
    pf = 32 // bits
    ng = _num_groups(size_k, group_size)
    qw_shape = (size_k // pf, n_per_expert)
    sc_shape = (ng, n_per_expert)
    qz_shape = (ng, n_per_expert // pf)
    lists = [_experts(x, n) for x, n in ((qweights, "qweights"), (scales, "scales"), (qzeros, "qzeros"))]
    experts = len(lists[0]) if lists[0] is not None else int(qweights.shape[0])
    for x, items, name in zip((qweights, scales, qzeros), lists, ("qweights", "scales", "qzeros")):
        count = len(items) if items is not None else int(x.shape[0])
        if count != experts:
            raise ValueError(f"stacked experts: {name} has {count} experts, qweights has {experts}")
    arrays = Arrays(stream)
    s = arrays.stream
    width = 64 if group_size != -1 and group_size < size_k else 32
    convert = "f16" if act == np.dtype(np.float16) else "bf16"

    stacked_on_device = all(items is None and is_device_array(x) for x, items in zip((qweights, scales, qzeros), lists))
    out_qw = arrays.empty((experts, padded_k(size_k) // 16, n_pad * 16 // pf), np.uint32)
    out_sc = arrays.empty((experts, ng, n_pad), np.uint16)

    if stacked_on_device:
        qw = arrays.take(qweights, "qweights", np.uint32)
        sc = arrays.take(scales, "scales")
        qz = arrays.take(qzeros, "qzeros", np.uint32)
        for d, shape, name in ((qw, qw_shape, "qweights"), (sc, sc_shape, "scales"), (qz, qz_shape, "qzeros")):
            if tuple(d.shape) != (experts,) + shape:
                raise ValueError(f"{name} has shape {tuple(d.shape)}, expected {(experts,) + shape}")
        _mr.repack_into(arrays, qw, None, out_qw, bits, "gptq", size_k, n_per_expert)
        if np.dtype(sc.dtype) == np.dtype(np.float16) and act != np.dtype(np.float16):
            raise TypeError(f"scales are float16 but act_dtype is {act}: pass float32 or {act} scales")
        sc_raw = _sc._raw_view(sc)
        kind = "none" if np.dtype(sc_raw.dtype).itemsize == 2 else convert
        _sc._permute_kernel(width, kind)[_sc._blocks(experts * ng * n_pad), _sc.THREADS, s](
            sc_raw.reshape((experts * ng, n_per_expert)), out_sc.reshape((experts * ng, n_pad)))
        asymmetric = bool(_sc.gptq_qzeros_not_symmetric(qz, bits, stream=stream).any())
        out_qz = None
        if asymmetric:
            out_qz = _sc.repack_gptq_qzeros_to_marlin(qz, size_k, n_per_expert, group_size, bits, stream=stream)
        return arrays.give(out_qw, np.int32), arrays.give(out_sc), out_qz, asymmetric

    # expert by expert: stage host inputs through one expert-sized buffer
    def expert_item(x, items, e):
        return items[e] if items is not None else x[e]

    qw_stage = sc_stage = qz_stage = None
    asymmetric = False
    for e in range(experts):
        qz_e = expert_item(qzeros, lists[2], e)
        if is_device_array(qz_e):
            asymmetric |= bool(_sc.gptq_qzeros_not_symmetric(qz_e.reshape((1,) + tuple(qz_e.shape)), bits,
                                                             stream=stream)[0])
        else:
            qz_host = np.asarray(qz_e)
            if tuple(qz_host.shape) != qz_shape:
                raise ValueError(f"qzeros[{e}] has shape {qz_host.shape}, expected {qz_shape}")
            asymmetric |= not bool(np.all(qz_host.view(np.uint32) == np.uint32(_symmetric_word(bits))))
    out_qz = arrays.empty((experts, ng, n_pad // pf), np.uint32) if asymmetric else None
    # one (lowest bad index, count) slot per expert, so a code-15 error names its expert without a sync per expert
    errors = arrays.take(np.tile(np.array([_sc.NO_ERROR, 0], np.int64), (experts, 1)), "errors")

    for e in range(experts):
        qw_e = expert_item(qweights, lists[0], e)
        sc_e = expert_item(scales, lists[1], e)
        if is_device_array(qw_e):
            qw_d = arrays.take(qw_e, f"qweights[{e}]", np.uint32)
        else:
            host = np.ascontiguousarray(np.asarray(qw_e)).view(np.uint32)
            if host.shape != qw_shape:
                raise ValueError(f"qweights[{e}] has shape {host.shape}, expected {qw_shape}")
            qw_d = qw_stage = arrays.upload(host, qw_stage)
        if tuple(qw_d.shape) != qw_shape:
            raise ValueError(f"qweights[{e}] has shape {tuple(qw_d.shape)}, expected {qw_shape}")
        _mr.repack_into(arrays, qw_d.reshape((1,) + qw_shape), None, out_qw[e:e + 1], bits, "gptq", size_k,
                        n_per_expert)

        if is_device_array(sc_e):
            sc_d = _sc._raw_view(arrays.take(sc_e, f"scales[{e}]"))
        else:
            host = np.asarray(sc_e)
            if host.dtype != np.float32 and host.dtype != act:
                host = host.astype(act)  # other float dtypes: one NumPy rounding, as the reference's astype
            host = np.ascontiguousarray(host).view(np.uint32 if host.dtype == np.float32 else np.uint16)
            if host.shape != sc_shape:
                raise ValueError(f"scales[{e}] has shape {host.shape}, expected {sc_shape}")
            sc_d = sc_stage = arrays.upload(host, sc_stage)
        kind = "none" if np.dtype(sc_d.dtype).itemsize == 2 else convert
        _sc._permute_kernel(width, kind)[_sc._blocks(ng * n_pad), _sc.THREADS, s](sc_d.reshape(sc_shape),
                                                                                   out_sc[e].reshape((ng, n_pad)))
        if asymmetric:
            qz_e = expert_item(qzeros, lists[2], e)
            if is_device_array(qz_e):
                qz_d = arrays.take(qz_e, f"qzeros[{e}]", np.uint32)
            else:
                qz_d = qz_stage = arrays.upload(np.ascontiguousarray(np.asarray(qz_e)).view(np.uint32), qz_stage)
            per_w = ng * (n_pad // pf)
            _sc._zp_kernel(bits, "gptq_v1")[_sc._blocks(per_w), _sc.THREADS, s](
                qz_d.reshape(qz_shape), out_qz[e], n_per_expert, errors[e])
    if asymmetric:
        host_errors = arrays.to_host(errors)
        for e in np.flatnonzero(host_errors[:, 0] != _sc.NO_ERROR)[:1]:
            try:
                _sc._raise_v1_error(arrays, errors[e], n_per_expert, bits, None, "all_ones")
            except ValueError as exc:
                raise ValueError(f"qzeros[{e}]: {exc}") from None
        out_qz = arrays.give(out_qz, np.int32)
    sc_out = arrays.give(out_sc)
    if not arrays.any_device:
        sc_out = sc_out.view(act)
    return arrays.give(out_qw, np.int32), sc_out, out_qz, asymmetric
