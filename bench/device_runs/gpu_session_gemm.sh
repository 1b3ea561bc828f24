#!/usr/bin/env bash
# One GPU-machine session for the Marlin GEMM: environment, tests/gpu (GEMM), then the benchmark.
#   usage (on the device machine, repo root):  bash bench/device_runs/gpu_session_gemm.sh [--quick] [pytest -k expression]
# Logs and results go to $OUT (default ./artifacts/gpu_out).
set -u
OUT=${OUT:-$PWD/artifacts/gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
export CUPY_CACHE_DIR=$PWD/artifacts/cupy_cache  # ignored by git, kept between calls on a warm machine
QUICK=""
[ "${1:-}" = "--quick" ] && { QUICK="--quick"; shift; }
KEXPR=${1:-}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/nvidia_smi.csv" 2>&1
python3 - <<'PY' 2>&1 | tee "$OUT/env.txt"
import cupy, ml_dtypes, numpy, sys
print("python", sys.version.split()[0], "numpy", numpy.__version__, "cupy", cupy.__version__)
x = cupy.arange(4, dtype=numpy.float32).astype(ml_dtypes.bfloat16)
print("cupy bf16 ok:", x.dtype, cupy.asnumpy(x))
PY
start=$(date +%s)
timeout 280 python3 -m pytest -p no:cacheprovider -q -rs --maxfail=30 tests/gpu/test_gemm.py ${KEXPR:+-k "$KEXPR"} \
  > "$OUT/gpu_tests.log" 2>&1
echo "pytest rc=$? in $(( $(date +%s) - start ))s" | tee -a "$OUT/gpu_tests.log"
tail -40 "$OUT/gpu_tests.log"
start=$(date +%s)
timeout 270 python3 bench/bench_gemm.py --out "$OUT/bench" $QUICK > "$OUT/bench.log" 2>&1
echo "bench rc=$? in $(( $(date +%s) - start ))s" | tee -a "$OUT/bench.log"
tail -60 "$OUT/bench.log"
