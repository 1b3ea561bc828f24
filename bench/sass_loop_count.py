"""Registers, spills and main-loop instructions per stage of the GEMM / MoE kernel instantiations the benchmarks use.

    python bench/sass_loop_count.py [--kernel-dir DIR] [--cuobjdump PATH] [--arch 90] [--only SUBSTRING] [--jobs 2]

No GPU needed: each instantiation is built with nvcc (``-cubin -Xptxas -v``) from DIR (default kernels_cuda/, or a
HEAD copy such as artifacts/r6_kernels_old) and, when a cuobjdump is given, its SASS is read: the main loop is the
longest backward branch span containing HMMA; "per stage" counts that span minus the blocks a forward branch skips
on a typical stage (slice / item entry: >= 12 instructions without HMMA / LDGSTS / LDS / LDSM / BAR; slice or item
finishing: a CALL or SHFL inside; the group reload that runs only when G < 16 K_WARP: PRMT + LDS, no HMMA / LDSM).
A heuristic reading of one static path, for before / after comparisons of the same instantiation, not a profile.
Configurations: what workbench.gemm.choose_config picks for bench_gemm's shapes and labels at M = 1, 8, 16, 64 on
an H200 (132 SMs, 227 KiB), the two-block 8-bit policy variant, and workbench.moe.choose_moe_config for bench_moe's
layers at block sizes 8, 16 and 64.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

H200 = dict(sms=132, smem_limit=232448, sm_smem=233472)


def configs():
    """(source file, name expression) of every instantiation the benchmarks pick."""
    import numpy as np

    from bench_gemm import OURS, SHAPES
    from bench_moe import CONFIGS as MOE_CONFIGS, GROUP
    import dataclasses

    from workbench import gemm, moe
    from workbench.policy import DEFAULT_GEMM_POLICY
    from workbench.scalar_types import ScalarType as S

    out = {}
    # the default policy's kernels and those of two blocks per SM for 8-bit weights too
    for policy in (DEFAULT_GEMM_POLICY, dataclasses.replace(DEFAULT_GEMM_POLICY, two_blocks_weight_bits=(4, 8))):
        for label, wt, gs, dt in OURS:
            act = S.F16 if dt == "float16" else S.BF16
            for k, n in SHAPES:
                for m in (1, 8, 16, 64):
                    cfg = gemm.choose_config(act, wt, m, n, k, gs, False, H200["smem_limit"],
                                             sm_smem=H200["sm_smem"], sms=H200["sms"], policy=policy)
                    out.setdefault(("marlin_gemm.cu", cfg.name_expression), cfg)
    for _, experts, k, n, top_k in MOE_CONFIGS:
        for block in (8, 16, 64):
            for items in (1, 8, 64):
                cfg = moe.choose_moe_config(S.F16, S.U4B8, block, n, k, GROUP, items, H200["sms"],
                                            H200["smem_limit"], H200["sm_smem"])
                out.setdefault(("marlin_moe.cu", cfg.name_expression), cfg)
    del np
    return list(out)


def op(text: str) -> str:
    words = text.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def loop_stats(sass: str) -> dict:
    body = re.split(r"\n\s*Function : ", sass)[1]  # the kernel itself comes first
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           (re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;", line) for line in body.splitlines()) if m]
    best = None
    for a, t in ins:
        m = re.search(r"BRA.*?0x([0-9a-f]+)$", t)
        if m and int(m.group(1), 16) < a:
            lo = int(m.group(1), 16)
            span = [x for x in ins if lo <= x[0] <= a]
            if any(op(x[1]) == "HMMA" for x in span) and (best is None or len(span) > len(best)):
                best = span
    if best is None:
        return {}
    hi = best[-1][0]
    rare = set()
    for a, t in best:
        m = re.search(r"^@!?U?P\w+ BRA.*?0x([0-9a-f]+)$", t)
        if m and a < int(m.group(1), 16) <= hi:
            tgt = int(m.group(1), 16)
            blk = [x for x in best if a < x[0] < tgt]
            ops = collections.Counter(op(x[1]) for x in blk)
            heavy = any(ops[k] for k in ("HMMA", "LDGSTS", "LDS", "LDSM", "BAR"))
            reload = ops["PRMT"] >= 8 and ops["LDS"] and not any(ops[k] for k in ("HMMA", "LDGSTS", "LDSM", "BAR"))
            if ops["CALL"] or ops["SHFL"] or reload or (len(blk) >= 12 and not heavy):
                rare.update(x[0] for x in blk)
    hot = [x for x in best if x[0] not in rare and not x[1].startswith("@!PT") and op(x[1]) != "NOP"]
    c = collections.Counter(op(x[1]) for x in hot)
    return dict(span=len(best), per_stage=len(hot), hmma=c["HMMA"], ldgsts=c["LDGSTS"])


def build(src_dir: pathlib.Path, source: str, expr: str, arch: int, cuobjdump: str | None, tmp: pathlib.Path):
    name = re.sub(r"\W+", "_", expr)[:120]
    cu = tmp / f"{name}.cu"
    cu.write_text(f'#include "{source}"\nconst void* k[] = {{ reinterpret_cast<const void*>(&{expr}) }};\n')
    cubin = tmp / f"{name}.cubin"
    run = subprocess.run(["nvcc", "-std=c++17", "-cubin", f"-arch=sm_{arch}", "-I", str(src_dir), "-Xptxas", "-v",
                          "-o", str(cubin), str(cu)], capture_output=True, text=True)
    if run.returncode:
        return dict(error=run.stderr[-400:])
    kernel = "marlin_moe" if "marlin_moe" in expr else "marlin_gemm"
    # ptxas reports each function; the kernel's entry is the one naming it (mangled) with "Compiling entry"
    regs = spills = None
    lines = run.stderr.splitlines()
    for i, line in enumerate(lines):
        if "Compiling entry function" in line and kernel in line:
            for nxt in lines[i + 1:i + 6]:
                m = re.search(r"(\d+) bytes spill stores", nxt)
                if m and spills is None:
                    spills = int(m.group(1))
                m = re.search(r"Used (\d+) registers", nxt)
                if m:
                    regs = int(m.group(1))
                    break
    total_spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", run.stderr))
    out = dict(registers=regs, spills_kernel=spills, spills_any=total_spills)
    if cuobjdump:
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True).stdout
        out.update(loop_stats(sass))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel-dir", type=pathlib.Path, default=ROOT / "kernels_cuda")
    parser.add_argument("--cuobjdump", default=None, help="path of cuobjdump (SASS counts); without: registers only")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--only", default="", help="keep name expressions containing this")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    todo = [c for c in configs() if args.only in c[1]]
    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda c: build(args.kernel_dir.resolve(), c[0], c[1], args.arch, args.cuobjdump,
                                                pathlib.Path(tmp)), todo))
    print(f"{'instantiation':78} {'regs':>4} {'spill':>5} {'any':>4} {'stage':>5} {'HMMA':>4} {'LDGSTS':>6}")
    bad = 0
    for (_, expr), r in zip(todo, results):
        if "error" in r:
            print(f"{expr:78} build failed: {r['error']}")
            bad += 1
            continue
        print(f"{expr.replace('mwb::', ''):78} {r['registers'] or -1:>4} {r['spills_kernel'] or 0:>5} "
              f"{r['spills_any']:>4} {r.get('per_stage', ''):>5} {r.get('hmma', ''):>4} {r.get('ldgsts', ''):>6}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
