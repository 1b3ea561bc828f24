"""Checkpoint round trips: every source format and option -> repack -> verify -> load, compared bit for bit with the
reference repack of the same quantized weights (``workbench.weight.make_marlin_weight``), not with our own inverse."""
from __future__ import annotations

import json
import os
import struct
import zlib

import ml_dtypes
import numpy as np
import pytest

from workbench import cli
from workbench.checkpoint import inspect, load, repack, verify
from workbench.checkpoint import synthetic as sy
from workbench.checkpoint.safetensors_io import SafetensorsFile
from workbench.formats import fp8 as fp8_ref
from workbench.formats.marlin_tile import marlin_repack_codes, marlin_unpack_codes, marlin_word_field_to_kn
from workbench.formats.scales import unpermute_scales
from workbench.weight import make_marlin_weight

PREFIX = "model.layers.0.self_attn.q_proj"
QUIET = dict(progress=False, log=lambda msg: None)

CASES = {  # id -> Options
    "gptq-u4b8-g128": sy.Options(fmt="gptq", bits=4, group_size=128),
    "gptq-u4-g64": sy.Options(fmt="gptq", bits=4, group_size=64, sym=False),
    "gptq-u4b8-g128-actorder": sy.Options(fmt="gptq", bits=4, group_size=128, act_order=True, bias=True),
    "gptq-u8b128-g32-actorder": sy.Options(fmt="gptq", bits=8, group_size=32, act_order=True),
    "gptq-u8b128-channel": sy.Options(fmt="gptq", bits=8, group_size=-1, config_style="quantize_config.json"),
    "gptq-u8-g128": sy.Options(fmt="gptq", bits=8, group_size=128, sym=False),
    "gptq_v2-u4-g32": sy.Options(fmt="gptq_v2", bits=4, group_size=32, sym=False),
    "gptq_v2-u4b8-g64-bf16": sy.Options(fmt="gptq_v2", bits=4, group_size=64, act_dtype=ml_dtypes.bfloat16),
    "awq-u4-g128": sy.Options(fmt="awq", bits=4, group_size=128),
    "awq-u4-g64-quant_config": sy.Options(fmt="awq", bits=4, group_size=64, config_style="quant_config.json"),
    "awq-u4-channel": sy.Options(fmt="awq", bits=4, group_size=-1),
    "ct-u4b8-g128": sy.Options(fmt="compressed-tensors", bits=4, group_size=128),
    "ct-u4-g64": sy.Options(fmt="compressed-tensors", bits=4, group_size=64, sym=False),
    "ct-u4-channel-bf16": sy.Options(fmt="compressed-tensors", bits=4, group_size=-1, sym=False,
                                     act_dtype=ml_dtypes.bfloat16),
    "ct-u8b128-g32-actorder": sy.Options(fmt="compressed-tensors", bits=8, group_size=32, act_order=True),
    "ct-u8-g128": sy.Options(fmt="compressed-tensors", bits=8, group_size=128, sym=False),
}


