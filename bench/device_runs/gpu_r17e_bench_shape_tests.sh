#!/usr/bin/env bash
# Round 17e, lead (issue #4, session 14): tests/gpu/test_gemm_bench_shapes.py with the cases added for round 17's
# pair rules (u4 + zero points and bf16 on 28672x8192 in long one-block pairs, bf16 4096x14336 M <= 8 in two-block
# pairs): fresh random weights against the fp32 reference within tests/gpu's bound, outputs poisoned. r17c's tier ran
# these rules but no test shape reached them. ~2 min.
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r17e_bench_shape_tests.sh
set -u
. bench/device_runs/device_env.sh
timeout 400 python3 -m pytest -p no:cacheprovider -q -rs tests/gpu/test_gemm_bench_shapes.py > "$OUT/bench_shapes.log" 2>&1
echo "bench shape tests rc=$?"; grep -E "passed|failed|FAIL|Error" "$OUT/bench_shapes.log" | head -20; pack r17e
