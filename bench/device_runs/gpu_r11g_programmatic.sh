#!/usr/bin/env bash
# Round 11g, lead (issue #4): programmatic dependent launch of the dense GEMM on sm_90 (the first weight stages fetched
# before griddepcontrol.wait; the launch with programmatic stream serialization). The whole GPU tier (with the new
# back-to-back chain test) and the partition check against HEAD (artifacts/r11g_old: the prologue's order changes no
# arithmetic, so every bit must stay), then an A/B on the six bench layers at M = 1, 16: new (programmatic), new-plain
# (the same kernels launched plainly) and old (HEAD), in bench_gemm's graphs of back-to-back launches. (Run with the
# switch then on by default, as --variants new,new-plain,old; it is off by default since, hence new-programmatic.)
#   usage (device machine, repo root; carry .whl, artifacts/r11g_old):
#     RET=$OUT bash bench/device_runs/gpu_r11g_programmatic.sh
set -u
. bench/device_runs/device_env.sh
[ -n "${SKIP_TIER:-}" ] || tier_and_partition artifacts/r11g_old r11g || { echo "TESTS FAILED: no A/B"; exit 1; }
timeout 200 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r11g_old \
  --variants new-programmatic,new-plain,old --m 1,16 --no-tinygemm \
  --labels "u4b8 g128 fp16,fe4m3fn chan fp16" > "$OUT/ab.log" 2>&1; echo "ab rc=$?"
grep -hE "\[(new-programmatic|new-plain|old)\]" "$OUT/ab.log" | cut -c1-100; pack r11g
