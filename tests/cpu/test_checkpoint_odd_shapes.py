"""Checkpoints whose layers are not whole Marlin tiles (docs/formats.md, "Shapes that are not tile multiples"):
inspect accepts them and reports the padding, repack writes the padded Marlin tensors with the true sizes in the
manifest and the file metadata, verify takes them back bit for bit and refuses nonzero padding, load gives
MarlinWeight objects with the true sizes."""
from __future__ import annotations

import json
import os
import zlib

import ml_dtypes
import numpy as np
import pytest

from workbench import cli
from workbench.checkpoint import inspect, load, repack, verify
from workbench.checkpoint import synthetic as sy
from workbench.checkpoint.repack import padding_overhead
from workbench.checkpoint.safetensors_io import SafetensorsFile
from workbench.formats._checks import padded_k, padded_n
from workbench.weight import make_marlin_weight

PREFIX = "model.layers.0.mlp.down_proj"
QUIET = dict(progress=False, log=lambda msg: None)

CASES = {  # id -> (Options, K, N): K a multiple of the pack factor where the format packs along K
    "gptq-u4b8-partial-group": (sy.Options(fmt="gptq", bits=4, group_size=128), 200, 104),
    "gptq-u4-actorder-partial-group": (sy.Options(fmt="gptq", bits=4, group_size=64, act_order=True), 136, 72),
    "gptq_v2-u4-asym": (sy.Options(fmt="gptq_v2", bits=4, group_size=32, sym=False), 40, 200),
    "gptq-u8b128-channel": (sy.Options(fmt="gptq", bits=8, group_size=-1), 44, 68),
    "awq-u4-g64": (sy.Options(fmt="awq", bits=4, group_size=64), 100, 88),
    "ct-u8-asym-bf16": (sy.Options(fmt="compressed-tensors", bits=8, group_size=32, sym=False,
                                   act_dtype=ml_dtypes.bfloat16), 52, 68),
}


