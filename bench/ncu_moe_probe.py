"""One fused MoE phase per (kernel version, M) for Nsight Compute, old beside new (session 10, r13g).

    ncu --profile-from-start off -k regex:marlin_moe --section SpeedOfLight ... \
        python3 bench/ncu_moe_probe.py OLD_DIR [--config dsv2-lite] [--m 1,8]

Every call is compiled and warmed first; only the calls between cudaProfilerStart and Stop are profiled, in the
order old M = 1, new M = 1, old M = 8, ... (ncu's own cache control flushes L2 before each). Routing: bench_moe's
(uniform random top-k, seed 0). Prints the order so the report's rows can be matched to it.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_moe import CONFIGS, load_old, random_stack  # noqa: E402
from workbench import moe  # noqa: E402
from workbench.formats.moe_align import moe_align_block_size as align_ref  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old_dir", type=pathlib.Path)
    parser.add_argument("--config", default="dsv2-lite")
    parser.add_argument("--m", default="1,8")
    args = parser.parse_args(argv)
    import cupy as cp

    old = load_old(args.old_dir)
    name, e, k, n, top_k = next(c for c in CONFIGS if c[0] == args.config)
    w = random_stack(cp, e, k, n)
    stacks = {"old": old.MarlinExpertStack(w), "new": moe.MarlinExpertStack(w)}
    rng = np.random.default_rng(0)
    calls = []
    for m in (int(x) for x in args.m.split(",")):
        ids = np.stack([rng.choice(e, top_k, replace=False) for _ in range(m)]).astype(np.int32)
        weights = cp.asarray(rng.uniform(0.05, 1.0, (m, top_k)).astype(np.float32))
        a = cp.asarray(rng.standard_normal((m, k), dtype=np.float32).astype(np.float16))
        block = moe.choose_block_size(m, top_k, e)
        sorted_ids, expert_ids, post = (cp.asarray(x) for x in align_ref(ids, block, e))
        for version in ("old", "new"):
            out = cp.full((m * top_k, n), np.nan, dtype=np.float16)
            calls.append((f"{name} M={m} {version}", lambda s=stacks[version], a=a, si=sorted_ids, ei=expert_ids,
                          p=post, o=out, m=m, b=block, wt=weights: s.gemm_phase_fused(a, si, ei, p, o, m, b, top_k,
                                                                                      topk_weights=wt)))
    for _ in range(3):
        for _, call in calls:
            call()
    cp.cuda.Device().synchronize()
    cp.cuda.runtime.profilerStart()
    for label, call in calls:
        print("profiled:", label, flush=True)
        call()
        cp.cuda.Device().synchronize()
    cp.cuda.runtime.profilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
