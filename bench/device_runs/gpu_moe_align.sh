#!/usr/bin/env bash
# moe_align_block_size on the device: GPU tests of the MoE module (the CUDA C++ mwb::moe_align kernel, fused_moe on
# it, the rest unchanged), then the CUDA kernel vs the Numba kernel at bench_moe.py's shapes (every config x the
# four token counts M = 1, 8, 64, 256; routing and block size chosen as bench_moe.py does).
# Run from the repo root on the H200 with $OUT set, the numpy wheel installed and PYTHONPATH exported (by the lead).
# Writes $OUT/moe_tests.log and $OUT/moe_align.json, prints the test tail and a table.
#
# Timing method: per cell, one warm-up call of each, then 20 calls back to back between two CUDA events on the
# null stream (no L2 flush: the routing is a few KiB and the cost being compared is the host dispatch), plus the
# host wall time of those 20 calls; each variant's outputs are checked against the NumPy spec
# (workbench.formats.moe_align) so a fast wrong answer cannot pass as a speed-up.
set -u
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT"
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/artifacts/cupy_cache} NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 \
  NUMBA_CUDA_WARN_ON_IMPLICIT_COPY=0

start=$(date +%s)
timeout 140 python3 -m pytest -x -q tests/gpu/test_moe.py > "$OUT/moe_tests.log" 2>&1
echo "moe pytest rc=$? in $(( $(date +%s) - start ))s" | tee -a "$OUT/moe_tests.log"
tail -8 "$OUT/moe_tests.log"

start=$(date +%s)
timeout 20 python3 - <<'EOF'
import json
import os
import pathlib
import sys
import time

import cupy as cp
import numpy as np

sys.path.insert(0, "bench")
from bench_moe import CONFIGS, M_VALUES  # noqa: E402  (the benchmark's shapes, not a copy of them)
from kernels_numba.moe_align import moe_align_block_size as align_numba  # noqa: E402
from workbench import moe  # noqa: E402
from workbench.formats import moe_align as spec  # noqa: E402

CALLS = 20
props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
gpu = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
rng = np.random.default_rng(0)
rows = []
for name, e, _k, _n, top_k in CONFIGS:
    for m in M_VALUES:
        ids = np.stack([rng.choice(e, top_k, replace=False) for _ in range(m)]).astype(np.int32)  # [m, top_k]
        block = moe.choose_block_size(m, top_k, e)
        d_ids = cp.asarray(ids)
        want = spec.moe_align_block_size(ids, block, e)
        row = dict(config=name, experts=e, top_k=top_k, m=m, moe_block_size=block)
        for variant, fn in (("numba", lambda: align_numba(d_ids, block, e)),
                            ("cuda", lambda: moe.moe_align_block_size(d_ids, block, e))):
            got = [cp.asnumpy(x) for x in fn()]  # warm-up (compiles on first use) and the correctness check
            ok = (got[2].tolist() == want[2].tolist() and np.array_equal(got[1], want[1]) and
                  spec.segments(*got, block, ids.size) == spec.segments(*want, block, ids.size))
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            begin, end = cp.cuda.Event(), cp.cuda.Event()
            begin.record()
            for _ in range(CALLS):
                fn()
            end.record()
            end.synchronize()
            host_us = (time.perf_counter() - t0) * 1e6 / CALLS
            row[f"{variant}_us"] = round(cp.cuda.get_elapsed_time(begin, end) * 1e3 / CALLS, 2)
            row[f"{variant}_host_us"] = round(host_us, 2)
            row[f"{variant}_matches_spec"] = bool(ok)
        row["speedup"] = round(row["numba_us"] / row["cuda_us"], 1)
        rows.append(row)
        # written after every cell, whole: a timeout leaves the cells measured so far, never a half-written file
        out = pathlib.Path(os.environ["OUT"]) / "moe_align.json"
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(dict(gpu=gpu, calls_per_timing=CALLS, rows=rows), indent=1))
        tmp.replace(out)

print(f"\n{gpu}: moe_align_block_size, us per call ({CALLS} calls back to back between events; host wall in ())")
print("| config | E | top_k | M | block | Numba us | CUDA us | Numba/CUDA | matches spec (Numba, CUDA) |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['config']} | {r['experts']} | {r['top_k']} | {r['m']} | {r['moe_block_size']} | "
          f"{r['numba_us']} ({r['numba_host_us']}) | {r['cuda_us']} ({r['cuda_host_us']}) | {r['speedup']}x | "
          f"{r['numba_matches_spec']}, {r['cuda_matches_spec']} |")
bad = [r for r in rows if not (r["numba_matches_spec"] and r["cuda_matches_spec"])]
sys.exit(1 if bad else 0)
EOF
echo "moe_align timing rc=$? in $(( $(date +%s) - start ))s"
