#!/usr/bin/env bash
# One device call for every engineer's script of a round (bench/device_runs/gpu_<round>_<name>.sh): set-up once, the test phases
# (SKIP_AB=1) in parallel, then the A/B timing phases (ONLY_AB=1) one after another so timings do not share the GPU.
#   usage (device machine, repo root, .whl and artifacts/<round>_*_old carried):
#     ROUND=r4 bash bench/gpu_round_all.sh [names...]
# Everything lands in $OUT/results.tgz (one file comes back) plus $OUT/summary.txt.
set -u
OUT=${OUT:-$PWD/artifacts/gpu_out}
mkdir -p "$OUT/logs"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
export CUPY_CACHE_DIR=$PWD/artifacts/cupy_cache
ROUND=${ROUND:-r4}
names=${*:-"kernels repack host"}
# packed again after every phase, so a call that hits its time limit still brings back what was done
pack() { tar czf /tmp/results.tgz.part -C "$OUT" --exclude summary.txt --exclude results.tgz . ; mv /tmp/results.tgz.part "$OUT/results.tgz"; }  # archive written outside $OUT, which tar is reading
{ date -u; git log -1 --format=%h 2>/dev/null; nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv; } \
  > "$OUT/logs/machine.txt" 2>&1
start=$(date +%s)
for n in $names; do
  [ -f "bench/device_runs/gpu_${ROUND}_$n.sh" ] || { echo "no bench/device_runs/gpu_${ROUND}_$n.sh" >> "$OUT/summary.txt"; continue; }
  ( SKIP_AB=1 timeout 170 bash "bench/device_runs/gpu_${ROUND}_$n.sh" > "$OUT/logs/$n.tests.log" 2>&1
    echo "[$n tests] rc=$? after $(( $(date +%s) - start ))s" >> "$OUT/logs/$n.tests.log" ) &
done
( timeout 120 python3 -m pytest -p no:cacheprovider -q -rs tests/gpu/test_notebook_gpu_paths.py \
    > "$OUT/logs/notebook_gpu.log" 2>&1; echo "[notebook gpu paths] rc=$?" >> "$OUT/logs/notebook_gpu.log" ) &
wait
for n in $names; do tail -4 "$OUT/logs/$n.tests.log" 2>/dev/null; done | tee -a "$OUT/summary.txt"
tail -3 "$OUT/logs/notebook_gpu.log" | tee -a "$OUT/summary.txt"
pack
for n in $names; do
  [ -f "bench/device_runs/gpu_${ROUND}_$n.sh" ] || continue
  s=$(date +%s)
  ONLY_AB=1 timeout "${AB_LIMIT:-170}" bash "bench/device_runs/gpu_${ROUND}_$n.sh" > "$OUT/logs/$n.ab.log" 2>&1
  echo "[$n ab] rc=$? in $(( $(date +%s) - s ))s" >> "$OUT/logs/$n.ab.log"
  tail -40 "$OUT/logs/$n.ab.log" >> "$OUT/summary.txt"
  pack
done
if [ -n "${CHECKPOINT_LAYERS:-}" ]; then  # the checkpoint repack on the GPU path (bench/bench_checkpoint.py)
  s=$(date +%s)
  timeout 150 python3 bench/bench_checkpoint.py --backend numba --layers "$CHECKPOINT_LAYERS" --workdir /tmp/wb-ckpt \
    --results-dir "$OUT/checkpoint" > "$OUT/logs/checkpoint.log" 2>&1
  echo "[checkpoint gpu] rc=$? in $(( $(date +%s) - s ))s" >> "$OUT/logs/checkpoint.log"
  tail -5 "$OUT/logs/checkpoint.log" >> "$OUT/summary.txt"
fi
pack
echo "total $(( $(date +%s) - start ))s" | tee -a "$OUT/summary.txt"
