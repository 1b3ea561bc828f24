"""The closing table of an A/B device script: dense GEMM cells from DIR/ab_gemm*/ab_*.json (bench/ab_gemm.py) and
fused MoE cells from DIR/ab_moe/ab_moe.json (bench/bench_moe.py --ab-old), old / new / ratio / bitwise = old.

    python bench/ab_summary.py DIR

Variants other than old / new in the dense rows (e.g. new-8bit2) get a column each, timed against old.
Importable: ``summary(d) -> str``.
"""
from __future__ import annotations

import glob
import json
import sys

NAN = float("nan")


def dense_table(d: str) -> list[str]:
    rows = [r for f in sorted(glob.glob(f"{d}/ab_gemm*/ab_*.json")) for r in json.load(open(f))["rows"]]
    cells: dict = {}
    for r in rows:
        if "[" in r["method"]:
            label, variant = r["method"].rsplit(" [", 1)
            cells.setdefault((r["k"], r["n"], r["m"], label.replace("marlin ", "")), {})[variant[:-1]] = r
    extra = sorted({v for c in cells.values() for v in c} - {"old", "new"})
    lines = ["dense GEMM (us; bits = new bitwise = old, required" + (f"; {', '.join(extra)}: vs old" if extra else "")
             + ")",
             f"{'K x N':>12} {'M':>3} {'weights':16} {'old':>8} {'new':>8} {'new/old':>8} "
             + "".join(f"{x[-9:]:>10} {'/old':>6} " for x in extra) + f"{'config':>12} {'bits':>5}"]
    for (k, n, m, label), v in cells.items():
        if "old" in v and "new" in v:
            o, nw = v["old"]["us"], v["new"]["us"]
            cols = "".join(f"{v[x]['us'] if x in v else NAN:10.2f} {(v[x]['us'] if x in v else NAN) / o:6.3f} "
                           for x in extra)
            lines.append(f"{k:>5}x{n:<6} {m:>3} {label:16} {o:8.2f} {nw:8.2f} {nw / o:8.3f} {cols}"
                         f"{v['new'].get('config', ''):>12} {str(v['new'].get('bits_equal_old')):>5}")
    if not rows:
        lines.append("  no dense A/B results (see ab_gemm*.log)")
    return lines


def moe_table(d: str) -> list[str]:
    lines = ["fused MoE (median us [IQR] of interleaved, warmed, host-free calls; bits = new bitwise = old, required)"]
    found = glob.glob(f"{d}/ab_moe/ab_moe.json")
    if not found:
        return lines + ["  no MoE A/B results (see ab_moe.log)"]
    by: dict = {}
    for r in json.load(open(found[0]))["rows"]:
        by.setdefault((r["config"], r["m"]), {})[r["variant"]] = r
    lines.append(f"{'config':>10} {'M':>3} {'old':>17} {'new':>17} {'new/old':>8} {'new shape':>22} {'bits':>5}")

    def iq(r):
        return f"{r['us']:7.2f}[{r.get('us_q75', NAN) - r.get('us_q25', NAN):4.1f}]"

    for (cfg, m), v in by.items():
        if "old" not in v or "new" not in v:
            continue
        o, nw = v["old"]["us"], v["new"]["us"]
        bits = all(r["bits_equal_old"] for x, r in v.items() if x != "old")
        lines.append(f"{cfg:>10} {m:>3} {iq(v['old']):>17} {iq(v['new']):>17} {nw / o:8.3f} {v['new']['shape']:>22} "
                     f"{str(bits):>5}")
    return lines


def summary(d: str) -> str:
    return "\n".join(dense_table(d) + [""] + moe_table(d))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(summary(sys.argv[1]))
