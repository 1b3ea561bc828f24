"""Microscaled checkpoints: compressed-tensors' own NVFP4 / MXFP4 / MXFP8 files (tests/fixtures, written once by
compressed-tensors 0.20.1), ModelOpt NVFP4 and gpt-oss MXFP4 written here; inspect, repack, verify, load, and
bad or contradicting tensors refused before anything is written."""
import json
import os
import shutil
import warnings

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import workbench  # noqa: E402
from workbench import cli, ops  # noqa: E402
from workbench.checkpoint import CheckpointError, inspect, repack, verify  # noqa: E402
from workbench.checkpoint.microscale import layer_scale_factor  # noqa: E402
from workbench.checkpoint.repack import padding_overhead  # noqa: E402
from workbench.checkpoint.safetensors_io import SafetensorsFile  # noqa: E402
from workbench.checkpoint.source import open_source  # noqa: E402
from workbench.formats import gpt_oss, microscale as ms  # noqa: E402
from workbench.formats._checks import padded_n  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
BF16 = np.dtype(ml_dtypes.bfloat16)
QUIET = {"progress": False, "log": lambda msg: None}


def _fixture(name):
    return os.path.join(FIXTURES, name)


def _tensors(path) -> dict:
    f = SafetensorsFile(os.path.join(path, "model.safetensors"))
    return {name: f.read(name) for name in f.tensors}


def _copy(src, dst, change=None, config=None) -> str:
    """A copy of a checkpoint directory with some tensors replaced (or removed: value None) and config edits."""
    shutil.copytree(src, dst)
    if change:
        tensors = _tensors(dst)
        for name, value in change.items():
            if value is None:
                tensors.pop(name)
            else:
                tensors[name] = value
        save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    if config:
        path = os.path.join(dst, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        config(cfg)
        with open(path, "w") as f:
            json.dump(cfg, f)
    return dst


def _marlin_dequant(w, e=None):
    """Dequantized [N, K] float64 of a loaded microscaled layer, through the inverse ops."""
    q, s = (w.qweight, w.scales) if e is None else (w.qweight[e], w.scales[e])
    k, n = w.size_k, w.size_n
    if w.microscale == "mxfp8":
        return ms.dequantize_mx(ops.marlin_to_mxfp8(q, k, n), ops.marlin_to_mx_scales(s, k, n, "mxfp8"), "mxfp8")
    packed = ops.marlin_to_fp4(q, k, n)
    if w.microscale == "mxfp4":
        return ms.dequantize_mx(packed, ops.marlin_to_mx_scales(s, k, n), "mxfp4")
    return packed, s


# ---------------------------------------------------------------------------------------------------------------
# compressed-tensors' own checkpoints
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,fmt,source,wtype", [("ct_nvfp4", "nvfp4", "compressed-tensors-fp4", "fe2m1f"),
                                                   ("ct_mxfp4", "mxfp4", "compressed-tensors-fp4", "fe2m1f"),
                                                   ("ct_mxfp8", "mxfp8", "compressed-tensors-mxfp8", "fe4m3fn")])
