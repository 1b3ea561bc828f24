#!/usr/bin/env bash
# Round 9h, lead (issue #4): plans whose clusters cannot all be resident at once fall back to the global sum
# (gemm.resident_clusters, after round 9g's occupancy query). Checks: the cluster cases of tests/gpu, the two-stream
# test, and which cluster size each bench cell's plan now takes (none of the H200's bench plans should change).
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r9h_resident_clusters.sh
set -u
. bench/device_runs/device_env.sh
timeout 60 python3 -m pytest -p no:cacheprovider -q tests/gpu/test_gemm.py -k cluster > "$OUT/tests.log" 2>&1
echo "cluster tests rc=$?"; tail -1 "$OUT/tests.log"
timeout 60 python3 -m pytest -p no:cacheprovider -q tests/gpu/test_gemm_bench_shapes.py -k two_full \
  > "$OUT/tests2.log" 2>&1
echo "two-stream test rc=$?"; tail -1 "$OUT/tests2.log"
timeout 60 python3 - > "$OUT/plans.log" 2>&1 <<'PY'
import cupy as cp, numpy as np
from workbench import gemm
from workbench.scalar_types import ScalarType as S
from workbench.weight import random_marlin_weight
for k, n in ((4096, 4096), (14336, 4096), (8192, 8192), (28672, 8192)):
    mw, _ = random_marlin_weight(k, n, S.U4B8, 128)
    w = gemm.upload_weight(mw)
    for m in (1, 16):
        a = cp.zeros((m, k), dtype=np.float16)
        sms = gemm.device_properties(0)[1]
        plan = gemm.plan_marlin_gemm(a, w, c=cp.empty((m, n), dtype=np.float16), sms=sms,
                                     workspace=cp.zeros(gemm.workspace_numel(sms), dtype=np.int32),
                                     c_tmp=cp.empty(gemm.c_tmp_numel(sms), dtype=np.float32))
        print(k, n, m, plan.cfg.name_expression, "grid", plan.grid,
              "resident clusters", gemm.resident_clusters(plan.cfg, 0, plan.grid) if plan.cfg.cluster > 1 else "-")
PY
echo "plans rc=$?"; cat "$OUT/plans.log"; pack r9h
