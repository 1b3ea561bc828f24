#!/usr/bin/env bash
# Round 13g (issue #7): Nsight Compute on the fused MoE phase, old (artifacts/r13_old, 04db8d4) beside new (the
# routing read ahead), DeepSeek-V2-Lite-like M = 1 and 8 (bench/ncu_moe_probe.py). Questions: why M = 1 lone calls
# got slower (+7%) while everything else gained; what bounds M = 8 (19.6 µs in graphs against 14.3 for a copy of
# its bytes): DRAM throughput, stall reasons, achieved occupancy, the tail.
#   usage (device machine, repo root; carry .whl, artifacts/r13_old):
#     RET=$OUT bash bench/device_runs/gpu_r13g_ncu_moe.sh
set -u
. bench/device_runs/device_env.sh
timeout 240 ncu --profile-from-start off -k regex:marlin_moe --section SpeedOfLight --section LaunchStats \
  --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
  python3 bench/ncu_moe_probe.py artifacts/r13_old > "$OUT/ncu.txt" 2>&1; echo "ncu rc=$?"
grep -E "profiled:|marlin_moe|Duration|DRAM Throughput|Achieved Occupancy|No Eligible|ERR" \
  "$OUT/ncu.txt" | cut -c1-150 | head -90
pack r13g
