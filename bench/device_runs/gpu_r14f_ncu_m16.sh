#!/usr/bin/env bash
# Round 14f (issue #4): Nsight Compute on the dense GEMM where the INT4 bar is still missed, beside a cell that meets
# it with the same tile and grid: u4b8 g128 fp16 14336x4096 at M = 8 (swapped) and M = 16 (rows layout; both 512 x 64
# pairs on 128 blocks since round 14), 4096^2 at M = 1 and 16. Questions: what the warps wait on (stall reasons per
# issued instruction), how busy the issue slots and the tensor pipe are, DRAM throughput. The third launch of each
# process is profiled (bench/profile_gemm.py launch; ncu's cache control flushes L2 first).
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r14f_ncu_m16.sh
set -u
. bench/device_runs/device_env.sh
STALLS=barrier,long_scoreboard,short_scoreboard,math_pipe_throttle,wait,mio_throttle,lg_throttle,dispatch_stall
STALLS=$STALLS,no_instruction,not_selected,selected,membar,branch_resolving,imc_miss,misc,sleeping,drain,tex_throttle
METRICS=smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
METRICS=$METRICS,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active
for s in ${STALLS//,/ }; do METRICS=$METRICS,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio; done
for cell in "8 14336 4096" "16 14336 4096" "1 4096 4096" "16 4096 4096"; do
  set -- $cell
  timeout 100 ncu -k regex:marlin_gemm --launch-skip 2 --launch-count 1 --section SpeedOfLight \
    --section WarpStateStats --section SchedulerStats --metrics "$METRICS" \
    python3 bench/profile_gemm.py launch "$1" "$2" "$3" u4b8 > "$OUT/ncu_m$1_$2x$3.txt" 2>&1
  echo "ncu M=$1 ${2}x$3 rc=$?"
  grep -E "Duration|DRAM Throughput|issue_active|hmma|inst_executed|warps_active|stalled|ERR" \
    "$OUT/ncu_m$1_$2x$3.txt" | grep -vE " 0(\.0+)?$" | sed -E 's/smsp__average_warps_issue_stalled_//; s/ +/ /g' \
    | cut -c1-100
  pack r14f
done
