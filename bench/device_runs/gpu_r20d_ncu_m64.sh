#!/usr/bin/env bash
# Round 20d, lead (issue #4 beyond its bars, session 17): where 4096^2 M = 64 spends the ~11 µs of its finish
# (ablation r19f: base 18.69 µs, sinkfinish 7.84, nosum 18.17, nofold 16.63 — neither the cross-block sum nor the fold
# is most of it). Nsight Compute on the third launch of bench/profile_gemm.py (u4b8 g128 fp16), with its warp-stall
# samples per SASS instruction exported as CSV ($OUT/src_*.csv), so the finish's instructions can be read here.
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r20d_ncu_m64.sh
set -u
. bench/device_runs/device_env.sh
for cell in "64 4096 4096" "16 4096 4096"; do
  set -- $cell
  rep="$OUT/ncu_m$1_$2x$3"
  timeout 150 ncu -f -o "$rep" -k regex:marlin_gemm --launch-skip 2 --launch-count 1 --section SpeedOfLight \
    --section WarpStateStats --section SourceCounters --section LaunchStats --section Occupancy \
    python3 bench/profile_gemm.py launch "$1" "$2" "$3" u4b8 > "$rep.log" 2>&1
  echo "ncu M=$1 ${2}x$3 rc=$?"; tail -3 "$rep.log" | cut -c1-200
  ncu --import "$rep.ncu-rep" --print-details all > "$rep.txt" 2>&1
  ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "$OUT/src_m$1_$2x$3.csv" 2>"$rep.src.err"
  echo "source csv rc=$? lines=$(wc -l < "$OUT/src_m$1_$2x$3.csv")"; head -c 300 "$rep.src.err"
  rm -f "$rep.ncu-rep"; pack r20d
done