def test_compressed_tensors_fixture_inspects_repacks_and_verifies(name, fmt, source, wtype, tmp_path):
    with open(os.path.join(_fixture(name), "PRODUCER.txt")) as f:
        assert f.read().startswith("compressed-tensors 0.20.1")
    plan = inspect(_fixture(name))
    assert {s.name: (s.size_k, s.size_n, s.num_experts) for s in plan.layers} == {
        "model.layers.0.mlp.experts.down_proj": (128, 128, 2), "model.layers.0.mlp.experts.gate_up_proj": (128, 256, 2),
        "model.layers.0.self_attn.o_proj": (256, 128, 0), "model.layers.0.self_attn.q_proj": (128, 256, 0)}
    for spec in plan.layers:
        assert (spec.source_format, spec.weight_type.label, spec.microscale, spec.compatible) == (source, wtype, fmt,
                                                                                                  True)
        assert spec.group_size == ms.FORMATS[fmt].group_size and spec.act_dtype == BF16
    assert plan.passthrough == ["model.layers.0.input_layernorm.bias", "model.layers.0.input_layernorm.weight",
                                "model.layers.0.mlp.gate.weight"]
    out = str(tmp_path / "out")
    manifest = repack(_fixture(name), out, **QUIET)
    rec = manifest["layers"]["model.layers.0.self_attn.q_proj"]
    assert rec["microscale"] == fmt and rec["scale_encoding"] == ("s0e5m3" if fmt == "nvfp4" else "e8m0")
    assert ("model.layers.0.self_attn.q_proj.global_scale" in rec["tensors"]) == (fmt == "nvfp4")
    report = verify(out, _fixture(name), progress=False)
    assert report.ok, report.problems
    assert report.layers_checked == 4


@pytest.mark.parametrize("name", ["ct_nvfp4", "ct_mxfp4", "ct_mxfp8"])
def test_loaded_layers_dequantize_to_what_compressed_tensors_decompresses(name, tmp_path):
    """The producer's own decompression (bf16, saved when the fixture was made) against our exact dequantization of
    the Marlin layers, rounded to bf16 once: equal, except where compressed-tensors' bf16 arithmetic rounds twice
    (NVFP4's division by the global scale), which stays within one bf16 step."""
    out = str(tmp_path / "out")
    repack(_fixture(name), out, **QUIET)
    loaded = workbench.load(out)
    ref = SafetensorsFile(_fixture(f"{name}_dequantized_by_producer.safetensors"))
    src = _tensors(_fixture(name))
    specs = {s.name: s for s in inspect(_fixture(name)).layers}
    source = open_source(_fixture(name))
    for layer, expert, tensor in (("model.layers.0.self_attn.q_proj", None, "model.layers.0.self_attn.q_proj.weight"),
                                  ("model.layers.0.mlp.experts.gate_up_proj", 0,
                                   "model.layers.0.mlp.experts.0.gate_proj.weight")):
        w = loaded[layer]
        want = ref.read(tensor).astype(np.float64)
        if w.microscale == "nvfp4":
            packed, raw = _marlin_dequant(w, expert)
            scales = ops.marlin_to_nvfp4_scales(raw, w.size_k, w.size_n,
                                                layer_scale_factor(source, specs[layer]))
            prefix = tensor[:-len(".weight")]
            g = np.float32(1) / src[f"{prefix}.weight_global_scale"][0]  # the kernel's fp32 reciprocal
            got = ms.dequantize_nvfp4(packed, scales, g)
        else:
            got = _marlin_dequant(w, expert)
        got = got[:want.shape[0]]  # gate_up: gate is the first N/2 columns of the fused stack
        step = np.abs(want) * 2.0 ** -7  # one bf16 step (8 significant bits)
        assert np.all(np.abs(got.astype(BF16).astype(np.float64) - want) <= step), tensor
        if w.microscale != "nvfp4":  # power-of-two scales: no rounding anywhere, so bit-equal
            assert np.array_equal(got.astype(BF16).astype(np.float64), want)


