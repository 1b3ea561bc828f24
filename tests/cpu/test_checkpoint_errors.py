"""Bad checkpoints: each gives a clear error naming file, tensor and values, a non-zero exit, and nothing written
under the output name (no complete-looking directory, no leftover .partial directory)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from workbench import cli
from workbench.checkpoint import CheckpointError, repack
from workbench.checkpoint import synthetic as sy
from workbench.checkpoint.marlin_ckpt import open_marlin

PREFIX = "model.layers.0.mlp.up_proj"


def _source(tmp_path, opt=None, shapes=None, seed=0, shards=1):
    opt = opt or sy.Options(fmt="gptq", bits=4, group_size=64, sym=False)
    return sy.random_model(str(tmp_path / "src"), opt, shapes or {PREFIX: (256, 128)}, seed=seed, shards=shards)


def _edit_tensors(src: str, edit) -> None:
    path = os.path.join(src, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(src: str, edit) -> None:
    path = os.path.join(src, "config.json")
    config = json.load(open(path))
    edit(config["quantization_config"])
    json.dump(config, open(path, "w"))


def _fails(src, tmp_path, capsys, *needles):
    """repack must exit 2 with every needle in the message and leave nothing under the output name."""
    out = tmp_path / "out"
    assert cli.main(["repack", str(src), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
    assert not out.exists()
    assert not [p for p in os.listdir(tmp_path) if ".partial" in p]
    return err


def test_truncated_file(tmp_path, capsys):
    src = _source(tmp_path)
    path = os.path.join(src, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    _fails(src, tmp_path, capsys, path, "truncated", "needs data bytes")


def test_truncated_header(tmp_path, capsys):
    src = _source(tmp_path)
    path = os.path.join(src, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(40)
    _fails(src, tmp_path, capsys, path, "header length", "truncated")


def test_corrupted_header(tmp_path, capsys):
    src = _source(tmp_path)
    path = os.path.join(src, "model.safetensors")
    with open(path, "r+b") as f:
        f.seek(9)
        f.write(b"\x00garbage")
    _fails(src, tmp_path, capsys, path, "not valid JSON")


def test_missing_tensor(tmp_path, capsys):
    src = _source(tmp_path)
    _edit_tensors(src, lambda t: t.pop(f"{PREFIX}.scales"))
    _fails(src, tmp_path, capsys, f"{PREFIX}.scales is missing", "missing tensor")


def test_orphan_quantization_tensor(tmp_path, capsys):
    src = _source(tmp_path)
    def edit(t):
        t["model.layers.0.mlp.gate_proj.qzeros"] = t[f"{PREFIX}.qzeros"].copy()
    _edit_tensors(src, edit)
    _fails(src, tmp_path, capsys, "model.layers.0.mlp.gate_proj.qzeros", "no matching", "extra tensor")


def test_extra_tensor_in_quantized_layer(tmp_path, capsys):
    src = _source(tmp_path)
    def edit(t):
        t[f"{PREFIX}.weight"] = np.zeros((128, 256), np.float16)
    _edit_tensors(src, edit)
    _fails(src, tmp_path, capsys, f"{PREFIX}.weight", "extra tensor")


def test_index_lists_missing_tensor_and_file_holds_unlisted_one(tmp_path, capsys):
    src = _source(tmp_path, shards=2, shapes={PREFIX: (256, 128), "model.layers.0.mlp.down_proj": (128, 256)})
    index_path = os.path.join(src, "model.safetensors.index.json")
    index = json.load(open(index_path))
    good = json.dumps(index)
    index["weight_map"]["model.layers.9.ghost.weight"] = "model-00001-of-00002.safetensors"
    json.dump(index, open(index_path, "w"))
    _fails(src, tmp_path, capsys, "model.layers.9.ghost.weight", "missing tensor")
    index = json.loads(good)
    del index["weight_map"]["model.norm.weight"]
    json.dump(index, open(index_path, "w"))
    _fails(src, tmp_path, capsys, "'model.norm.weight'", "does not list", "extra tensor")


def test_shapes_contradict_config(tmp_path, capsys):
    src = _source(tmp_path)  # written with group_size 64: 4 groups for K = 256
    _edit_config(src, lambda qc: qc.update(group_size=128))
    _fails(src, tmp_path, capsys, f"{PREFIX}.scales", "4 groups", "group_size = 128", "gives 2")


def test_ct_weight_shape_contradicts_packed_tensor(tmp_path, capsys):
    src = _source(tmp_path, opt=sy.Options(fmt="compressed-tensors", bits=4, group_size=64))
    _edit_tensors(src, lambda t: t.update({f"{PREFIX}.weight_shape": np.array([128, 512], np.int64)}))
    _fails(src, tmp_path, capsys, f"{PREFIX}.weight_packed", "(N, K) = (128, 512)")


@pytest.mark.parametrize("bits", [2, 3, 16])
def test_unsupported_bits(bits, tmp_path, capsys):
    src = _source(tmp_path)
    _edit_config(src, lambda qc: qc.update(bits=bits))
    _fails(src, tmp_path, capsys, f"bits = {bits} is unsupported", "config.json")


def test_unsupported_group_size(tmp_path, capsys):
    opt = sy.Options(fmt="gptq", bits=4, group_size=256)  # the reference quantizer allows G = 256 only for K = 256
    src = sy.random_model(str(tmp_path / "src"), opt, {PREFIX: (256, 128)})
    _fails(src, tmp_path, capsys, PREFIX, "group size 256 is not one Marlin kernels are built for")


def test_qzeros_code_15(tmp_path, capsys):
    src = _source(tmp_path)
    def edit(t):
        qz = t[f"{PREFIX}.qzeros"].view(np.uint32).copy()
        qz[2, 5] |= np.uint32(0xF << 12)  # group 2, word 5, field 3 -> column 43
        t[f"{PREFIX}.qzeros"] = qz.view(np.int32)
    _edit_tensors(src, edit)
    _fails(src, tmp_path, capsys, f"{PREFIX}.qzeros", "group 2, column 43", "stores 15", "zero point would be 16")


def test_symmetric_config_with_asymmetric_qzeros(tmp_path, capsys):
    src = _source(tmp_path)  # asymmetric data
    _edit_config(src, lambda qc: qc.update(sym=True))
    _fails(src, tmp_path, capsys, f"{PREFIX}.qzeros", "sym = true needs every stored zero = 7")


def test_g_idx_without_act_order(tmp_path, capsys):
    src = _source(tmp_path, opt=sy.Options(fmt="gptq", bits=4, group_size=64, act_order=True))
    _edit_config(src, lambda qc: qc.update(desc_act=False))
    _fails(src, tmp_path, capsys, f"{PREFIX}.g_idx", "act-order is off")


def test_mixed_formats(tmp_path, capsys):
    src = _source(tmp_path)
    def edit(t):
        t["model.layers.1.mlp.up_proj.weight_packed"] = np.zeros((128, 32), np.int32)
    _edit_tensors(src, edit)
    _fails(src, tmp_path, capsys, "mixed formats", "model.layers.1.mlp.up_proj.weight_packed", "compressed-tensors")


def test_fp8_tensor_in_gptq_checkpoint(tmp_path, capsys):
    import ml_dtypes

    src = _source(tmp_path)
    _edit_tensors(src, lambda t: t.update({"model.layers.1.mlp.up_proj.weight": np.zeros((4, 4), ml_dtypes.float8_e4m3fn)}))
    _fails(src, tmp_path, capsys, "mixed formats", "model.layers.1.mlp.up_proj.weight")


def test_quantized_tensors_without_settings(tmp_path, capsys):
    src = _source(tmp_path)
    config = json.load(open(os.path.join(src, "config.json")))
    del config["quantization_config"]
    json.dump(config, open(os.path.join(src, "config.json"), "w"))
    _fails(src, tmp_path, capsys, "looks quantized", "no quantization")


def test_failure_mid_repack_leaves_nothing(tmp_path, monkeypatch):
    import importlib

    repack_module = importlib.import_module("workbench.checkpoint.repack")

    shapes = {f"model.layers.{i}.mlp.up_proj": (256, 128) for i in range(4)}
    src = _source(tmp_path, shapes=shapes)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise CheckpointError("injected failure in layer 3")
        return real(*args, **kwargs)

    real = repack_module.to_marlin
    monkeypatch.setattr(repack_module, "to_marlin", failing)
    with pytest.raises(CheckpointError, match="injected"):
        repack(src, tmp_path / "out", progress=False, log=lambda m: None)
    assert not (tmp_path / "out").exists()
    assert not [p for p in os.listdir(tmp_path) if ".partial" in p]


def test_killed_repack_leaves_no_complete_looking_output(tmp_path):
    # enough layers that the repack runs for a while; killed as soon as the first output bytes exist
    opt = sy.Options(fmt="gptq", bits=4, group_size=128, act_order=True)
    w = np.random.default_rng(0).standard_normal((1024, 512)).astype(np.float32)
    one = sy.quantized_tensors("x", w, opt, seed=1)  # one layer, repeated under 48 names (fast to generate)
    tensors = {f"model.layers.{i}.mlp.up_proj{k[1:]}": v for i in range(48) for k, v in one.items()}
    src = sy.write_checkpoint(str(tmp_path / "src"), tensors, opt)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "workbench", "repack", src, "--out", str(out), "--no-progress"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = None
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        found = [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
        if found and any(f.stat().st_size > 0 for f in found[0].glob("*.safetensors")):
            partial = found[0]
            break
        time.sleep(0.005)
    assert partial is not None, "repack finished before it could be interrupted; make the checkpoint larger"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()  # the output name never appears
    with pytest.raises(CheckpointError, match="not a complete Marlin checkpoint"):
        open_marlin(partial)


def test_ct_symmetric_layer_with_zero_points(tmp_path, capsys):
    from workbench.checkpoint import inspect

    opt = sy.Options(fmt="compressed-tensors", bits=4, group_size=64)
    src = _source(tmp_path, opt=opt)
    # older compressed-tensors saved all-zero int8 zero points for symmetric layers: accepted
    _edit_tensors(src, lambda t: t.update({f"{PREFIX}.weight_zero_point": np.zeros((128, 4), np.int8)}))
    assert inspect(src).layers[0].compatible
    _edit_tensors(src, lambda t: t.update({f"{PREFIX}.weight_zero_point": np.ones((128, 4), np.int8)}))
    _fails(src, tmp_path, capsys, f"{PREFIX}.weight_zero_point", "symmetric")