def _bits_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _assert_same_marlin(got, want) -> None:
    for field in ("qweight", "scales", "zeros", "g_idx", "perm"):
        a, b = getattr(got, field), getattr(want, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert _bits_equal(a, b), field
    assert (got.size_k, got.size_n, got.group_size, got.weight_type) == (
        want.size_k, want.size_n, want.group_size, want.weight_type)


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_matches_reference_repack(case, tmp_path):
    opt = CASES[case]
    rng = np.random.default_rng(zlib.crc32(case.encode()))  # str hash is salted per process
    w = rng.standard_normal((256, 192)).astype(np.float32) * 0.05
    q = sy.quantize(w, opt, seed=int(rng.integers(1 << 30)))
    tensors = sy.encode(PREFIX, q, opt, seed=3)
    tensors["model.norm.weight"] = rng.standard_normal(256).astype(np.float32)
    src = sy.write_checkpoint(str(tmp_path / "src"), tensors, opt)
    out = str(tmp_path / "out")
    assert cli.main(["repack", src, "--out", out, "--no-progress"]) == 0
    assert cli.main(["verify", out, "--against", src, "--no-progress"]) == 0
    want = make_marlin_weight(q)
    _assert_same_marlin(load(out)[PREFIX], want)
    _assert_same_marlin(load(src)[PREFIX], want)  # in-memory conversion of the source gives the same
    # everything else is carried over byte for byte
    st = SafetensorsFile(os.path.join(out, "model.safetensors"))
    assert _bits_equal(st.read("model.norm.weight"), tensors["model.norm.weight"])
    if opt.bias:
        assert _bits_equal(st.read(f"{PREFIX}.bias"), tensors[f"{PREFIX}.bias"])
    assert st.metadata["workbench_format"] == "marlin-workbench"
    layer = json.loads(st.metadata["marlin_layers"])[PREFIX]
    assert layer["source_format"] == opt.fmt and layer["size_k"] == 256 and layer["size_n"] == 192
    assert layer["group_size"] == opt.group_size and layer["act_order"] == opt.act_order


def test_block_fp8_round_trip(tmp_path):
    rng = np.random.default_rng(7)
    opt = sy.Options(fmt="block-fp8")
    w = rng.standard_normal((384, 320)).astype(np.float32) * 0.05  # N = 320: the last 128-row block is partial
    tensors = sy.block_fp8_tensors(PREFIX, w)
    src = sy.write_checkpoint(str(tmp_path / "src"), tensors, opt)
    repack(src, tmp_path / "out", **QUIET)
    report = verify(tmp_path / "out", src, progress=False)
    assert report.ok, report.problems
    got = load(tmp_path / "out")[PREFIX]
    row_major = tensors[f"{PREFIX}.weight"].view(np.uint8)  # (N, K)
    assert np.array_equal(got.qweight, marlin_repack_codes(np.ascontiguousarray(row_major.T), 8))
    want_scales = fp8_ref.block_fp8_group128_scales(tensors[f"{PREFIX}.weight_scale_inv"], 384, 320)
    assert _bits_equal(got.scales, want_scales)
    assert got.weight_type.label == "fe4m3fn" and got.zeros is None and got.perm is None


MOE_CASES = {
    "gptq-actorder": (sy.Options(fmt="gptq", bits=4, group_size=64, act_order=True), False, False),
    "gptq-u4-mixtral-names": (sy.Options(fmt="gptq", bits=4, group_size=128, sym=False), False, True),
    "awq-fused-gate_up": (sy.Options(fmt="awq", bits=4, group_size=128), True, False),
    "ct-u8": (sy.Options(fmt="compressed-tensors", bits=8, group_size=-1), False, False),
    "block-fp8": (sy.Options(fmt="block-fp8"), False, False),
}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_experts_stack_and_fuse(case, tmp_path):
    opt, fused, mixtral = MOE_CASES[case]
    experts, hidden, inter = 3, 256, 128
    src = sy.random_model(str(tmp_path / "src"), opt, {}, experts=experts, expert_shape=(hidden, inter),
                          fused_experts=fused, shards=2, seed=11, mixtral_names=mixtral)
    plan = inspect(src)
    base = "model.layers.0.block_sparse_moe" if mixtral else "model.layers.0.mlp"
    names = {s.name: s for s in plan.layers}
    assert set(names) == {f"{base}.experts.gate_up_proj", f"{base}.experts.down_proj"}
    gu = names[f"{base}.experts.gate_up_proj"]
    assert (gu.num_experts, gu.size_k, gu.size_n) == (experts, hidden, 2 * inter)
    repack(src, tmp_path / "out", **QUIET)
    report = verify(tmp_path / "out", src, progress=False)
    assert report.ok, report.problems
    weights = load(tmp_path / "out")
    stack = weights[f"{base}.experts.gate_up_proj"]
    pf = 32 // gu.bits
    assert stack.qweight.shape == (experts, hidden // 16, 2 * inter * 16 // pf)
    assert weights[f"{base}.experts.down_proj"].qweight.shape == (experts, inter // 16, hidden * 16 // pf)
    # independent check of the fusion: expert e's codes = [gate | up] of the source, read with the formats reference
    src_ckpt = load(src)  # in-memory path, same stacking
    for e in range(experts):
        one = stack.expert(e)
        codes = marlin_unpack_codes(one.qweight, hidden, 2 * inter, gu.bits)
        if one.perm is not None:
            restored = np.empty_like(codes)
            restored[one.perm] = codes
            codes = restored
        parts = [p.prefix for p in gu.parts[e]]
        from workbench.checkpoint.convert import _source_codes
        from workbench.checkpoint.source import open_source

        s = open_source(src)
        want = np.concatenate([_source_codes(s, gu, p) for p in gu.parts[e]], axis=1)
        assert np.array_equal(codes, want), parts
        _assert_same_marlin(src_ckpt[f"{base}.experts.gate_up_proj"].expert(e), one)


def test_sharded_input_and_output(tmp_path):
    opt = sy.Options(fmt="gptq", bits=4, group_size=128, sym=False)
    shapes = {f"model.layers.{i}.mlp.{p}": (256, 128) for i in range(3) for p in ("up_proj", "down_proj")}
    src = sy.random_model(str(tmp_path / "src"), opt, shapes, shards=3, seed=5)
    out = tmp_path / "out"
    assert cli.main(["repack", src, "--out", str(out), "--max-shard-size", "40KB", "--no-progress"]) == 0
    files = sorted(p for p in os.listdir(out) if p.endswith(".safetensors"))
    assert len(files) > 1 and os.path.exists(out / "model.safetensors.index.json")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert os.path.exists(out / "config.json")  # the source's other files are carried over
    assert verify(out, src, progress=False).ok
    assert len(load(out)) == 6


def _rewrite_field(path: str, tensor: str, word: int, field: int, bits: int) -> None:
    """Flip every bit of one field of one int32 word of a tensor, in place."""
    st = SafetensorsFile(path)
    info = st.tensors[tensor]
    with open(path, "r+b") as f:
        f.seek(info.begin + 4 * word)
        (value,) = struct.unpack("<I", f.read(4))
        f.seek(info.begin + 4 * word)
        f.write(struct.pack("<I", value ^ (((1 << bits) - 1) << (bits * field))))


@pytest.mark.parametrize("bits", [4, 8])
def test_verify_names_the_corrupted_word_and_field(bits, tmp_path, capsys):
    opt = sy.Options(fmt="gptq", bits=bits, group_size=64)
    src = sy.random_model(str(tmp_path / "src"), opt, {PREFIX: (256, 192)}, seed=bits)
    out = tmp_path / "out"
    repack(src, out, **QUIET)
    rng = np.random.default_rng(bits)
    n_words = (256 // 16) * (192 * 16 // (32 // bits))
    word, field = int(rng.integers(n_words)), int(rng.integers(32 // bits))
    _rewrite_field(str(out / "model.safetensors"), f"{PREFIX}.qweight", word, field, bits)
    report = verify(out, src, progress=False)
    assert not report.ok
    k, n = marlin_word_field_to_kn(word, field, 192, bits)
    message = report.problems[0]
    assert f"word {word} " in message and f"field {field}" in message, message
    assert f"(k={int(k)}, n={int(n)})" in message and "tile" in message and "sub-block" in message
    assert "lane" in message
    assert cli.main(["verify", str(out), "--against", src, "--no-progress"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_verify_reports_a_corrupted_scale(tmp_path):
    opt = sy.Options(fmt="awq", bits=4, group_size=64)
    src = sy.random_model(str(tmp_path / "src"), opt, {PREFIX: (256, 128)}, seed=2)
    out = tmp_path / "out"
    repack(src, out, **QUIET)
    path = str(out / "model.safetensors")
    info = SafetensorsFile(path).tensors[f"{PREFIX}.scales"]
    with open(path, "r+b") as f:  # flip the sign of the scale at flat index 70 (group 0, permuted column 70)
        f.seek(info.begin + 2 * 70 + 1)
        b = f.read(1)[0]
        f.seek(info.begin + 2 * 70 + 1)
        f.write(bytes([b ^ 0x80]))
    report = verify(out, src, progress=False)
    assert len(report.problems) == 1 and f"{PREFIX}.scales" in report.problems[0]
    # unpermuted column that the flipped entry belongs to
    col = int(np.flatnonzero(unpermute_scales(np.arange(4 * 128).reshape(4, 128), 256, 128, 64)[0] == 70)[0])
    assert f"[0, {col}]" in report.problems[0], report.problems[0]


def test_inspect_table_and_reasons(tmp_path, capsys):
    opt = sy.Options(fmt="gptq", bits=4, group_size=64)
    # N = 136 and K = 192 are not whole Marlin tiles / thread tiles: padded (tests/cpu/test_checkpoint_odd_shapes.py)
    shapes = {"model.layers.0.mlp.up_proj": (256, 136), "model.layers.0.mlp.down_proj": (192, 128),
              "model.layers.0.self_attn.o_proj": (256, 128)}
    src = sy.random_model(str(tmp_path / "src"), opt, shapes, seed=1)
    assert cli.main(["inspect", src]) == 0
    text = capsys.readouterr().out
    o_proj = next(line for line in text.splitlines() if line.startswith("model.layers.0.self_attn.o_proj"))
    assert "u4b8" in o_proj and "256 x 128" in o_proj and o_proj.rstrip().endswith("yes")
    up = next(line for line in text.splitlines() if line.startswith("model.layers.0.mlp.up_proj"))
    assert "256 x 136" in up and up.rstrip().endswith("yes")
    # what Marlin cannot take is named, and repack refuses it before writing anything
    bad = sy.random_model(str(tmp_path / "bad"), sy.Options(fmt="gptq", bits=4, group_size=64, act_order=True,
                                                            sym=False), {"model.layers.0.mlp.up_proj": (256, 128)})
    assert cli.main(["inspect", bad]) == 1
    assert "act-order with zero points is not supported" in capsys.readouterr().out
    out = tmp_path / "out"
    assert cli.main(["repack", bad, "--out", str(out), "--no-progress"]) == 2
    assert "act-order with zero points" in capsys.readouterr().err
    assert not os.path.exists(out) and not [p for p in os.listdir(tmp_path) if ".partial" in p]


def test_refuses_to_overwrite_without_force(tmp_path, capsys):
    opt = sy.Options(fmt="gptq")
    src = sy.random_model(str(tmp_path / "src"), opt, {PREFIX: (256, 128)}, seed=4)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cli.main(["repack", src, "--out", str(out), "--no-progress"]) == 2
    assert "--force" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"
    # --force replaces only a directory this tool wrote: the user's directory stays
    assert cli.main(["repack", src, "--out", str(out), "--force", "--no-progress"]) == 2
    assert "not written by `workbench repack`" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    out.rmdir()
    assert cli.main(["repack", src, "--out", str(out), "--no-progress"]) == 0
    (out / "stale.txt").write_text("from an earlier run")
    assert cli.main(["repack", src, "--out", str(out), "--force", "--no-progress"]) == 0
    assert not (out / "stale.txt").exists() and verify(out, src, progress=False).ok
    assert "compiled host loops on the CPU" in capsys.readouterr().err  # says which path ran


def test_reader_agrees_with_safetensors_library(tmp_path):
    from safetensors import safe_open

    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
               "b": rng.integers(-2**31, 2**31, (4, 4), dtype=np.int64).astype(np.int32),
               "c": rng.standard_normal(7).astype(np.float16), "d": np.arange(6, dtype=np.uint8).reshape(2, 3)}
    from safetensors.numpy import save_file

    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"k": "v"})
    st = SafetensorsFile(tmp_path / "x.safetensors")
    assert st.metadata == {"k": "v"}
    with safe_open(str(tmp_path / "x.safetensors"), "numpy") as ref:
        for name in tensors:
            assert _bits_equal(st.read(name), ref.get_tensor(name))


@pytest.mark.parametrize("case", ["gptq-u4-g64", "gptq-u4b8-g128-actorder", "awq-u4-g64-quant_config",
                                  "ct-u4-g64", "ct-u8b128-g32-actorder", "block-fp8"])
def test_column_blocks_give_the_same_tensors(case, tmp_path):
    """Converting 64 (FP8: 128) columns at a time must equal the one-shot reference repack."""
    from workbench.checkpoint.convert import to_marlin
    from workbench.checkpoint.source import open_source

    opt = CASES.get(case, sy.Options(fmt="block-fp8"))
    src = sy.random_model(str(tmp_path / "src"), opt, {PREFIX: (256, 448)}, seed=9)
    s = open_source(src)
    spec = inspect(src).layers[0]
    whole = to_marlin(s, spec, 0, "numpy", column_block=512)
    blocked = to_marlin(s, spec, 0, "numpy", column_block=64)
    for field in ("qweight", "scales", "zeros", "g_idx", "perm"):
        a, b = getattr(whole, field), getattr(blocked, field)
        assert (a is None) == (b is None) and (a is None or _bits_equal(a, b)), field
    if opt.fmt != "block-fp8":
        from workbench.checkpoint.convert import _source_codes

        codes = marlin_unpack_codes(blocked.qweight, 256, 448, spec.bits)
        if blocked.perm is not None:
            restored = np.empty_like(codes)
            restored[blocked.perm] = codes
            codes = restored
        assert np.array_equal(codes, _source_codes(s, spec, spec.parts[0][0]))


def test_inspect_a_marlin_checkpoint_and_top_level_load(tmp_path, capsys):
    import workbench

    opt = sy.Options(fmt="compressed-tensors", bits=4, group_size=64, sym=False)
    src = sy.random_model(str(tmp_path / "src"), opt, {PREFIX: (256, 128)}, seed=6)
    out = tmp_path / "out"
    repack(src, out, **QUIET)
    assert cli.main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert PREFIX in text and "u4" in text and "compressed-tensors" in text
    weights = workbench.load(out, layers=[PREFIX])
    assert list(weights) == [PREFIX] and weights[PREFIX].zeros is not None
    with pytest.raises(ValueError, match="no quantized layer named"):
        workbench.load(out, layers=["nope"])
