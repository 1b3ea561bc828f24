#!/usr/bin/env bash
# Round 6b, lead: the lean-fetch kernels (round 6, engineer "kernels") with fixes for the instruction the H200
# rejected (an LDGSTS whose shared address ptxas split into R + UR beside its L2 cache-policy descriptor). First try:
# per-thread absolute destinations + slot offsets (dense passed, one MoE kernel still faulted). Second: no L2 cache
# hint on the weight copies and every destination derived from a per-thread register ptxas cannot prove uniform.
# One call: the GPU tests of both kernels and the partition check (bitwise = HEAD) and the bench-shape test in
# parallel; only if all pass, the A/B against HEAD (bench/device_runs/gpu_r6_kernels.sh ONLY_AB), then every
# benchmark table (bench/gpu_bench_all.sh) and the rest of the GPU tier.
#   usage (device machine, repo root; carry .whl and artifacts/r6_kernels_old = HEAD's gemm.py, moe.py, kernels_cuda/*)
set -u
OUT=${OUT:-$PWD/artifacts/gpu_out}
mkdir -p "$OUT/logs"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD CUPY_CACHE_DIR=$PWD/artifacts/cupy_cache
s=$(date +%s)
SKIP_AB=1 bash bench/device_runs/gpu_r6_kernels.sh > "$OUT/logs/kernels_tests.log" 2>&1 &
p1=$!
timeout 150 python3 -m pytest -p no:cacheprovider -q -x tests/gpu/test_gemm_bench_shapes.py > "$OUT/logs/bench_shapes.log" 2>&1
r2=$?
wait $p1
grep -E "rc=|passed|failed|PASS|FAIL" "$OUT/logs/kernels_tests.log" | tail -8; tail -1 "$OUT/logs/bench_shapes.log"
echo "tests phase $(( $(date +%s) - s ))s"
if grep -qE "rc=[1-9]" "$OUT/logs/kernels_tests.log" || [ $r2 -ne 0 ]; then echo "TESTS FAILED: stopping"; exit 1; fi
s=$(date +%s)
ONLY_AB=1 timeout 160 bash bench/device_runs/gpu_r6_kernels.sh > "$OUT/logs/kernels_ab.log" 2>&1
echo "ab rc=$? in $(( $(date +%s) - s ))s"; tail -60 "$OUT/logs/kernels_ab.log"
# the GEMM and MoE tables only (the repack kernels did not change)
s=$(date +%s)
timeout 100 python3 bench/bench_gemm.py --out "$OUT/results" > "$OUT/logs/gemm.log" 2>&1; echo "bench_gemm rc=$? $(( $(date +%s) - s ))s"
timeout 60 python3 bench/bench_moe.py --out "$OUT/results" > "$OUT/logs/moe.log" 2>&1; echo "bench_moe rc=$?"
cd "$OUT" && tar czf results.tgz results logs kernels 2>/dev/null
