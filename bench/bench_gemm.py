"""Dense GEMM speed: ours beside cuBLAS fp16 and the peers (vLLM's Marlin, humming), same inputs, same run.

    python bench/bench_gemm.py [--out bench/results] [--m 1,16,32,64,128,256] [--wtypes u4b8,fe4m3fn,u4,u8b128]
                               [--peers cublas,vllm_marlin,humming] [--peers-src _dev/peers_src]
                               [--vllm-wtypes u4b8,fe4m3fn] [--launch graph,plain] [--budget-s 300] [--odd]
                               [--modes default,batch_invariant]

Method: bench/timing.py (graphs and plain launches over inputs rotated past 3 x L2, interleaved medians). Weights are
random words (speed does not depend on their values). vLLM's Marlin runs on our arrays (the format is the same
bytes): per cell the two outputs are compared against twice the bound both must meet (``gemm.error_bound_factor``
x |a| @ |W|, fp32 accumulation in different orders), reported as ``agree_vllm`` and ``err_ratio_vllm`` (largest
|ours - vllm| / bound). humming gets its own random weights of the same type and shape (its layout differs).
``us`` per call; ``gbs`` = (weights + scales [+ zero points] + A + C) bytes / time. ``pdl``: ours with
programmatic dependent launches (the default on sm_90) or without (the GEMM before it in a graph cannot overlap).
``mode``: ours in the default mode or with ``batch_invariant=True`` (its cost is the ratio of the two; rows of
ours carry ``mode``, and invariant rows ``vs_default``, their time over the default's in the same cell).
``ours_wgmma``: our wgmma kernel family (workbench.gemm.hopper, forced with ``family="wgmma"``) on the same weights
as ``ours``, where it can run them (sm_90, u4b8 g128 so far, M >= 32; ``--wgmma off`` leaves it out); its output is checked
against ours (mma.sync) within twice the bound both must meet (``agree_mma_sync``, ``err_ratio_mma_sync``).
Writes OUT/gemm.json (schema: bench/README.md). ``--budget-s``: wall seconds after which remaining layers and
optional types are skipped (the rows say what ran). ``--odd``: ODD_LAYERS, shapes that are not tile multiples beside
the next aligned ones (their ``gbs`` counts the true sizes' bytes, not the tile padding); vLLM's Marlin refuses
N = 7392 (its size_n % 64 check), which the notes record per cell.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import timing  # noqa: E402

LAYERS = ((4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192), (8192, 28672), (28672, 8192))  # (K, N)
# --odd: shapes that are not tile multiples, each beside the next tile-aligned one (the speed bar compares time per
# useful byte): Qwen2-72B's MLP at TP4 (intermediate 29568 / 4 = 7392 = 115.5 x 64, as N and as K: 57.75 groups of
# 128) and DeepSeek-V2-Lite's 10944 as K (85.5 groups of 128)
ODD_LAYERS = ((8192, 7392), (8192, 7424), (7392, 8192), (7424, 8192), (10944, 2048), (11008, 2048))
M_VALUES = (1, 16, 32, 64, 128, 256)
GROUP = {"u4b8": 128, "u4": 128, "u8b128": 128, "fe4m3fn": -1}
WGMMA_MIN_M = 32  # the wgmma family is built for M >= 32 (the mma.sync kernels lead below)


def layer_name(k: int, n: int) -> str:
    return f"{k}x{n}"


def weight_bytes(k: int, n: int, bits: int, group: int, zero_points: bool) -> int:
    """Useful bytes of a (K, N) weight: the true sizes (an odd shape's tile padding is not counted)."""
    groups = 1 if group == -1 else -(-k // group)
    b = k * n * bits // 8 + groups * n * 2
    if zero_points:
        b += groups * n * bits // 8
    return b


def random_weight(torch, k, n, wt, group):
    """A MarlinWeight of random device words and positive scales (timing only; FP8 bytes avoid the NaN codes so
    outputs stay comparable). Odd shapes: the arrays of the weight padded to whole 16 x 64 tiles (the storage rule;
    their padding holds random words too, which only meet A's zero-filled columns or dropped C columns)."""
    from workbench.gemm import padded_shape
    from workbench.weight import MarlinWeight

    pf = wt.pack_factor
    kp, n_pad = padded_shape(k, n)
    ng = 1 if group == -1 else -(-k // group)
    if wt.label == "fe4m3fn":
        b = torch.randint(0, 256, (kp // 16 * n_pad * 16 // pf * 4,), dtype=torch.uint8, device="cuda")
        b -= ((b & 0x7F) == 0x7F).to(torch.uint8)  # 0x7F / 0xFF (NaN) -> 0x7E / 0xFE (largest finite)
        q = b.view(torch.int32).view(kp // 16, n_pad * 16 // pf)
    else:
        q = torch.randint(-2**31, 2**31 - 1, (kp // 16, n_pad * 16 // pf), dtype=torch.int32, device="cuda")
    s = (torch.rand(ng, n_pad, device="cuda") * 0.01 + 0.001).half()
    z = torch.randint(-2**31, 2**31 - 1, (ng, n_pad // pf), dtype=torch.int32, device="cuda") \
        if wt.has_zero_points else None
    return MarlinWeight(q, s, z, None, None, k, n, group, wt, np.dtype(np.float16))


def abs_weight(torch, w):
    """(weight, factor): a weight whose dequantized values bound |w| / factor from below, so that
    factor x |a| @ dequant(weight) >= |a| @ |dequant(w)| (positive scales): FP8 with the sign cleared (factor 1);
    biased integer codes as bias + |code - bias|, clamped to the largest code (|code - bias| = bias only for code
    0: factor bias / (bias - 1)). None for zero-point types."""
    wt = w.weight_type
    q = w.qweight
    if wt.has_zero_points:
        return None
    if wt.label == "fe4m3fn":
        return dataclasses.replace(w, qweight=q & 0x7F7F7F7F), 1.0
    bits, bias = wt.bits, wt.bias
    mask = (1 << bits) - 1
    q2 = torch.zeros_like(q)
    for j in range(32 // bits):
        code = (q >> (bits * j)) & mask
        q2 |= ((code - bias).abs() + bias).clamp(max=mask) << (bits * j)
    return dataclasses.replace(w, qweight=q2), bias / (bias - 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), type=pathlib.Path)
    p.add_argument("--m", default=",".join(map(str, M_VALUES)))
    p.add_argument("--layers", default="", help="KxN,... (default: the six layers)")
    p.add_argument("--odd", action="store_true", help="the odd-shape layers and their aligned neighbours (ODD_LAYERS) "
                                                      "instead of the default layers")
    p.add_argument("--wtypes", default="u4b8,fe4m3fn,u4,u8b128", help="ours, in order of priority")
    p.add_argument("--peers", default="cublas,vllm_marlin,humming")
    p.add_argument("--peers-src", default=str(ROOT / "_dev" / "peers_src"), type=pathlib.Path)
    p.add_argument("--vllm-wtypes", default="u4b8,fe4m3fn")
    p.add_argument("--humming-wtypes", default="u4b8")
    p.add_argument("--launch", default="graph,plain")
    p.add_argument("--modes", default="default", help="ours: default and/or batch_invariant")
    p.add_argument("--wgmma", default="auto", choices=("auto", "off"),
                   help="auto: time ours_wgmma where the wgmma family runs the cell")
    p.add_argument("--budget-s", type=float, default=0, help="skip what remains after this many seconds (0: none)")
    p.add_argument("--append", action="store_true", help="add to the rows of an existing OUT/gemm.json")
    p.add_argument("--humming-ready", help="PREFIX: time humming on a layer only once PREFIX.KxN exists (written "
                                           "by `peers.py jit-humming --ready-prefix` when its kernels are compiled)")
    args = p.parse_args(argv)
    t_start = time.time()
    import torch

    from workbench import gemm
    from workbench.policy import DEFAULT_GEMM_POLICY
    from workbench.scalar_types import ScalarType

    ms = [int(v) for v in args.m.split(",")]
    layers = [tuple(int(v) for v in s.split("x")) for s in args.layers.split(",")] if args.layers else \
        list(ODD_LAYERS if args.odd else LAYERS)
    wtypes = args.wtypes.split(",")
    peers = set(args.peers.split(",")) if args.peers else set()
    launches = args.launch.split(",")
    modes = args.modes.split(",")
    dev = timing.device()
    ceil = timing.ceilings(dev)
    print(f"{dev.name}: {dev.sms} SMs, L2 {dev.l2_bytes >> 20} MiB, ceilings {ceil}", flush=True)
    notes, versions = {}, {}
    if "cublas" in peers:
        versions["cublas"] = f"torch {torch.__version__} (torch.matmul fp16)"

    # ours: every kernel compiled up front, in parallel threads
    t0 = time.time()
    policy_pdl = DEFAULT_GEMM_POLICY
    policy_nopdl = dataclasses.replace(DEFAULT_GEMM_POLICY, programmatic_launch=False)
    programmatic = gemm.programmatic_launches(torch.cuda.current_device())
    cfgs = [gemm.config_for(ScalarType.F16, ScalarType.parse(w), m, n, k, GROUP[w], False)
            for w in wtypes for k, n in layers for m in ms] if "default" in modes else []
    if "batch_invariant" in modes:
        smem_limit = gemm.device_properties(torch.cuda.current_device())[2]
        for w in wtypes:
            for k, n in layers:
                for m in ms:
                    cfg = gemm.geometry.choose_invariant_config(ScalarType.F16, ScalarType.parse(w), m, n, k,
                                                                GROUP[w], False, smem_limit)
                    cfgs.append(gemm.geometry.invariant_plan(cfg, m, n, k, dev.sms, dev.sms, 90, True,
                                                             smem_limit=smem_limit)[0])
    gemm.precompile(cfgs, workers=16)
    from workbench.gemm import hopper

    cc = gemm.device_properties(torch.cuda.current_device())[0]

    def wgmma_runs(w, k, n, m):
        wt = ScalarType.parse(w)
        return (args.wgmma == "auto" and m >= WGMMA_MIN_M
                and hopper.unsupported(ScalarType.F16, wt, n, k, GROUP[w], False, k, cc) is None)

    hopper.precompile({hopper.choose_config(ScalarType.F16, ScalarType.parse(w), m, DEFAULT_GEMM_POLICY)
                       for w in wtypes for k, n in layers for m in ms if wgmma_runs(w, k, n, m)})
    compile_key = "ours_compile_s_" + "_".join(wtypes)
    notes[compile_key] = round(time.time() - t0, 1)
    print(f"ours compiled {len(set(c.name_expression for c in cfgs))} kernels in {notes[compile_key]} s", flush=True)

    vllm = None
    vllm_wtypes = [w for w in args.vllm_wtypes.split(",") if w]
    if "vllm_marlin" in peers:
        import peers as peer_mod

        try:
            ops, secs = peer_mod.build_vllm_marlin(args.peers_src, vllm_wtypes)
            type_ids = {w: int(ops.type_id(w)) for w in vllm_wtypes}
            vllm = peer_mod.vllm_gemm(ops, type_ids)
            versions["vllm_marlin"] = peer_mod.peer_versions(args.peers_src).get("vllm_marlin", "unknown")
            notes["vllm_marlin_load_s"] = round(secs, 1)
            notes["vllm_marlin_build"] = peer_mod.vllm_build_record(vllm_wtypes)
        except Exception as exc:  # a peer that does not build is reported, not fatal
            notes["vllm_marlin"] = f"not built: {type(exc).__name__}: {str(exc)[-400:]}"
            print(notes["vllm_marlin"], flush=True)
    humming_ok = "humming" in peers
    if humming_ok:
        import peers as peer_mod

        try:
            peer_mod.humming_import(args.peers_src)
            if args.humming_ready and pathlib.Path(f"{args.humming_ready}.json").exists():
                notes["humming_jit"] = json.loads(pathlib.Path(f"{args.humming_ready}.json").read_text())
            versions["humming"] = peer_mod.peer_versions(args.peers_src).get("humming", "unknown")
        except Exception as exc:
            humming_ok = False
            notes["humming"] = f"not importable: {type(exc).__name__}: {exc}"
            print(notes["humming"], flush=True)

    rows, prior_notes = [], {}
    if args.append and (args.out / "gemm.json").exists():
        prior = json.loads((args.out / "gemm.json").read_text())
        rows, prior_notes = prior["rows"], prior["meta"]["method"].get("notes", {})
        versions = {**prior["meta"]["peers"], **versions}
    notes = {**prior_notes, **notes}
    workspace = torch.zeros(gemm.workspace_numel(dev.sms), dtype=torch.int32, device="cuda")
    c_tmp = torch.empty(gemm.c_tmp_numel(dev.sms), dtype=torch.float32, device="cuda")
    v_workspace = torch.zeros(dev.sms * 4, dtype=torch.int32, device="cuda")
    skipped = []
    for k, n in layers:
        if args.budget_s and time.time() - t_start > args.budget_s:
            skipped.append(layer_name(k, n))
            continue
        name = layer_name(k, n)
        w16 = None
        if "cublas" in peers:
            w16 = [torch.randn(k, n, device="cuda", dtype=torch.float16) * 0.01
                   for _ in range(timing.copies_for(k * n * 2, dev.l2_bytes))]
        ours = {}
        for w in wtypes:
            wt = ScalarType.parse(w)
            nb = weight_bytes(k, n, wt.bits, GROUP[w], wt.has_zero_points)
            ours[w] = [random_weight(torch, k, n, wt, GROUP[w]) for _ in range(timing.copies_for(nb, dev.l2_bytes))]
        hum = {}
        if humming_ok and args.humming_ready and not pathlib.Path(f"{args.humming_ready}.{name}").exists():
            notes[f"humming_{name}"] = "skipped: its kernels were not compiled in time"
        elif humming_ok:
            for w in args.humming_wtypes.split(","):
                try:
                    nb = weight_bytes(k, n, 4, 128, False)
                    hum[w] = peer_mod.HummingDense(args.peers_src, k, n, w, GROUP[w],
                                                   timing.copies_for(nb, dev.l2_bytes))
                except Exception as exc:
                    notes[f"humming_{name}_{w}"] = f"{type(exc).__name__}: {str(exc)[-300:]}"
                    print(notes[f"humming_{name}_{w}"], flush=True)
        for m in ms:
            a = [torch.randn(m, k, device="cuda", dtype=torch.float16) for _ in range(2)]
            io_bytes = m * k * 2 + m * n * 2
            cells = {}  # (method, wtype, pdl) -> (launch list, bytes)

            def launch_list(f):
                return [(lambda i=i: f(i)) for i in range(timing.LAUNCHES)]

            if w16 is not None:
                c16 = torch.empty(m, n, device="cuda", dtype=torch.float16)
                cells[("cublas", "fp16", None)] = (
                    launch_list(lambda i: torch.matmul(a[i % 2], w16[i % len(w16)], out=c16)), k * n * 2 + io_bytes)
            agree, agree_mma = {}, {}
            for w in wtypes:
                ws = ours[w]
                wt = ws[0].weight_type
                nb = weight_bytes(k, n, wt.bits, GROUP[w], wt.has_zero_points) + io_bytes
                c = torch.empty(m, n, device="cuda", dtype=torch.float16)

                def ours_call(i, c=c, ws=ws, pol=policy_pdl, invariant=False):
                    return gemm.marlin_gemm(a[i % 2], ws[i % len(ws)], c=c, workspace=workspace, c_tmp=c_tmp,
                                            policy=pol, batch_invariant=invariant)

                if "default" in modes:
                    cells[("ours", w, programmatic)] = (launch_list(ours_call), nb)
                    if programmatic:
                        cells[("ours", w, False)] = (launch_list(lambda i, f=ours_call: f(i, pol=policy_nopdl)),
                                                     nb)
                if "batch_invariant" in modes:  # (programmatic launches where the default has them)
                    cells[("ours_invariant", w, programmatic)] = (
                        launch_list(lambda i, f=ours_call: f(i, invariant=True)), nb)
                    if wgmma_runs(w, k, n, m):
                        cg = torch.empty(m, n, device="cuda", dtype=torch.float16)

                        def wgmma_call(i, cg=cg, ws=ws):
                            return gemm.marlin_gemm(a[i % 2], ws[i % len(ws)], c=cg, family="wgmma")

                        cells[("ours_wgmma", w, None)] = (launch_list(wgmma_call), nb)
                        agree_mma[w] = compare(torch, gemm, a[0], ws[0], c, cg, workspace, c_tmp, None,
                                               lambda a_, w_, c_, _: gemm.marlin_gemm(a_, w_, c=c_, family="wgmma"))
                if vllm is not None and w in vllm_wtypes:
                    cv = torch.empty(m, n, device="cuda", dtype=torch.float16)
                    cells[("vllm_marlin", w, None)] = (
                        launch_list(lambda i, cv=cv, ws=ws: vllm(a[i % 2], ws[i % len(ws)], cv, v_workspace)), nb)
                    try:
                        agree[w] = compare(torch, gemm, a[0], ws[0], c, cv, workspace, c_tmp, v_workspace, vllm)
                    except Exception as exc:  # (vLLM refuses shapes that are not tile multiples: say which)
                        notes[f"vllm_marlin_{name}_{w}_m{m}"] = f"{type(exc).__name__}: {str(exc)[-300:]}"
                        print(notes[f"vllm_marlin_{name}_{w}_m{m}"], flush=True)
                        del cells[("vllm_marlin", w, None)]
            for w, h in hum.items():
                ch = torch.empty(m, n, device="cuda", dtype=torch.float16)
                cells[("humming", w, None)] = (launch_list(lambda i, h=h, ch=ch: h.call(i, a[i % 2], ch, m)),
                                               h.weight_bytes + io_bytes)
            timers = {}
            for key, (ls, _) in cells.items():
                for launch in launches:
                    if launch == "plain" and key[0].startswith("ours") and key[2] is False and programmatic:
                        continue  # plain launches: the default policy only
                    try:
                        timers[key + (launch,)] = (timing.GraphTimer if launch == "graph" else timing.PlainTimer)(ls)
                    except Exception as exc:
                        notes[f"{key[0]}_{name}_{key[1]}_m{m}_{launch}"] = f"{type(exc).__name__}: {str(exc)[-300:]}"
                        print(f"{key} {launch} failed: {exc!r}", flush=True)
            stats = timing.interleaved(timers)
            cublas_us = {launch: stats[("cublas", "fp16", None, launch)]["us"]
                         for launch in launches if ("cublas", "fp16", None, launch) in stats}
            for (method, w, pdl, launch), st in stats.items():
                nb = cells[(method, w, pdl)][1]
                row = dict(layer=name, n=n, k=k, m=m, wtype=w, group=GROUP.get(w, None), act="fp16", launch=launch,
                           method=method, us=round(st["us"], 3), q1=round(st["q1"], 3), q3=round(st["q3"], 3),
                           gbs=round(timing.gbs(nb, st["us"]), 1),
                           pct_copy=round(100 * timing.gbs(nb, st["us"]) / ceil["copy_gbs"], 1))
                if method == "ours_invariant":  # (the schema's method stays "ours"; the mode tells them apart)
                    method = "ours"
                    row.update(method=method, mode="batch_invariant", pdl=bool(pdl))
                    ref = stats.get(("ours", w, pdl, launch))
                    if ref is not None:
                        row["default_us"] = round(ref["us"], 3)
                        row["vs_default"] = round(st["us"] / ref["us"], 3)
                elif method == "ours":
                    row["pdl"] = bool(pdl)
                    row["mode"] = "default"
                if launch in cublas_us:
                    row["speedup_vs_cublas"] = round(cublas_us[launch] / st["us"], 3)
                if method in ("ours", "vllm_marlin") and w in agree and row.get("mode") != "batch_invariant":
                    row["agree_vllm"], row["err_ratio_vllm"] = agree[w]
                if method == "ours_wgmma" and w in agree_mma:
                    row["agree_mma_sync"], row["err_ratio_mma_sync"] = agree_mma[w]
                rows.append(row)
                print(f"{name:>11s} M={m:4d} {method:12s} {row.get('mode', ''):15s} {w:8s} {launch:5s} "
                      f"pdl={str(pdl):5s} {st['us']:9.2f} us "
                      f"{row['gbs']:7.0f} GB/s x{row.get('speedup_vs_cublas', 0):.2f}"
                      + (f" agree={agree[w]}" if method == "vllm_marlin" and w in agree else ""), flush=True)
            del timers, cells
        del w16, ours, hum
        torch.cuda.empty_cache()
        meta = timing.meta(ROOT, dev, ceil, {"launch": launches, "programmatic_launch": programmatic,
                                            "skipped_layers": skipped, "notes": notes, "wall_s": round(
                                                time.time() - t_start, 1)}, versions)
        timing.write_results(args.out, "gemm", meta, rows)  # after every layer: a cut-off run keeps what it measured
    print(f"wrote {args.out / 'gemm.json'} ({len(rows)} rows) in {time.time() - t_start:.0f} s", flush=True)
    return 0


def compare(torch, gemm, a, w, c, cv, workspace, c_tmp, v_workspace, vllm):
    """(agree, err_ratio): ours and vLLM's outputs on the same inputs against twice the bound each must meet,
    e |a| @ |W| with e = gemm.error_bound_factor (fp32 accumulation in any order, one output rounding, Hopper's
    dropped low bits); err_ratio = max |ours - vllm| / bound. |a| @ |W| comes from our kernel on abs_weight (its
    own fp16 rounding: 2^-10 headroom); for zero-point types from |code - zero| <= 2^bits - 1 and each group's
    largest scale (looser)."""
    gemm.marlin_gemm(a, w, c=c, workspace=workspace, c_tmp=c_tmp)
    vllm(a, w, cv, v_workspace)
    torch.cuda.synchronize()
    d = (c.float() - cv.float()).abs()
    e = gemm.error_bound_factor(np.float16, w.size_k, output_roundings=1, weight_rounding=True)
    wa = abs_weight(torch, w)
    if wa is not None:
        s = torch.empty_like(c)
        gemm.marlin_gemm(a.abs(), wa[0], c=s, workspace=workspace, c_tmp=c_tmp)
        torch.cuda.synchronize()
        big_s = s.float() * wa[1] * (1 + 2 ** -10)
    else:
        group = w.size_k if w.group_size == -1 else w.group_size
        a_groups = a.abs().float().view(a.shape[0], -1, group).sum(-1)  # (M, groups)
        big_s = ((2 ** w.weight_type.bits - 1) * a_groups @ w.scales.float().abs().amax(1, keepdim=True))
    bound = 2 * e * big_s + 2 ** -24
    ratio = float((d / bound).max())
    return bool(ratio <= 1.0), round(ratio, 4)


if __name__ == "__main__":
    sys.exit(main())