# ---------------------------------------------------------------------------------------------------------------
# ModelOpt NVFP4 and gpt-oss MXFP4, written here with the reference quantizers
# ---------------------------------------------------------------------------------------------------------------
def write_modelopt(path, rng, torch_dtype="float16", shapes=None, hf_quant_config=False) -> dict:
    shapes = shapes or {"model.layers.0.mlp.gate_proj": (128, 128), "model.layers.0.mlp.down_proj": (128, 256)}
    tensors, weights = {}, {}
    for prefix, (n, k) in shapes.items():
        w = rng.standard_normal((n, k)).astype(np.float32)
        packed, scales, g = ms.quantize_nvfp4(w)
        tensors.update({f"{prefix}.weight": packed, f"{prefix}.weight_scale": scales.view(ml_dtypes.float8_e4m3fn),
                        f"{prefix}.weight_scale_2": np.array(g, np.float32),
                        f"{prefix}.input_scale": np.array(0.5, np.float32)})
        weights[prefix] = (packed, scales, g)
    tensors["model.norm.weight"] = rng.standard_normal(128).astype(np.float16)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    settings = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}
    config = {"architectures": ["LlamaForCausalLM"], "torch_dtype": torch_dtype}
    if hf_quant_config:
        with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": {"name": "modelopt"}, "quantization": settings}, f)
    else:
        config["quantization_config"] = {"quant_method": "modelopt", **settings}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return weights


@pytest.mark.parametrize("torch_dtype,hf", [("float16", False), ("bfloat16", True)])
def test_modelopt_nvfp4_round_trip(torch_dtype, hf, tmp_path, rng):
    src = str(tmp_path / "src")
    weights = write_modelopt(src, rng, torch_dtype, hf_quant_config=hf)
    plan = inspect(src)
    assert [(s.name, s.source_format, s.act_dtype.name) for s in plan.layers] == [
        ("model.layers.0.mlp.down_proj", "modelopt-nvfp4", torch_dtype),
        ("model.layers.0.mlp.gate_proj", "modelopt-nvfp4", torch_dtype)]
    assert "model.layers.0.mlp.gate_proj.input_scale" in plan.passthrough  # W4A16: carried over, not used
    out = str(tmp_path / "out")
    repack(src, out, **QUIET)
    assert verify(out, src, progress=False).ok
    assert not os.path.exists(os.path.join(out, "hf_quant_config.json"))  # its settings moved into config.json
    for prefix, (packed, scales, g) in weights.items():
        w = workbench.load(out)[prefix]
        sf = ops.nvfp4_scale_factor(scales, w.act_dtype)
        assert np.array_equal(ops.marlin_to_fp4(w.qweight, w.size_k, w.size_n), packed)
        assert np.array_equal(ops.marlin_to_nvfp4_scales(w.scales, w.size_k, w.size_n, sf), scales)
        assert w.global_scale.tolist() == [ops.nvfp4_marlin_global_scale(g, w.act_dtype, sf)]
    in_memory = workbench.load(src)  # converted from the source without writing
    assert np.array_equal(in_memory["model.layers.0.mlp.gate_proj"].scales,
                          workbench.load(out)["model.layers.0.mlp.gate_proj"].scales)


