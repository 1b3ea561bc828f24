#!/usr/bin/env bash
# Round 6, engineer "policy" (issue #4): the kernel-choice policy from the configuration sweep (workbench/gemm.py:
# ONE_M_BLOCK_STAGES = 6 stages first for 4-bit M <= 16, 4 for 8-bit; EIGHT_BIT_ONE_M_BLOCK_SHAPES = the (4, 2)
# tile first for 8-bit M <= 16; ALIGNED_MAX_LONGER = 1.2: slice-aligned grids up to 20% longer than the striped one).
# Only the choice of kernel / grid changes: outputs differ from HEAD where the configuration or grid does (another
# K split), never where both are the same.
#   usage (device machine, repo root, numpy wheel installed, PYTHONPATH exported, carry artifacts/r6_policy_old):
#     bash bench/device_runs/gpu_r6_policy.sh            tests, then A/B
#     SKIP_AB=1 bash bench/device_runs/gpu_r6_policy.sh  tests only (<= 140 s): tests/gpu/test_gemm.py under the new
#                                             policy (it launches what config_for picks: new stage counts, tiles,
#                                             grids) + the CPU policy / sweep / ABI tests, then (time left)
#                                             tests/gpu/test_moe.py's dense-loop path tests
#     ONLY_AB=1 bash bench/device_runs/gpu_r6_policy.sh  A/B only (<= 150 s): bench/ab_gemm.py new (tree kernels, new
#                                             policy) vs new-oldpolicy (tree kernels, pre-round-6 policy) vs old
#                                             (HEAD's gemm.py + kernels from $R6_POLICY_OLD): u4b8 g128 fp16 M = 1,
#                                             8, 16, 64 on the six layers; fe4m3fn / u8b128 M = 1, 16 on 8192x28672,
#                                             8192^2, 4096x14336, 4096^2, 14336x4096; then the fixed sweep
#                                             (bench/sweep_gemm.py) on the large u4b8 layers with the time left
# WORKBENCH_GEMM_POLICY is cleared here (a round may export =pre-r6 for the bitwise-vs-HEAD checks of other scripts).
# Writes $OUT/policy/{gemm_tests.log, cpu_tests.log, moe_tests.log, ab_u4.log, ab_u4/, ab_8bit.log, ab_8bit/, sweep.log, sweep/,
# summary.txt}; ends by printing per cell: choice old policy -> new, µs, new / oldpolicy, bits.
set -u
OUT=${OUT:-$PWD/artifacts/gpu_out}
D="$OUT/policy"
OLD=${R6_POLICY_OLD:-artifacts/r6_policy_old}
mkdir -p "$D"
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/artifacts/cupy_cache}
unset WORKBENCH_GEMM_POLICY
for f in gemm.py marlin_gemm.cu marlin_mainloop.cuh dequant.cuh mma.cuh; do
  [ -f "$OLD/$f" ] || { echo "missing $OLD/$f (carry $OLD)"; exit 2; }
done

if [ -z "${ONLY_AB:-}" ]; then
start=$(date +%s)
timeout 60 python3 -m pytest -p no:cacheprovider -q tests/cpu/test_gemm_policy.py tests/cpu/test_sweep_gemm.py \
  tests/cpu/test_gemm_abi.py > "$D/cpu_tests.log" 2>&1 &
p_cpu=$!
timeout 135 python3 -m pytest -p no:cacheprovider -x -q -rs tests/gpu/test_gemm.py > "$D/gemm_tests.log" 2>&1
echo "gemm tests (new policy): pytest rc=$? after $(( $(date +%s) - start ))s" | tee -a "$D/gemm_tests.log"
wait $p_cpu; echo "cpu tests (policy, sweep, abi): rc=$? after $(( $(date +%s) - start ))s" | tee -a "$D/cpu_tests.log"
# the MoE's dense per-expert loop launches the dense policy's choices too: its path-agreement tests, if time is left
left=$(( 138 - ($(date +%s) - start) ))
if [ "$left" -ge 25 ]; then
  timeout "$left" python3 -m pytest -p no:cacheprovider -x -q -rs tests/gpu/test_moe.py \
    -k "phase_paths_agree or paths_match_reference" > "$D/moe_tests.log" 2>&1
  echo "moe dense-loop tests (new policy): pytest rc=$? after $(( $(date +%s) - start ))s" | tee -a "$D/moe_tests.log"
else
  echo "moe dense-loop tests: skipped, ${left}s left" | tee "$D/moe_tests.log"
fi
tail -3 "$D/cpu_tests.log" "$D/gemm_tests.log" "$D/moe_tests.log"
fi

