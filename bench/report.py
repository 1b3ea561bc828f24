"""Write the tables of BENCHMARKS.md from the result files under bench/results/.

    python3 bench/report.py                  # rewrite the tables section of BENCHMARKS.md in place
    python3 bench/report.py --check          # exit 1 if BENCHMARKS.md's tables differ from the results

Each ``bench/results/<family>.json`` (schema in workbench/render/bench.py) becomes one section: the run (GPU, date,
commit, library versions, the ceilings measured in the same run, where each peer came from) and one table per
shape group, ours beside each peer as a ratio (peer time / our time: above 1, ours is faster) and as % of the
measured streaming-read ceiling. Only the text between the two markers is replaced; a family without a file is
named as missing.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workbench.render.bench import (FAMILIES, GROUP_KEYS, SHAPE_KEYS, ResultsSchemaError,  # noqa: E402
                                    compare_cells, config_label, describe_run, format_us, group_title,
                                    load_family, measured_columns, missing_note, peers_of, sorted_cells)

BEGIN = "<!-- tables: written by bench/report.py from bench/results/*.json; edit the results, not this -->"
END = "<!-- end of tables -->"
TITLES = {"gemm": "Dense GEMM", "moe": "Fused MoE", "repack": "Repack kernels", "checkpoint": "Checkpoint repack",
          "host": "Host time per call", "torch_models": "PyTorch models", "pipeline": "Checkpoint pipeline"}



def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def family_section(family: str, doc: dict) -> list[str]:
    """The markdown of one family: a line about the run, then its tables."""
    lines = [f"### {TITLES.get(family, family)}", "", describe_run(doc), ""]
    # the timing settings (scalars and short lists; nested records such as build notes stay in the file)
    method = {k: v for k, v in doc["meta"]["method"].items() if not isinstance(v, dict)}
    if method:
        lines += ["Timing: " + "; ".join(f"{k} = {(', '.join(map(str, v)) or 'none') if isinstance(v, list) else v}"
                                         for k, v in method.items()) + ".", ""]
    cells = compare_cells(doc)
    if not cells:
        return lines + ["(no rows of ours in this file)", ""]
    peers = peers_of(doc)
    has_gbs = any(c["pct_read"] is not None for c in cells)
    has_copy = family == "repack"  # a repack's ceiling is a copy; the other families compare with the read
    group_keys = GROUP_KEYS.get(family, ())
    if family not in SHAPE_KEYS:  # other families write several kinds of row: one table per kind (`cell`)
        group_keys = ("cell",) if all("cell" in c["row"] for c in cells) else ()
    groups = {}
    for c in cells:
        groups.setdefault(tuple(c["row"][k] for k in group_keys), []).append(c)
    for key, members in groups.items():
        if family in SHAPE_KEYS:
            row_keys = [k for k in SHAPE_KEYS[family] if k not in group_keys]
        else:  # every identifying key of the kind's first row that is not measured
            first = members[0]["row"]
            row_keys = [k for k in first if k not in ("method", "us", "gbs", "pct_copy", "pct_read", "cell")
                        and isinstance(first[k], (str, int)) and not isinstance(first[k], bool)
                        and not k.endswith("_bytes")]  # (exact byte counts stay in the file)
        measured = measured_columns(family, [c["row"] for c in members])
        header = ([k if k != "m" else "M" for k in row_keys] + ["format, launch"] * (family in FORMAT_FAMILIES)
                  + [h for h, _ in measured] + ["ours µs"] + ["GB/s", "% of read"] * has_gbs
                  + ["% of copy"] * has_copy + [f"× {p}" for p in peers])
        if group_keys == ("cell",):
            lines += [f"**{key[0]}**", ""]
        elif group_keys:
            lines += [f"**{group_title(family, members[0]['row'])}**", ""]
        members = sorted_cells(members, row_keys)
        rows = []
        for c in members:
            r = c["row"]
            cols = [str(r.get(k, "—")) for k in row_keys] + [config_label(r)] * (family in FORMAT_FAMILIES)
            cols += [text(r) for _, text in measured]
            cols.append(format_us(float(r["us"])))
            if has_gbs:
                gbs = r.get("gbs")
                cols += ["—" if gbs is None else f"{gbs:.0f}" if gbs >= 10 else f"{gbs:.2f}",
                         f"{c['pct_read']:.0f}%" if c["pct_read"] is not None else "—"]
            if has_copy:
                cols.append(f"{r['pct_copy']:.0f}%" if "pct_copy" in r else "—")
            cols += [f"×{c['ratios'][p]:.2f}" if p in c["ratios"] else "—" for p in peers]
            rows.append(cols)
        lines += _table(header, rows) + [""]
    return lines


FORMAT_FAMILIES = ("gemm", "moe", "repack")


def tables_markdown(results_dir) -> str:
    """The whole tables section (between the markers, markers excluded)."""
    lines = [""]
    for family in FAMILIES:
        doc = load_family(results_dir, family)
        if doc is None:
            lines += [f"### {TITLES.get(family, family)}", "", missing_note(family, "bench/results"), ""]
        else:
            lines += family_section(family, doc)
    return "\n".join(lines)


def splice(page: str, tables: str, source: str = "BENCHMARKS.md") -> str:
    """``page`` with the text between BEGIN and END replaced by ``tables``."""
    if page.count(BEGIN) != 1 or page.count(END) != 1 or page.index(BEGIN) > page.index(END):
        raise ValueError(f"{source} must hold the markers {BEGIN!r} and {END!r} once each, in that order")
    head, rest = page.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{tables.strip()}\n\n{END}{tail}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(ROOT / "bench" / "results"), help="folder of <family>.json files")
    parser.add_argument("--page", default=str(ROOT / "BENCHMARKS.md"), help="the markdown page to update")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if the page is stale")
    args = parser.parse_args(argv)
    page_path = pathlib.Path(args.page)
    try:
        updated = splice(page_path.read_text(), tables_markdown(args.results), str(page_path))
    except (ResultsSchemaError, ValueError, OSError) as exc:
        print(f"report: {exc}", file=sys.stderr)
        return 2
    if args.check:
        stale = updated != page_path.read_text()
        print(f"{page_path}: {'stale, run python3 bench/report.py' if stale else 'up to date'}")
        return int(stale)
    page_path.write_text(updated)
    print(f"{page_path}: tables written from {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
