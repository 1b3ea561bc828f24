"""Small checkpoints written the way the producing tools write them, for tests, notebooks and the benchmark.

Tensor names, dtypes and packing follow the tools' own code (see ``workbench.checkpoint.layers`` for the table):
AutoGPTQ ``QuantLinear.pack`` (qweight packed along K, qzeros = zero - 1 packed along N, fp16 scales, int32 g_idx
always present), AutoAWQ ``WQLinear_GEMM.from_linear`` (qweight [K, N/8] and qzeros with the [0, 2, 4, 6, 1, 3, 5, 7]
interleave), compressed-tensors ``PackedQuantizationCompressor`` (signed codes + 2^(b-1) packed along K per output
row, zero points packed along N, ``weight_shape``), DeepSeek-V3 (E4M3 ``weight`` [N, K], float32
``weight_scale_inv`` per 128x128 block). Files are written with ``safetensors.numpy.save_file``, the reference
writer, so the readers are tested against an independent implementation.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from workbench.checkpoint.settings import AWQ, CT, FP8, GPTQ, GPTQ_V2
from workbench.formats import packing
from workbench.formats.fp8 import float_to_e4m3
from workbench.quantize import quantize_weights
from workbench.scalar_types import ScalarType


@dataclass(frozen=True)
class Options:
    fmt: str = GPTQ  # GPTQ, GPTQ_V2, AWQ, CT, FP8
    bits: int = 4
    group_size: int = 128
    act_order: bool = False
    sym: bool = True
    act_dtype: object = np.float16
    bias: bool = False
    config_style: str = "config.json"  # or "quantize_config.json" (AutoGPTQ) / "quant_config.json" (AutoAWQ)


def _weight_type(opt: Options) -> ScalarType:
    if opt.fmt == FP8:
        return ScalarType.FE4M3FN
    if opt.sym and opt.fmt != AWQ:
        return ScalarType.U4B8 if opt.bits == 4 else ScalarType.U8B128
    return ScalarType.U4 if opt.bits == 4 else ScalarType.U8


def quantize(w_kn: np.ndarray, opt: Options, seed: int = 0):
    """The reference RTN quantization a checkpoint of ``opt`` holds for float weight ``w_kn`` (K, N)."""
    return quantize_weights(w_kn, _weight_type(opt), opt.group_size, act_order=opt.act_order, act_dtype=opt.act_dtype,
                            seed=seed)


def quantized_tensors(prefix: str, w_kn: np.ndarray, opt: Options, seed: int = 0) -> dict[str, np.ndarray]:
    """The tensors a tool writes for one linear layer with float weight ``w_kn`` (K, N)."""
    if opt.fmt == FP8:
        return block_fp8_tensors(prefix, w_kn)
    return encode(prefix, quantize(w_kn, opt, seed), opt, seed)


def encode(prefix: str, q, opt: Options, seed: int = 0) -> dict[str, np.ndarray]:
    """The tensors a tool writes for an already quantized weight ``q`` (a ``QuantizedWeight``)."""
    k, n = q.codes.shape
    bits, half = opt.bits, 1 << (opt.bits - 1)
    ng = q.scales.shape[0]
    zeros = q.zeros if q.zeros is not None else np.full((ng, n), half, np.uint8)
    out: dict[str, np.ndarray] = {}
    if opt.fmt in (GPTQ, GPTQ_V2):
        stored = zeros - np.uint8(1) if opt.fmt == GPTQ else zeros
        g = opt.group_size if opt.group_size != -1 else k
        out[f"{prefix}.qweight"] = packing.pack_rows(q.codes, bits)
        out[f"{prefix}.qzeros"] = packing.pack_cols(stored, bits)
        out[f"{prefix}.scales"] = np.ascontiguousarray(q.scales)
        out[f"{prefix}.g_idx"] = (q.g_idx if q.g_idx is not None else np.arange(k) // g).astype(np.int32)
    elif opt.fmt == AWQ:
        out[f"{prefix}.qweight"] = packing.awq_pack(q.codes, bits)
        out[f"{prefix}.qzeros"] = packing.awq_pack(zeros, bits)
        out[f"{prefix}.scales"] = np.ascontiguousarray(q.scales)
    elif opt.fmt == CT:
        out[f"{prefix}.weight_packed"] = np.ascontiguousarray(packing.pack_rows(q.codes, bits).T)  # (N, K/pf)
        out[f"{prefix}.weight_scale"] = np.ascontiguousarray(q.scales.T)  # (N, ng)
        out[f"{prefix}.weight_shape"] = np.array([n, k], dtype=np.int64)
        if not opt.sym:
            out[f"{prefix}.weight_zero_point"] = packing.pack_rows(np.ascontiguousarray(zeros.T), bits)  # (N/pf, ng)
        if opt.act_order:
            out[f"{prefix}.weight_g_idx"] = q.g_idx.astype(np.int32)
    if opt.bias:
        out[f"{prefix}.bias"] = (np.random.default_rng(seed).standard_normal(n) * 0.01).astype(opt.act_dtype)
    return out


def block_fp8_tensors(prefix: str, w_kn: np.ndarray) -> dict[str, np.ndarray]:
    w = np.ascontiguousarray(w_kn.T).astype(np.float32)  # (N, K) as the checkpoint stores it
    n, k = w.shape
    bn, bk = -(-n // 128), -(-k // 128)  # blocks at the N and K edges may be partial
    padded = np.zeros((bn * 128, bk * 128), np.float32)
    padded[:n, :k] = w
    blocks = np.abs(padded).reshape(bn, 128, bk, 128).max(axis=(1, 3))
    scale_inv = np.maximum(blocks / np.float32(448.0), np.float32(1e-12)).astype(np.float32)  # (ceil(N/128), ceil(K/128))
    per_elem = np.repeat(np.repeat(scale_inv, 128, axis=0), 128, axis=1)[:n, :k]
    codes = float_to_e4m3(w / per_elem)  # uint8 (N, K)
    return {f"{prefix}.weight": codes.view(ml_dtypes.float8_e4m3fn), f"{prefix}.weight_scale_inv": scale_inv}


def quant_config(opt: Options) -> dict:
    g = opt.group_size
    if opt.fmt in (GPTQ, GPTQ_V2):
        return {"quant_method": "gptq", "bits": opt.bits, "group_size": g, "desc_act": opt.act_order, "sym": opt.sym,
                "damp_percent": 0.01, "true_sequential": True, "static_groups": False, "checkpoint_format": opt.fmt}
    if opt.fmt == AWQ:
        if opt.config_style == "quant_config.json":
            return {"zero_point": True, "q_group_size": g, "w_bit": opt.bits, "version": "GEMM"}
        return {"quant_method": "awq", "bits": opt.bits, "group_size": g, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    if opt.fmt == CT:
        weights = {"num_bits": opt.bits, "type": "int", "symmetric": opt.sym,
                   "strategy": "channel" if g == -1 else "group", "group_size": None if g == -1 else g,
                   "actorder": "group" if opt.act_order else None, "dynamic": False, "observer": "minmax",
                   "block_structure": None}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                              "output_activations": None, "format": "pack-quantized"}},
                "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}}
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def write_checkpoint(out_dir: str, tensors: dict[str, np.ndarray], opt: Options, shards: int = 1,
                     extra_config: dict | None = None) -> str:
    """Write tensors as ``model.safetensors`` or ``shards`` files + index json, plus the config file(s)."""
    os.makedirs(out_dir, exist_ok=True)
    names = list(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i in range(shards):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {nm: tensors[nm] for nm in names[i::shards]}
            save_file(part, os.path.join(out_dir, fname), metadata={"format": "pt"})
            weight_map.update({nm: fname for nm in part})
        total = sum(t.nbytes for t in tensors.values())
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "torch_dtype": "bfloat16" if np.dtype(opt.act_dtype) == ml_dtypes.bfloat16 else "float16"}
    config.update(extra_config or {})
    if opt.config_style == "config.json":
        config["quantization_config"] = quant_config(opt)
    else:
        with open(os.path.join(out_dir, opt.config_style), "w") as f:
            json.dump(quant_config(opt), f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir


def random_model(out_dir: str, opt: Options, shapes: dict[str, tuple[int, int]], experts: int = 0,
                 expert_shape: tuple[int, int] | None = None, fused_experts: bool = False, shards: int = 1,
                 seed: int = 0, mixtral_names: bool = False) -> str:
    """A checkpoint with dense layers ``{prefix: (K, N)}`` (+ ``experts`` MoE experts of (hidden, intermediate)),
    random normal weights, an embedding and a norm carried over untouched."""
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    hidden = next(iter(shapes.values()))[0] if shapes else expert_shape[0]
    tensors["model.embed_tokens.weight"] = rng.standard_normal((32, hidden)).astype(opt.act_dtype)
    tensors["model.norm.weight"] = rng.standard_normal(hidden).astype(opt.act_dtype)
    for i, (prefix, (k, n)) in enumerate(shapes.items()):
        w = rng.standard_normal((k, n)).astype(np.float32) * 0.05
        tensors.update(quantized_tensors(prefix, w, opt, seed=seed + i))
    if experts:
        h, inter = expert_shape
        names = ("w1", "w3", "w2") if mixtral_names else ("gate_proj", "up_proj", "down_proj")
        base = "model.layers.0.block_sparse_moe" if mixtral_names else "model.layers.0.mlp"
        tensors[f"{base}.gate.weight"] = rng.standard_normal((experts, h)).astype(opt.act_dtype)
        for e in range(experts):
            s = seed + 1000 + 10 * e
            if fused_experts:
                tensors.update(quantized_tensors(f"{base}.experts.{e}.gate_up_proj",
                                                 rng.standard_normal((h, 2 * inter)).astype(np.float32) * 0.05, opt, s))
            else:
                tensors.update(quantized_tensors(f"{base}.experts.{e}.{names[0]}",
                                                 rng.standard_normal((h, inter)).astype(np.float32) * 0.05, opt, s))
                # act-order: gate and up share their input, so GPTQ gives them the same g_idx (same seed)
                tensors.update(quantized_tensors(f"{base}.experts.{e}.{names[1]}",
                                                 rng.standard_normal((h, inter)).astype(np.float32) * 0.05, opt,
                                                 s if opt.act_order else s + 1))
            tensors.update(quantized_tensors(f"{base}.experts.{e}.{names[2]}",
                                             rng.standard_normal((inter, h)).astype(np.float32) * 0.05, opt, s + 2))
    return write_checkpoint(out_dir, tensors, opt, shards)
