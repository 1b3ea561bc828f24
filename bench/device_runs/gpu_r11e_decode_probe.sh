#!/usr/bin/env bash
# Round 11e, lead (issue #7); ran with bench/attic/moe_round11_striped_phase.patch applied, whose
# bench/probe_moe_decode_striped.py is the probe this called (bench/probe_moe_decode.py was that file then). After
# r11d (the striped MoE phase slower than the fused kernel at M = 1): the fused, striped and dense (the same bytes
# side by side) forms at M = 1, each as single calls and in graphs.
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r11e_decode_probe.sh
set -u
. bench/device_runs/device_env.sh
timeout 200 python3 bench/probe_moe_decode.py --out "$OUT/probe" > "$OUT/probe.log" 2>&1; echo "probe rc=$?"
cat "$OUT/probe.log" | tail -25; pack r11e
