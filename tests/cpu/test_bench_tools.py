"""The bench scripts' CPU side: bench/timing.py's statistics, interleaving and results schema (with fake timers),
the A/B tool's variant parsing, the peers harness's generated dispatcher, and the GEMM bench's |W| weights (on CPU
torch tensors, decoded code by code)."""
from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import ab  # noqa: E402
import bench_gemm  # noqa: E402
import bench_moe  # noqa: E402
import peers  # noqa: E402
import timing  # noqa: E402


def test_copies_rotate_past_the_l2_multiple():
    l2 = 50 << 20
    for nbytes in (1, 4096 * 4096 // 2, 60 << 20, 1 << 30):
        c = timing.copies_for(nbytes, l2)
        assert c >= 2
        assert c * nbytes >= timing.L2_MULTIPLE * l2 or c == 2
        assert c == 2 or (c - 1) * nbytes < timing.L2_MULTIPLE * l2  # no more copies than needed
    with pytest.raises(ValueError, match="nbytes"):
        timing.copies_for(0, l2)


def test_summary_is_median_and_inclusive_quartiles():
    s = timing.summary([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s["us"], s["q1"], s["q3"], s["n"]) == (3.0, 2.0, 4.0, 5)
    assert timing.summary([7.0])["us"] == 7.0
    s2 = timing.summary([1.0, 3.0])
    assert s2["us"] == 2.0 and s2["q1"] <= 2.0 <= s2["q3"]
    with pytest.raises(ValueError):
        timing.summary([])


def test_interleaved_rotates_the_order_and_reports_each_timers_median():
    order = []

    def fake(name, values):
        it = iter(values)

        def call():
            order.append(name)
            return next(it)
        return call

    out = timing.interleaved({"a": fake("a", [10, 30, 20]), "b": fake("b", [1, 2, 100]), "c": fake("c", [5, 5, 5])},
                             rounds=3)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert out["a"]["us"] == 20 and out["b"]["us"] == 2 and out["c"]["us"] == 5
    assert all(v["n"] == 3 for v in out.values())


def test_gbs():
    assert timing.gbs(1e9, 1e6) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        timing.gbs(1, 0)


def _meta():
    return {"gpu": "fake", "sms": 1, "date": "2026-01-01", "commit": "x", "torch": "t", "cupy": "c", "nvcc": "n",
            "ceilings": {"copy_gbs": 1.0, "read_gbs": 1.0, "mma_tflops": None, "cublas_tflops": None},
            "method": {}, "peers": {}}


def test_results_file_has_the_schema_and_rejects_incomplete_rows(tmp_path):
    row = dict(layer="4096x4096", n=4096, k=4096, m=1, wtype="u4b8", group=128, act="fp16", launch="graph",
               method="ours", us=3.5, gbs=2500.0)
    path = timing.write_results(tmp_path, "gemm", _meta(), [row])
    doc = json.loads(path.read_text())
    assert path.name == "gemm.json" and doc["schema"] == 1 and doc["family"] == "gemm" and doc["rows"] == [row]
    with pytest.raises(ValueError, match=r"rows\[0\] lacks the required key 'gbs'"):
        timing.write_results(tmp_path, "gemm", _meta(), [{k: v for k, v in row.items() if k != "gbs"}])
    for us in (0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="must be a positive time"):
            timing.write_results(tmp_path, "gemm", _meta(), [dict(row, us=us)])
    with pytest.raises(ValueError, match="'eager', not one of"):
        timing.write_results(tmp_path, "gemm", _meta(), [dict(row, launch="eager")])
    with pytest.raises(ValueError, match="family 'sweeps' is not one of"):
        timing.write_results(tmp_path, "sweeps", _meta(), [row])
    bad = _meta()
    del bad["ceilings"]["read_gbs"]
    with pytest.raises(ValueError, match="read_gbs"):
        timing.write_results(tmp_path, "gemm", bad, [row])
    assert json.loads(path.read_text())["rows"] == [row]  # a rejected write leaves the file as it was
    assert not (tmp_path / "sweeps.json").exists()
    timing.results_document("moe", _meta(), [dict(model="mixtral", experts=8, topk=2, n=14336, k=4096, m=1,
                                                  wtype="u4b8", group=128, act="fp16", launch="graph", method="ours",
                                                  us=10.0)])
    timing.results_document("repack", _meta(), [dict(op="gptq_marlin_repack", n=1, k=1, wtype="u4b8", method="ours",
                                                     us=1.0, gbs=1.0, pct_copy=1.0)])


def test_ab_variants_parse_to_policy_replacements():
    from workbench.policy import DEFAULT_GEMM_POLICY

    name, fields = ab.parse_variant("nopdl:programmatic_launch=False,cluster_sizes=(2, 4)")
    assert name == "nopdl" and fields == {"programmatic_launch": False, "cluster_sizes": (2, 4)}
    p = ab.policy_variant(DEFAULT_GEMM_POLICY, fields)
    assert p.programmatic_launch is False and p.cluster_sizes == (2, 4) and p.align_slices == \
        DEFAULT_GEMM_POLICY.align_slices
    for bad in ("nopdl", "nopdl:", "x:programmatic_launch", "x:programmatic_launch=nope"):
        with pytest.raises(ValueError):
            ab.parse_variant(bad)
    with pytest.raises(ValueError, match="no_such_knob"):
        ab.policy_variant(DEFAULT_GEMM_POLICY, {"no_such_knob": 1})
    v = ab.variants_of("new-module", "old-module", DEFAULT_GEMM_POLICY, ["nopdl:programmatic_launch=False"])
    assert v["new"] == ("new-module", DEFAULT_GEMM_POLICY) and v["old"] == ("old-module", None)
    assert v["nopdl"][0] == "new-module" and v["nopdl"][1].programmatic_launch is False
    with pytest.raises(ValueError, match="taken"):
        ab.variants_of("n", "o", DEFAULT_GEMM_POLICY, ["old:swap_max_m=0"])


def test_ab_loads_an_old_tree_as_a_second_package(tmp_path):
    """A whole old checkout's workbench becomes workbench_old, its imports of workbench renamed to itself."""
    old = tmp_path / "old"
    (old / "workbench").mkdir(parents=True)
    (old / "kernels_cuda").mkdir()
    (old / "workbench" / "__init__.py").write_text("")
    (old / "workbench" / "gemm.py").write_text("from workbench import weight\nimport workbench.weight as w2\n"
                                               "import pathlib\nKERNELS = pathlib.Path(__file__).parent.parent / "
                                               "'kernels_cuda'\n")
    (old / "workbench" / "weight.py").write_text("ORIGIN = 'old'\n")
    pkg = ab.load_old(old)
    try:
        g = ab.importlib_module(pkg, "gemm")
        assert g.weight.ORIGIN == "old" and g.w2.__name__ == "workbench_old.weight"
        assert g.KERNELS.resolve() == (old / "kernels_cuda").resolve()
    finally:
        for name in [n for n in sys.modules if n == "workbench_old" or n.startswith("workbench_old.")]:
            del sys.modules[name]
    with pytest.raises(FileNotFoundError, match="no workbench package"):
        ab.load_old(tmp_path / "nothing")


def test_vllm_dispatcher_lists_exactly_the_kernels_built():
    insts = peers.instantiations(["u4b8", "fe4m3fn"])
    assert len(insts) == 2 * (3 * 2 + 3 * 3) and len(set(insts)) == len(insts)
    assert {i[5] for i in insts if i[0] == "vllm::kU4B8"} == {8} and {i[5] for i in insts
                                                                     if i[0] == "vllm::kFE4M3fn"} == {-1}
    source = ("#define _GET_IF(...) x\nstatic int before;\n"
              "template <typename scalar_t>\nMarlinFuncPtr get_marlin_kernel(const vllm::ScalarType q_type,\n"
              "    int stages) {\n  auto kernel = MarlinDefault;\n  COMMON_GET_IF(vllm::kU4, 2)\n"
              "  return kernel;\n}\nstatic int after;\n")
    cut = peers._dispatcher(source, insts)
    assert "COMMON_GET_IF" not in cut and "static int before;" in cut and "static int after;" in cut
    assert cut.count("_GET_IF(vllm::") == len(insts)
    for t, mb, nb, kb, m8, gb, th in insts:
        line = f"_GET_IF({t}, {mb}, {nb}, {kb}, {'true' if m8 else 'false'}, pipe_stages, {gb}, {th}, false)"
        assert line in cut
        assert f"Marlin<half, {t}.id(), vllm::kFloat16.id(), {th}, {mb}, {nb}, {kb}, " in peers._kernel_file(
            (t, mb, nb, kb, m8, gb, th))
    with pytest.raises(RuntimeError, match="get_marlin_kernel"):
        peers._dispatcher("int main() {}", insts)
    with pytest.raises(ValueError, match="u2"):
        peers.instantiations(["u2"])


@pytest.mark.parametrize("label", ["u4b8", "u8b128", "fe4m3fn"])
def test_abs_weight_bounds_every_weight_magnitude(label):
    """factor x dequant(abs_weight) >= |dequant(w)| code by code, and equal except where a code had to clamp."""
    torch = pytest.importorskip("torch")
    from workbench.scalar_types import ScalarType

    wt = ScalarType.parse(label)
    rng = np.random.default_rng(1)
    words = rng.integers(-2**31, 2**31 - 1, size=(4, 32), dtype=np.int64).astype(np.int32)
    from workbench.weight import MarlinWeight

    w = MarlinWeight(torch.from_numpy(words), torch.ones(1, 8 * 32 // wt.pack_factor), None, None, None, 64,
                     8 * 32 // wt.pack_factor, -1, wt, np.dtype(np.float16))
    wa, factor = bench_gemm.abs_weight(torch, w)
    bits = wt.bits
    mask = (1 << bits) - 1
    src = words.view(np.uint32)
    dst = wa.qweight.numpy().view(np.uint32)
    for j in range(32 // bits):
        c0 = (src >> (bits * j)) & mask
        c1 = (dst >> (bits * j)) & mask
        if label == "fe4m3fn":
            assert np.array_equal(c1, c0 & 0x7F) and factor == 1.0
            continue
        mag0 = np.abs(c0.astype(np.int64) - wt.bias)
        mag1 = c1.astype(np.int64) - wt.bias
        assert np.all(mag1 >= 0) and np.all(factor * mag1 >= mag0 - 1e-9)
        assert np.array_equal(mag1 == mag0, mag0 <= mask - wt.bias)


def test_moe_rotated_routings_avoid_the_previous_experts_at_decode_sizes():
    rng = np.random.default_rng(0)
    rs = bench_moe.rotated_routings(rng, 1, 256, 8, 20)
    for prev, cur in zip(rs, rs[1:]):
        assert cur.shape == (1, 8) and len(set(cur.ravel())) == 8
        assert not set(prev.ravel()) & set(cur.ravel())
    big = bench_moe.rotated_routings(rng, 64, 8, 2, 3)  # every expert touched: drawn from all
    assert all(r.shape == (64, 2) and all(len(set(row)) == 2 for row in r) for r in big)


def test_ab_compare_is_bitwise_and_sees_poison_left():
    import torch

    x = torch.randn(4, 8).half()
    assert ab.compare(torch, x, x.clone()) == {"bits_equal_old": True, "max_rel_old": 0.0, "written": True}
    z = torch.zeros(2, 2).half()
    assert not ab.compare(torch, -z, z)["bits_equal_old"]  # -0.0 == 0.0 as values, not as bits
    y = x.clone()
    y[1, 2] = float("nan")  # a poisoned element the kernel did not write
    r = ab.compare(torch, y, x)
    assert not r["bits_equal_old"] and not r["written"]
    assert not ab.compare(torch, y, y.clone())["written"]
    with pytest.raises(ValueError, match="NAME=DIR"):
        ab.parse_tree("no-equals-sign")
    assert ab.parse_tree("nosr=../nosr") == ("nosr", pathlib.Path("../nosr"))
