# Sourced by the device scripts since round 8: the set-up every call needs on a fresh lent machine.
#   RET      the folder the device call returns (the `device` tool's $OUT), required
#   OUT      where the scripts write, $PWD/artifacts/gpu_out (tarred into $RET/<name>.tgz by `pack <name>`)
#   numpy / tqdm wheels from .whl (carried) into /tmp/site; PYTHONPATH, CuPy's kernel cache, quiet Numba
# Only a few files come back per call, so results travel as one archive, rewritten after each step.
RET=${RET:?the folder the device call returns}
OUT=$PWD/artifacts/gpu_out
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD CUPY_CACHE_DIR=$PWD/artifacts/cupy_cache NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 \
  NUMBA_CUDA_WARN_ON_IMPLICIT_COPY=0
pack() { tar czf "$RET/$1.tgz.part" -C artifacts gpu_out && mv "$RET/$1.tgz.part" "$RET/$1.tgz"; }

# tests/gpu (the whole tier) beside bench/partition_check.py against OLD (a previous commit's files), in parallel; logs
# $OUT/gpu_tier.log and $OUT/partition_check.log, packed as NAME. Fails (status 1) when either failed.
#   usage: tier_and_partition OLD NAME || { echo "TESTS FAILED"; exit 1; }
tier_and_partition() {
  local old=$1 name=$2 start p1 p2
  start=$(date +%s)
  timeout 420 python3 -m pytest -p no:cacheprovider -q -rs tests/gpu > "$OUT/gpu_tier.log" 2>&1 &
  p1=$!
  timeout 270 python3 bench/partition_check.py "$old" > "$OUT/partition_check.log" 2>&1 &
  p2=$!
  wait $p1; echo "gpu tier rc=$? after $(( $(date +%s) - start ))s" | tee -a "$OUT/gpu_tier.log"
  wait $p2; echo "partition check rc=$?" | tee -a "$OUT/partition_check.log"
  grep -E "FAIL|Error|passed|failed" "$OUT/gpu_tier.log" | head -20; tail -3 "$OUT/partition_check.log"; pack "$name"
  ! grep -qE "rc=[1-9]" "$OUT/gpu_tier.log" "$OUT/partition_check.log"
}

# tests/gpu/test_moe.py, then bench_moe's A/B of lone calls against OLD (a previous commit's moe.py and kernels, M = 1,
# 8, 64), then the fused paths of the MoE table; logs $OUT/{gpu_moe,ab,table}.log, packed as NAME after each step.
# Fails (status 1), timing nothing, when the tests failed.
#   usage: moe_tests_ab_table OLD NAME || { echo "TESTS FAILED"; exit 1; }
moe_tests_ab_table() {
  local old=$1 name=$2
  mkdir -p "$OUT/ab" "$OUT/results"
  timeout 200 python3 -m pytest -p no:cacheprovider -q -rs tests/gpu/test_moe.py > "$OUT/gpu_moe.log" 2>&1
  echo "moe tests rc=$?" | tee -a "$OUT/gpu_moe.log"; tail -3 "$OUT/gpu_moe.log"; pack "$name"
  grep -q "rc=0" "$OUT/gpu_moe.log" || return 1
  timeout 250 python3 bench/bench_moe.py --out "$OUT/ab" --ab-old "$old" --m 1,8,64 --variants "" \
    > "$OUT/ab.log" 2>&1; echo "ab rc=$?"; grep -E " (old|new) " "$OUT/ab.log" | cut -c1-110; pack "$name"
  timeout 150 python3 bench/bench_moe.py --out "$OUT/results" --paths fused > "$OUT/table.log" 2>&1
  echo "table rc=$?"; tail -13 "$OUT/table.log" | cut -c1-250; pack "$name"
}

# tier_and_partition against OLD, then bench/ab_gemm.py's A/B of new against OLD on the cells whose slices are summed
# in clusters (4096², 14336×4096, 8192², 28672×8192 at M = 1, 8, 16; LABELS: bench_gemm label substrings, default
# u4b8 fp16, FP8 channelwise, u4 + zero points), with whether each output is bitwise OLD's; packed as NAME. Fails
# (status 1), timing nothing, when the tests failed. OLD: bench/device_runs/make_old.sh writes it from HEAD.
#   usage: tier_partition_ab OLD NAME [LABELS] || exit 1
tier_partition_ab() {
  local old=$1 name=$2 labels=${3:-"u4b8 g128 fp16,fe4m3fn chan fp16,u4 g128"}
  tier_and_partition "$old" "$name" || { echo "TESTS FAILED"; return 1; }
  timeout 200 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir "$old" --m 1,8,16 \
    --shapes 4096x4096,14336x4096,8192x8192,28672x8192 --labels "$labels" \
    --variants new,old --no-tinygemm > "$OUT/ab.log" 2>&1
  echo "ab rc=$?"; grep -E "\[(new|old)\]|bitwise" "$OUT/ab.log" | sed -E 's/ +/ /g' | cut -c1-72; pack "$name"
}

# bench/bench_gemm.py's full grid into $OUT/results (log $OUT/bench_gemm.log), packed as NAME; the caller sets
# BENCH_COMMIT (the device copy's git HEAD is stale).
#   usage: gemm_grid NAME
gemm_grid() {
  mkdir -p "$OUT/results"
  timeout 300 python3 bench/bench_gemm.py --out "$OUT/results" > "$OUT/bench_gemm.log" 2>&1; echo "bench_gemm rc=$?"
  tail -2 "$OUT/bench_gemm.log" | cut -c1-200; pack "$1"
}

# bench/ab_gemm.py's A/B of new against AB_OLD on every bench layer and type at the M values MS (on a quiet GPU, so
# first), then tier_and_partition against TIER_OLD (usually the same folder); packed as NAME after each step. Fails
# (status 1) when the tests failed.
#   usage: ab_then_tier AB_OLD TIER_OLD NAME MS || exit 1      (e.g. ab_then_tier artifacts/r19b_old ... r19c 1,8,16)
ab_then_tier() {
  local ab_old=$1 tier_old=$2 name=$3 ms=$4
  timeout 200 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir "$ab_old" --m "$ms" \
    --variants new,old --no-tinygemm > "$OUT/ab.log" 2>&1
  echo "ab rc=$?"; pack "$name"
  tier_and_partition "$tier_old" "$name" || { echo "TESTS FAILED"; return 1; }
}
