#!/usr/bin/env bash
# The whole test suite, by tier. Each tier is its own pytest process because Numba picks the CUDA simulator or the
# real compiler once, at import time (NUMBA_ENABLE_CUDASIM must be set before numba.cuda is imported).
set -uo pipefail
cd "$(dirname "$0")/.."
# Tiers whose tools are missing skip with the reason; WORKBENCH_REQUIRE_TIERS=compile,browser (set by .ci/run) makes
# that an error for the named tiers. Each pytest process appends one line per tier (tests/tier_report.py) to the
# summary file, repeated at the end.
export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 NUMBA_CUDA_WARN_ON_IMPLICIT_COPY=0 PYTHONDONTWRITEBYTECODE=1
WORKBENCH_SKIP_SUMMARY="$(mktemp)"
export WORKBENCH_SKIP_SUMMARY
trap 'rm -f "$WORKBENCH_SKIP_SUMMARY"' EXIT
status=0

run() {  # run pytest on the given paths; a tier that collects no test (exit 5) is an error only if it has test files
  python3 -m pytest -p no:cacheprovider "$@"
  local rc=$?
  if [ $rc -ne 0 ]; then echo "tier failed (exit $rc): pytest $*"; status=1; fi
}

existing() { for p in "$@"; do [ -e "$p" ] && printf '%s\n' "$p"; done; }

# matplotlib builds its font cache on first import and says so on stderr; do it here, not inside a notebook that
# strict nbval compares.
python3 -c "import matplotlib.pyplot" >/dev/null 2>&1

# 1. CPU tier, simulator tier and the notebooks (strict nbval), in one simulator process.
mapfile -t sim_paths < <(existing tests/cpu tests/sim notebooks)
NUMBA_ENABLE_CUDASIM=1 run "${sim_paths[@]}" --nbval --nbval-current-env \
  $( [ -f nbval_sanitize.cfg ] && echo --nbval-sanitize-with nbval_sanitize.cfg )

# 2. Offline compile checks (Numba -> PTX -> ptxas; nvcc and NVRTC for the CUDA C++) and the real-GPU tier,
#    which skips with a reason where there is no GPU.
mapfile -t hw_paths < <(existing tests/compile tests/gpu)
[ ${#hw_paths[@]} -gt 0 ] && run "${hw_paths[@]}"

# 3. A real browser against JupyterLab (skips with a reason where Chromium is not installed).
[ -d tests/browser ] && run tests/browser

echo "--- skipped, by tier (every pytest run above) ---"
cat "$WORKBENCH_SKIP_SUMMARY"
exit $status
