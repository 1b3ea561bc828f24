#!/usr/bin/env bash
# Every bench family on one GPU machine, the peers built beside ours, in priority order (GEMM vs peers, repack vs
# vLLM, MoE), each step under a timeout:  bash bench/run_all.sh [OUT] [PEERS_SRC]
# PEERS_SRC comes from `python bench/peers.py export` (an ignored folder). Builds and JIT caches go under /tmp/peers.
set -u
OUT=${1:-bench/results}
SRC=${2:-_dev/peers_src}
M=${BENCH_M:-1,2,4,8,16,32,64,128,256}
LAYERS=4096x4096,4096x14336,14336x4096,8192x8192,8192x28672,28672x8192
LOG=${BENCH_LOG:-/tmp/peers/logs}
READY=/tmp/peers/ready
mkdir -p "$OUT" "$LOG" "$READY"
t0=$(date +%s)
el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
# the peers build in the background while ours compiles (the bench waits on their locks / ready file)
python3 bench/peers.py build-vllm --src "$SRC" --wtypes u4b8,fe4m3fn --report "$READY/vllm_build.json" \
  > "$LOG/vllm_build.log" 2>&1 &
python3 bench/peers.py jit-humming --src "$SRC" --shapes $LAYERS --m "$M" --report "$READY/humming.json" \
  --moe mixtral,dsv3 --ready-prefix "$READY/humming" \
  > "$LOG/humming_jit.log" 2>&1 &
el "gemm (u4b8, fe4m3fn; ours, cublas, vllm_marlin, humming)"
timeout "${GEMM_TIMEOUT:-260}" python3 bench/bench_gemm.py --out "$OUT" --peers-src "$SRC" --m "$M" \
  --wtypes u4b8,fe4m3fn --humming-ready "$READY/humming" --budget-s "${GEMM_BUDGET:-200}" \
  > "$LOG/gemm.log" 2>&1; el "gemm rc=$?"
el "repack"
timeout "${REPACK_TIMEOUT:-60}" python3 bench/bench_repack.py --out "$OUT" --peers-src "$SRC" > "$LOG/repack.log" 2>&1
el "repack rc=$?"
el "moe"
timeout "${MOE_TIMEOUT:-60}" python3 bench/bench_moe.py --out "$OUT" --peers humming --peers-src "$SRC" \
  --humming-ready "$READY/humming" > "$LOG/moe.log" 2>&1; el "moe rc=$?"
el "gemm (u4, u8b128; ours)"
timeout "${GEMM2_TIMEOUT:-60}" python3 bench/bench_gemm.py --out "$OUT" --m "$M" --wtypes u4,u8b128 --peers "" \
  --append --budget-s "${GEMM2_BUDGET:-40}" >> "$LOG/gemm.log" 2>&1; el "gemm2 rc=$?"
kill $(jobs -p) 2>/dev/null  # the peers builds, if still running
el "done"
