#!/usr/bin/env bash
# Round 6, lead: the measurement floor under the GEMM table (bench/floor_probe.py: an empty graph node, a pure
# streaming read and a device copy of exactly each cell's weight bytes, the bench's method).
#   SKIP_AB=1: nothing to test (the probe checks nothing but times); ONLY_AB=1: the probe (<= 60 s).
set -u
OUT=${OUT:-$PWD/artifacts/gpu_out}
D="$OUT/lead"
mkdir -p "$D"
[ -n "${SKIP_AB:-}" ] && { echo "lead: no tests in this script"; exit 0; }
timeout 60 python3 bench/floor_probe.py --out "$D" 2>&1 | tee "$D/floor.log"