if [ -z "${SKIP_AB:-}" ]; then
t0=$(date +%s)
# layers in order of interest (ab_gemm writes its JSON after each layer, so a timeout loses only the last one)
timeout 72 python3 bench/ab_gemm.py --out "$D/ab_u4" --old-dir "$OLD" --variants new,new-oldpolicy,old \
  --m 1,8,16,64 --no-tinygemm --labels "u4b8 g128 fp16" \
  --shapes 4096x14336,8192x28672,14336x4096,28672x8192,4096x4096,8192x8192 > "$D/ab_u4.log" 2>&1
echo "ab u4b8: rc=$? in $(( $(date +%s) - t0 ))s" | tee -a "$D/ab_u4.log"
s=$(date +%s)
timeout 50 python3 bench/ab_gemm.py --out "$D/ab_8bit" --old-dir "$OLD" --variants new,new-oldpolicy,old --m 1,16 \
  --no-tinygemm --shapes 8192x28672,8192x8192,4096x14336,4096x4096,14336x4096 --labels "u8b128,fe4m3fn" \
  > "$D/ab_8bit.log" 2>&1
echo "ab 8-bit: rc=$? in $(( $(date +%s) - s ))s" | tee -a "$D/ab_8bit.log"
# the sweep (cells 24-27: u4b8 8192x28672 / 28672x8192, M = 1 then 16) with what is left of 150 s, if >= 20 s
left=$(( 145 - ($(date +%s) - t0) ))
if [ "$left" -ge 20 ]; then
  timeout $(( left + 5 )) python3 bench/sweep_gemm.py --out "$D/sweep" --budget-s $(( left - 8 )) --workers 14 \
    --cells 24,25,26,27 > "$D/sweep.log" 2>&1
  echo "sweep large u4b8: rc=$? in $(( $(date +%s) - t0 ))s since the A/B start" | tee -a "$D/sweep.log"
else
  echo "sweep large u4b8: skipped, ${left}s left" | tee "$D/sweep.log"
fi
python3 - "$D" <<'PY' 2>&1 | tee "$D/summary.txt"
import glob, json, sys
d = sys.argv[1]
rows = [r for f in sorted(glob.glob(f"{d}/ab_*/ab_*.json")) for r in json.load(open(f))["rows"]]
cells = {}
for r in rows:
    if "[" in r["method"]:
        label, variant = r["method"].rsplit(" [", 1)
        cells.setdefault((label.replace("marlin ", ""), r["k"], r["n"], r["m"]), {})[variant[:-1]] = r
print("policy A/B (us): oldpol = tree kernels + pre-round-6 policy, new = tree kernels + new policy, old = HEAD;")
print("bits: new == oldpol's output (expected only where the choice is the same); op=old: oldpol == HEAD bitwise")
print(f"{'weights':18} {'K x N':>11} {'M':>3} {'oldpol choice':>18} {'new choice':>18} {'oldpol':>8} {'new':>8} "
      f"{'new/oldp':>8} {'old':>8} {'bits':>5} {'op=old':>6}")
ratios = []
for (label, k, n, m), v in cells.items():
    if "new" not in v or "new-oldpolicy" not in v:
        continue
    a, b, o = v["new-oldpolicy"], v["new"], v.get("old", {})
    ratio = b["us"] / a["us"]
    if (a["config"], a["grid"]) != (b["config"], b["grid"]):
        ratios.append(ratio)
    # bits of new vs oldpolicy are not recorded by ab_gemm (both vs old): equal to old both => equal to each other
    same = b.get("bits_equal_old") and a.get("bits_equal_old")
    print(f"{label:18} {f'{k}x{n}':>11} {m:3d} {a['config'] + ' ' + str(a['grid']):>18} "
          f"{b['config'] + ' ' + str(b['grid']):>18} {a['us']:8.2f} {b['us']:8.2f} {ratio:8.3f} "
          f"{o.get('us', float('nan')):8.2f} {str(bool(same))[0]:>5} {str(a.get('bits_equal_old'))[0]:>6}")
if ratios:
    import math
    print(f"cells whose choice changed: {len(ratios)}, geometric mean new/oldpolicy "
          f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}, worst {max(ratios):.3f}, best {min(ratios):.3f}")
for f in glob.glob(f"{d}/sweep/sweep_*.json"):
    data = json.load(open(f))
    print(f"sweep ({data['meta'].get('stopped')}):")
    for cell in data["cells"]:
        good = sorted((r for r in cell["candidates"] if r.get("ok") and r.get("us") is not None), key=lambda r: r["us"])
        wrong = sum(1 for r in cell["candidates"] if r.get("ok") is False)
        if good and cell.get("default_us"):
            g = good[0]
            print(f"  {cell['label']:36} default {cell['default_config']} {cell['default_grid']} "
                  f"{cell['default_us']:.2f} best {g['config']} {g['grid']} {g['us']:.2f} "
                  f"({g['us'] / cell['default_us']:.3f}), {wrong} wrong")
        else:
            print(f"  {cell['label']:36} no default timing, {wrong} wrong")
PY
fi
