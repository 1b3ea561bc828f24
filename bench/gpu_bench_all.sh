#!/usr/bin/env bash
# The full benchmark tables at the current commit, one device call: GEMM grid (bench_gemm.py), repack kernels
# (bench_repack.py), MoE paths (bench_moe.py), optionally the checkpoint repack on the GPU path. Sequential, so no two
# timings share the GPU. Results (JSON/CSV + logs) in $OUT/results.tgz and $OUT/summary.txt.
#   usage (device machine, repo root, .whl carried):  [CHECKPOINT_LAYERS=8] bash bench/gpu_bench_all.sh
set -u
OUT=${OUT:-$PWD/artifacts/gpu_out}
mkdir -p "$OUT/logs" "$OUT/results"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
export CUPY_CACHE_DIR=$PWD/artifacts/cupy_cache NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
pack() { tar czf /tmp/results.tgz.part -C "$OUT" --exclude summary.txt --exclude results.tgz . ; mv /tmp/results.tgz.part "$OUT/results.tgz"; }  # archive written outside $OUT, which tar is reading
{ date -u; git log -1 --format=%h 2>/dev/null; nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv; } \
  > "$OUT/logs/machine.txt" 2>&1
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local s=$(date +%s)
  timeout "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
  echo "[$name] rc=$? in $(( $(date +%s) - s ))s" | tee -a "$OUT/logs/$name.log" >> "$OUT/summary.txt"
  tail -30 "$OUT/logs/$name.log" >> "$OUT/summary.txt"
  pack
}
step gemm "${GEMM_LIMIT:-260}" python3 bench/bench_gemm.py --out "$OUT/results"
step moe "${MOE_LIMIT:-150}" python3 bench/bench_moe.py --out "$OUT/results"
step repack "${REPACK_LIMIT:-110}" python3 bench/bench_repack.py --out "$OUT/results"
if [ -n "${CHECKPOINT_LAYERS:-}" ]; then
  step checkpoint 120 python3 bench/bench_checkpoint.py --backend numba --layers "$CHECKPOINT_LAYERS" \
    --workdir /tmp/wb-ckpt --results-dir "$OUT/results"
fi
