"""Small results documents in the schema of bench/results/ (workbench/render/bench.py), for the tests of the
reader, bench/report.py and the performance pictures."""


def _meta(**over):
    meta = {"gpu": "TEST GPU", "sms": 8, "date": "2026-12-01", "commit": "abc1234", "torch": "2.11", "cupy": "14.0",
            "nvcc": "13.0", "ceilings": {"copy_gbs": 2000.0, "read_gbs": 2500.0, "mma_tflops": 400.0,
                                         "cublas_tflops": 600.0},
            "method": {"launches_per_graph": 20, "l2_multiple": 3}, "peers": {"cublas": "torch 2.11",
                                                                              "vllm_marlin": "vllm-project/vllm@v0.1"}}
    meta.update(over)
    return meta


def gemm_doc():
    """Two M values of one layer: ours u4b8 (graph and plain), vLLM's Marlin on the same format, cuBLAS fp16."""
    rows = []
    for m, ours, vllm, cublas in ((1, 5.0, 6.0, 15.0), (16, 8.0, 8.0, 16.0)):
        base = {"layer": "down", "n": 4096, "k": 4096, "m": m, "group": 128, "act": "fp16"}
        rows += [dict(base, wtype="u4b8", launch="graph", method="ours", us=ours, gbs=2000.0),
                 dict(base, wtype="u4b8", launch="plain", method="ours", us=ours * 1.25, gbs=1600.0),
                 dict(base, wtype="u4b8", launch="graph", method="vllm_marlin", us=vllm, gbs=1000.0),
                 dict(base, wtype="fp16", group=None, launch="graph", method="cublas", us=cublas, gbs=2100.0)]
    rows.append(dict(rows[0], wtype="u8b128", us=10.0, gbs=2250.0))  # vLLM ran no u8b128 here: no ratio
    return {"schema": 1, "family": "gemm", "meta": _meta(), "rows": rows}


def repack_doc():
    rows = [{"op": "gptq_marlin_repack", "n": 64, "k": 128, "wtype": "u4b8", "method": "ours", "us": 2.0,
             "gbs": 1800.0, "pct_copy": 90.0},
            {"op": "gptq_marlin_repack", "n": 64, "k": 128, "wtype": "u4b8", "method": "vllm_marlin", "us": 3.0,
             "gbs": 1200.0, "pct_copy": 60.0}]
    return {"schema": 1, "family": "repack", "meta": _meta(), "rows": rows}


def host_doc():
    rows = [{"call": "gemm", "inputs": "cupy", "method": "ours", "us": 11.0},
            {"call": "gemm", "inputs": "cupy", "method": "vllm_marlin", "us": 22.0}]
    return {"schema": 1, "family": "host", "meta": _meta(peers={"vllm_marlin": "v0.1"}), "rows": rows}