def _bits_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("case", list(CASES))
def test_odd_layer_round_trip(case, tmp_path, capsys):
    opt, k, n = CASES[case]
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.05
    q = sy.quantize(w, opt, seed=int(rng.integers(1 << 30)))
    src = sy.write_checkpoint(str(tmp_path / "src"), sy.encode(PREFIX, q, opt, seed=3), opt)
    plan = inspect(src)
    assert plan.layers[0].compatible, plan.layers[0].problems
    assert cli.main(["inspect", src, "--json"]) == 0
    padding = json.loads(capsys.readouterr().out)["layers"][0]["padding"]
    assert padding == padding_overhead(plan.layers[0]) and padding[0]["tensor"] == f"{PREFIX}.qweight"
    assert padding[0]["rule_extra_bytes"] == (padded_k(k) * padded_n(n) - k * n) * opt.bits // 8
    out = str(tmp_path / "out")
    assert cli.main(["repack", src, "--out", out, "--no-progress"]) == 0
    assert cli.main(["verify", out, "--against", src, "--no-progress"]) == 0
    got = load(out)[PREFIX]
    want = make_marlin_weight(q)
    assert (got.size_k, got.size_n) == (k, n)
    for field in ("qweight", "scales", "zeros", "g_idx", "perm"):
        a, b = getattr(got, field), getattr(want, field)
        assert (a is None) == (b is None) and (a is None or _bits_equal(a, b)), field
    assert got.qweight.shape == (padded_k(k) // 16, padded_n(n) * 16 // (32 // opt.bits))
    layer = json.loads(SafetensorsFile(os.path.join(out, "model.safetensors")).metadata["marlin_layers"])[PREFIX]
    assert (layer["size_k"], layer["size_n"]) == (k, n)  # the true sizes travel with the tensors


def test_block_fp8_partial_blocks_round_trip(tmp_path):
    k, n = 200, 100  # a partial 128-block at both edges, N not a multiple of 64
    w = np.random.default_rng(5).standard_normal((k, n)).astype(np.float32) * 0.05
    tensors = sy.block_fp8_tensors(PREFIX, w)
    assert tensors[f"{PREFIX}.weight_scale_inv"].shape == (1, 2)
    src = sy.write_checkpoint(str(tmp_path / "src"), tensors, sy.Options(fmt="block-fp8"))
    repack(src, tmp_path / "out", **QUIET)
    report = verify(tmp_path / "out", src, progress=False)
    assert report.ok, report.problems
    got = load(tmp_path / "out")[PREFIX]
    assert (got.size_k, got.size_n, got.scales.shape) == (k, n, (2, padded_n(n)))


def test_verify_refuses_nonzero_padding(tmp_path):
    opt, k, n = CASES["gptq-u4b8-partial-group"]
    q = sy.quantize(np.random.default_rng(1).standard_normal((k, n)).astype(np.float32), opt, seed=2)
    src = sy.write_checkpoint(str(tmp_path / "src"), sy.encode(PREFIX, q, opt), opt)
    out = tmp_path / "out"
    repack(src, out, **QUIET)
    path = os.path.join(out, "model.safetensors")
    st = SafetensorsFile(path)
    name = f"{PREFIX}.scales"
    scales = st.read(name)
    data = bytearray(open(path, "rb").read())
    start = st.tensors[name].begin  # absolute file offset
    # a padded scale column: which Marlin position holds a logical column >= n is the permutation's business, so set
    # every position whose value is 0 (only the padding is 0: the scales of random weights are not)
    zero = np.flatnonzero(scales.reshape(-1).view(np.uint16) == 0)
    assert zero.size == scales.shape[0] * (padded_n(n) - n)
    data[start + 2 * zero[0]: start + 2 * zero[0] + 2] = np.float16(1).tobytes()
    with open(path, "wb") as f:
        f.write(data)
    report = verify(out, src, progress=False)
    assert not report.ok
    assert any("padding past K x N = 200 x 104 must be zero bytes" in p and "scale" in p for p in report.problems)


def test_inspect_table_shows_the_padding(tmp_path, capsys):
    """The motivating shapes: N = 7392 (Qwen2-72B's 29568 at TP4) and K = 10944 with groups of 128."""
    opt = sy.Options(fmt="gptq", bits=4, group_size=128)
    up = "model.layers.0.mlp.up_proj"
    src = sy.random_model(str(tmp_path / "src"), opt, {PREFIX: (128, 7392), up: (10944, 128)})
    assert cli.main(["inspect", src]) == 0
    table = capsys.readouterr().out
    assert "pad: tile / 128" in table
    rows = {row.split()[0]: row for row in table.splitlines()[2:] if row.startswith("model.")}
    # N = 7392 -> 7424 either way (32 columns): qweight 128 * 32 / 2 bytes + one group of fp16 scales, 32 * 2
    assert "+2.1 KiB / +2.1 KiB" in rows[PREFIX]
    # K = 10944 is whole 16-row tiles; padding it to 11008 would add 64 rows * 128 columns / 2 bytes
    assert "+0 B / +4.0 KiB" in rows[up]
    assert cli.main(["inspect", src, "--padding"]) == 0
    per_tensor = {row.split()[0]: row.split() for row in capsys.readouterr().out.splitlines()
                  if row.startswith("model.") and row.split()[0].endswith((".qweight", ".scales"))}
    assert per_tensor[f"{PREFIX}.qweight"][-4:] == ["+2.0", "KiB", "+2.0", "KiB"]  # 128 x 32 codes, 4 bits
    assert per_tensor[f"{up}.scales"][-4:] == ["+0", "B", "+0", "B"]  # 86 groups either way


def test_fused_segments_must_be_whole_tiles_but_the_last(tmp_path):
    """Fused expert projections are concatenated Marlin tensors, so only the last segment may end in padding."""
    opt = sy.Options(fmt="awq", bits=4, group_size=128)
    src = sy.random_model(str(tmp_path / "src"), opt, {}, experts=2, expert_shape=(128, 72))
    problems = [p for s in inspect(src).layers for p in s.problems]
    assert any("every segment but the last must be a multiple of 64" in p and "[72, 72]" in p for p in problems)