def write_gpt_oss(path, rng, experts=3, hidden=128, inter=128, limit=7.0) -> dict:
    t = {}
    ref = {}
    for stack, (n, k) in (("gate_up_proj", (2 * inter, hidden)), ("down_proj", (hidden, inter))):
        blocks, scales, dense = [], [], []
        for _ in range(experts):
            w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
            packed, codes = ms.quantize_mx(w, "mxfp4")
            blocks.append(packed.reshape(n, k // 32, 16))
            scales.append(codes)
        base = f"model.layers.0.mlp.experts.{stack}"
        t[f"{base}_blocks"], t[f"{base}_scales"] = np.stack(blocks), np.stack(scales)
        t[f"{base}_bias"] = (rng.standard_normal((experts, n)) * 0.1).astype(BF16)
        ref[stack] = (gpt_oss.dequantize_stack(t[f"{base}_blocks"], t[f"{base}_scales"]),
                      t[f"{base}_bias"].astype(np.float64))
    t["model.layers.0.mlp.router.weight"] = rng.standard_normal((experts, hidden)).astype(BF16)
    t["model.layers.0.mlp.router.bias"] = rng.standard_normal(experts).astype(BF16)
    os.makedirs(path, exist_ok=True)
    save_file(t, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["GptOssForCausalLM"], "swiglu_limit": limit, "torch_dtype": "bfloat16",
                   "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}}, f)
    ref["router"] = (t["model.layers.0.mlp.router.weight"].astype(np.float64),
                     t["model.layers.0.mlp.router.bias"].astype(np.float64))
    return ref


def test_gpt_oss_stacks_round_trip_and_run_the_reference_moe(tmp_path, rng):
    src = str(tmp_path / "src")
    ref = write_gpt_oss(src, rng, limit=5.0)
    plan = inspect(src)
    specs = {s.name: s for s in plan.layers}
    gate_up = specs["model.layers.0.mlp.experts.gate_up_proj"]
    assert (gate_up.size_k, gate_up.size_n, gate_up.num_experts, gate_up.act_dtype) == (128, 256, 3, BF16)
    assert gate_up.manifest_extras == {"microscale": "mxfp4", "scale_encoding": "e8m0", "gate_up": "interleaved",
                                       "bias": "model.layers.0.mlp.experts.gate_up_proj_bias",
                                       "activation": {"name": "swiglu_oai", "alpha": 1.702, "limit": 5.0}}
    assert "model.layers.0.mlp.experts.down_proj_bias" in plan.passthrough
    out = str(tmp_path / "out")
    repack(src, out, **QUIET)
    assert verify(out, src, progress=False).ok
    loaded = workbench.load(out)
    assert loaded["model.layers.0.mlp.experts.gate_up_proj"].gate_up == "interleaved"
    # the MoE reference on weights taken back out of the Marlin stacks equals the one on the checkpoint's weights
    w_gu = np.stack([_marlin_dequant(loaded["model.layers.0.mlp.experts.gate_up_proj"], e) for e in range(3)])
    w_d = np.stack([_marlin_dequant(loaded["model.layers.0.mlp.experts.down_proj"], e) for e in range(3)])
    assert np.array_equal(w_gu, ref["gate_up_proj"][0]) and np.array_equal(w_d, ref["down_proj"][0])
    x = rng.standard_normal((5, 128))
    args = (*ref["router"], w_gu, ref["gate_up_proj"][1], w_d, ref["down_proj"][1], 2)
    want = gpt_oss.moe_forward(x, *ref["router"], *ref["gate_up_proj"], *ref["down_proj"], 2, limit=5.0)
    assert np.array_equal(gpt_oss.moe_forward(x, *args, limit=5.0), want)


def test_gpt_oss_reference_against_a_loop():
    rng = np.random.default_rng(5)
    e, h, i, t = 4, 8, 4, 3
    w_gu, b_gu = rng.standard_normal((e, 2 * i, h)) * 3, rng.standard_normal((e, 2 * i))
    w_d, b_d = rng.standard_normal((e, h, i)), rng.standard_normal((e, h))
    r_w, r_b, x = rng.standard_normal((e, h)), rng.standard_normal(e), rng.standard_normal((t, h))
    got = gpt_oss.moe_forward(x, r_w, r_b, w_gu, b_gu, w_d, b_d, 2)
    for tok in range(t):
        logits = [sum(r_w[j, c] * x[tok, c] for c in range(h)) + r_b[j] for j in range(e)]
        top = sorted(range(e), key=lambda j: -logits[j])[:2]
        z = [np.exp(logits[j] - logits[top[0]]) for j in top]
        want = np.zeros(h)
        for j, zj in zip(top, z):
            hh = [sum(w_gu[j, r, c] * x[tok, c] for c in range(h)) + b_gu[j, r] for r in range(2 * i)]
            act = []
            for f in range(i):
                g, u = min(hh[2 * f], 7.0), min(max(hh[2 * f + 1], -7.0), 7.0)
                act.append((u + 1) * g / (1 + np.exp(-1.702 * g)))
            y = [sum(w_d[j, o, f] * act[f] for f in range(i)) + b_d[j, o] for o in range(h)]
            want += zj / sum(z) * np.array(y)
        assert np.allclose(got[tok], want, rtol=1e-12, atol=1e-12)  # float64 sums in another order


# ---------------------------------------------------------------------------------------------------------------
# bad or contradicting tensors: refused, nothing written
# ---------------------------------------------------------------------------------------------------------------
GATE = "model.layers.0.mlp.experts.1.gate_proj"
UP = "model.layers.0.mlp.experts.1.up_proj"


def _refused(src, tmp_path, match):
    out = str(tmp_path / "refused")
    with pytest.raises(CheckpointError, match=match):
        repack(src, out, **QUIET)
    assert not os.path.exists(out) and not [p for p in os.listdir(tmp_path) if p.startswith("refused")]


def test_fused_gate_and_up_with_different_global_scales_are_refused(tmp_path):
    t = _tensors(_fixture("ct_nvfp4"))
    src = _copy(_fixture("ct_nvfp4"), str(tmp_path / "src"),
                {f"{UP}.weight_global_scale": t[f"{UP}.weight_global_scale"] * np.float32(2)})
    _refused(src, tmp_path, r"experts\.1\.up_proj\.weight_global_scale gives the global scale .* but .*experts\.1"
             r"\.gate_proj\.weight_global_scale gives .*share one global scale")


def test_bad_codes_and_scales_are_refused_by_position(tmp_path):
    t = _tensors(_fixture("ct_mxfp4"))
    scales = t[f"{GATE}.weight_scale"].copy()
    scales[7, 2] = 0xFF
    _refused(_copy(_fixture("ct_mxfp4"), str(tmp_path / "nan_e8m0"), {f"{GATE}.weight_scale": scales}), tmp_path,
             r"expert 1: weight_scale\[7, 2\] = 0xFF is E8M0's NaN code")
    t = _tensors(_fixture("ct_nvfp4"))
    scales = t[f"{GATE}.weight_scale"].view(np.uint8).copy()
    scales[3, 1] = 0x7F
    _refused(_copy(_fixture("ct_nvfp4"), str(tmp_path / "nan_e4m3"),
                   {f"{GATE}.weight_scale": scales.view(ml_dtypes.float8_e4m3fn)}), tmp_path,
             r"weight_scale\[3, 1\] = 0x7f is E4M3's NaN")
    _refused(_copy(_fixture("ct_nvfp4"), str(tmp_path / "zero_global"),
                   {f"{GATE}.weight_global_scale": np.zeros(1, np.float32)}), tmp_path,
             r"global scale = 0.0; it must be finite and positive")


@pytest.mark.parametrize("change,match", [
    ({f"{GATE}.weight_scale": np.zeros((128, 4), np.uint8)}, r"weight_scale.*dtype U8 is not F8_E4M3"),
    ({f"{GATE}.weight_scale": np.zeros((128, 4), ml_dtypes.float8_e4m3fn)}, r"expected \[128, 8\] for K = 128"),
    ({f"{GATE}.weight_global_scale": None}, r"weight_global_scale tensor is missing"),
    ({f"{GATE}.weight_packed": np.zeros((128, 64), np.int32)}, r"dtype I32 is not U8"),
])
def test_contradicting_tensors_are_refused_at_inspect(change, match, tmp_path):
    src = _copy(_fixture("ct_nvfp4"), str(tmp_path / "src"), change)
    with pytest.raises(CheckpointError, match=match):
        inspect(src)
    _refused(src, tmp_path, match)


def test_a_group_without_its_own_format_takes_the_checkpoints(tmp_path):
    src = _copy(_fixture("ct_nvfp4"), str(tmp_path / "src"),
                config=lambda c: c["quantization_config"]["config_groups"]["group_0"].update(format=None))
    assert {s.microscale for s in inspect(src).layers} == {"nvfp4"}


@pytest.mark.parametrize("edit,match", [
    (lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=32),
     r"group_size = 32, but nvfp4 groups are 16"),
    (lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(num_bits=8),
     r"num_bits = 8, but format 'nvfp4-pack-quantized' holds 4-bit elements"),
    (lambda c: c["quantization_config"]["config_groups"].update(group_1={
        "targets": ["re:.*q_proj"], "format": "pack-quantized",
        "weights": {"num_bits": 4, "type": "int", "group_size": 128, "strategy": "group"}}),
     r"config_groups mix \['compressed-tensors', 'compressed-tensors-fp4'\] layers"),
])
def test_contradicting_settings_are_refused(edit, match, tmp_path):
    src = _copy(_fixture("ct_nvfp4"), str(tmp_path / "src"), config=edit)
    _refused(src, tmp_path, match)


def test_modelopt_and_gpt_oss_refusals(tmp_path, rng):
    src = str(tmp_path / "mo")
    write_modelopt(src, rng)
    _refused(_copy(src, str(tmp_path / "mo_fp8"), config=lambda c: c["quantization_config"].update(
        quant_algo="FP8")), tmp_path, r"ModelOpt quant_algo = 'FP8' is unsupported")
    _refused(_copy(src, str(tmp_path / "mo_two"), {"model.layers.0.mlp.gate_proj.weight_scale_2":
                                                    np.ones(2, np.float32)}), tmp_path, r"expected one value")
    gpt = str(tmp_path / "gpt")
    write_gpt_oss(gpt, rng)
    blocks = _tensors(gpt)["model.layers.0.mlp.experts.down_proj_blocks"]
    _refused(_copy(gpt, str(tmp_path / "gpt_bad"), {"model.layers.0.mlp.experts.down_proj_blocks":
                                                     np.ascontiguousarray(blocks.reshape(3, 128, 2, 32))}),
             tmp_path, r"expected \[experts, N, K/32, 16\]")
    _refused(_copy(gpt, str(tmp_path / "gpt_orphan"), {"model.layers.0.mlp.experts.down_proj_blocks": None}),
             tmp_path, r"down_proj_scales.* has no matching")


def test_bf16_rescale_overflow_is_refused_and_negative_scales_fail_verify(tmp_path, rng):
    src = str(tmp_path / "src")
    weights = write_modelopt(src, rng, "bfloat16", shapes={"model.layers.0.mlp.gate_proj": (128, 128)})
    packed, scales, g = weights["model.layers.0.mlp.gate_proj"]
    tiny = scales.copy()
    tiny[0, 0] = 0x01  # 2^-9 beside scales near 448: vLLM's bf16 rescale would overflow fp16
    _refused(_copy(src, str(tmp_path / "tiny"), {"model.layers.0.mlp.gate_proj.weight_scale":
                                                  tiny.view(ml_dtypes.float8_e4m3fn)}), tmp_path,
             r"exceeds fp16's 65504")
    negative = scales.copy()
    negative[5, 3] |= 0x80
    neg = _copy(src, str(tmp_path / "neg"), {"model.layers.0.mlp.gate_proj.weight_scale":
                                             negative.view(ml_dtypes.float8_e4m3fn)})
    out = str(tmp_path / "neg_out")
    with pytest.warns(RuntimeWarning, match=r"\[.*\] = -.* is negative \(1 such\)"):
        repack(neg, out, **QUIET)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        report = verify(out, neg, progress=False)
    assert not report.ok
    assert any("weight_scale[5, 3]" in p and "negative in the source" in p for p in report.problems), report.problems


# ---------------------------------------------------------------------------------------------------------------
# N not a multiple of the 64-column Marlin tile (docs/formats.md, "Shapes that are not tile multiples"): inspect
# accepts the layers and reports the padding, repack writes the padded Marlin tensors with the true sizes in the
# manifest and the file metadata, verify takes them back bit for bit and refuses nonzero padding, load gives layers
# with the true sizes. K is a whole number of the format's groups (the format's rule), so it is never padded.
# ---------------------------------------------------------------------------------------------------------------
ODD_PREFIX = "model.layers.0.mlp.down_proj"


def write_ct_mxfp8(path, rng, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A compressed-tensors mxfp8-quantized checkpoint of one layer, as its fixture's settings say."""
    elements, codes = ms.quantize_mx(rng.standard_normal((n, k)).astype(np.float32), "mxfp8")
    os.makedirs(path, exist_ok=True)
    save_file({f"{ODD_PREFIX}.weight": elements.view(ml_dtypes.float8_e4m3fn), f"{ODD_PREFIX}.weight_scale": codes},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    weights = {"dynamic": False, "group_size": 32, "num_bits": 8, "scale_dtype": "torch.uint8", "strategy": "group",
               "symmetric": True, "type": "float"}
    config = {"architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16", "quantization_config": {
        "config_groups": {"group_0": {"format": "mxfp8-quantized", "input_activations": None,
                                      "output_activations": None, "targets": ["Linear"], "weights": weights}},
        "format": "mxfp8-quantized", "ignore": [], "quant_method": "compressed-tensors",
        "quantization_status": "compressed", "version": "0.20.1"}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return elements, codes


def _layer_record(out, name):
    return json.loads(SafetensorsFile(os.path.join(out, "model.safetensors")).metadata["marlin_layers"])[name]


def _check_padding_report(plan, name, n, k, bits, capsys, src):
    spec = next(s for s in plan.layers if s.name == name)
    assert spec.compatible, spec.problems
    assert cli.main(["inspect", src, "--json"]) == 0
    layers = {layer["name"]: layer for layer in json.loads(capsys.readouterr().out)["layers"]}
    padding = layers[name]["padding"]
    assert padding == padding_overhead(spec)
    experts = spec.num_experts or 1
    extra = {row["tensor"].rpartition(".")[2]: row["rule_extra_bytes"] for row in padding}
    assert extra == {"qweight": experts * (padded_n(n) - n) * k * bits // 8,
                     "scales": experts * (padded_n(n) - n) * (k // spec.group_size)}


@settings(max_examples=5, suppress_health_check=[HealthCheck.function_scoped_fixture])  # capsys: read per example
@given(n=st.integers(1, 200).filter(lambda n: n % 64), groups=st.integers(1, 4),
       torch_dtype=st.sampled_from(("float16", "bfloat16")), seed=st.integers(0, 2**31 - 1))
def test_modelopt_nvfp4_odd_n_round_trip(n, groups, torch_dtype, seed, tmp_path_factory, capsys):
    rng = np.random.default_rng(seed)
    k = 16 * groups
    src = str(tmp_path_factory.mktemp("src"))
    (packed, scales, g), = write_modelopt(src, rng, torch_dtype, shapes={ODD_PREFIX: (n, k)}).values()
    _check_padding_report(inspect(src), ODD_PREFIX, n, k, 4, capsys, src)
    out = str(tmp_path_factory.mktemp("out") / "marlin")
    repack(src, out, **QUIET)
    report = verify(out, src, progress=False)
    assert report.ok, report.problems
    w = workbench.load(out)[ODD_PREFIX]
    assert (w.size_k, w.size_n) == (k, n) and (_layer_record(out, ODD_PREFIX)["size_k"], _layer_record(out, ODD_PREFIX)[
        "size_n"]) == (k, n)
    assert w.qweight.shape == (k // 16, 2 * padded_n(n)) and w.scales.shape == (k // 16, padded_n(n))
    sf = ops.nvfp4_scale_factor(scales, w.act_dtype)
    assert np.array_equal(ops.marlin_to_fp4(w.qweight, k, n), packed)
    assert np.array_equal(ops.marlin_to_nvfp4_scales(w.scales, k, n, sf), scales)
    assert w.global_scale.tolist() == [ops.nvfp4_marlin_global_scale(g, w.act_dtype, sf)]


@settings(max_examples=5, suppress_health_check=[HealthCheck.function_scoped_fixture])  # capsys: read per example
@given(n=st.integers(1, 200).filter(lambda n: n % 64), groups=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_compressed_tensors_mxfp8_odd_n_round_trip(n, groups, seed, tmp_path_factory, capsys):
    rng = np.random.default_rng(seed)
    k = 32 * groups
    src = str(tmp_path_factory.mktemp("src"))
    elements, codes = write_ct_mxfp8(src, rng, n, k)
    _check_padding_report(inspect(src), ODD_PREFIX, n, k, 8, capsys, src)
    out = str(tmp_path_factory.mktemp("out") / "marlin")
    repack(src, out, **QUIET)
    report = verify(out, src, progress=False)
    assert report.ok, report.problems
    w = workbench.load(out)[ODD_PREFIX]
    assert (w.size_k, w.size_n, w.qweight.shape) == (k, n, (k // 16, 4 * padded_n(n)))
    assert np.array_equal(ops.marlin_to_mxfp8(w.qweight, k, n), elements)
    assert np.array_equal(ops.marlin_to_mx_scales(w.scales, k, n, "mxfp8"), codes)


def test_gpt_oss_stack_with_odd_n_round_trips(tmp_path, rng, capsys):
    """hidden = 96: down_proj's N = 96 is 1.5 tiles for each of the 3 experts; gate_up (N = 2 * 64) is whole."""
    src = str(tmp_path / "src")
    ref = write_gpt_oss(src, rng, hidden=96, inter=64)
    name = "model.layers.0.mlp.experts.down_proj"
    _check_padding_report(inspect(src), name, 96, 64, 4, capsys, src)
    out = str(tmp_path / "out")
    repack(src, out, **QUIET)
    report = verify(out, src, progress=False)
    assert report.ok, report.problems
    w = workbench.load(out)[name]
    assert (w.size_k, w.size_n, w.qweight.shape) == (64, 96, (3, 4, 256))
    for e in range(3):
        packed = ops.marlin_to_fp4(w.qweight[e], 64, 96)
        assert np.array_equal(ms.dequantize_mx(packed, ops.marlin_to_mx_scales(w.scales[e], 64, 96), "mxfp4"),
                              ref["down_proj"][0][e])


@pytest.mark.parametrize("tensor", ["qweight", "scales"])
def test_verify_refuses_nonzero_padding(tensor, tmp_path, rng):
    """A byte set in the padded columns (a qweight code, or a scale byte: E8M0 code 1 is a scale like any other) is
    named; the true columns still compare equal, so only the padding is reported."""
    src = str(tmp_path / "src")
    write_ct_mxfp8(src, rng, 100, 64)
    out = tmp_path / "out"
    repack(src, out, **QUIET)
    path = os.path.join(out, "model.safetensors")
    st_file = SafetensorsFile(path)
    name = f"{ODD_PREFIX}.{tensor}"
    values = st_file.read(name).reshape(-1).view(np.uint8)
    data = bytearray(open(path, "rb").read())
    start = st_file.tensors[name].begin
    if tensor == "qweight":  # the last byte of the row's last tile: a code of column N_pad - 1 (padding)
        at = values.size - 1
    else:  # a padded scale column: the only zero bytes of random E8M0 codes (P64 places them inside the last chunk)
        at = int(np.flatnonzero(values == 0)[0])
        assert np.count_nonzero(values == 0) == 2 * (padded_n(100) - 100)
    data[start + at] = 1
    with open(path, "wb") as f:
        f.write(data)
    report = verify(out, src, progress=False)
    assert not report.ok
    assert any("padding past N = 100 must be zero bytes" in p and (
        "qweight code" if tensor == "qweight" else "scale byte 0x01") in p for p in report.problems), report.problems
