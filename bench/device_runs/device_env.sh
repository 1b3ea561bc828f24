# Sourced by the device scripts since round 8: the set-up every call needs on a fresh lent machine.
#   RET      the folder the device call returns (the `device` tool's $OUT), required
#   OUT      where the scripts write, $PWD/artifacts/gpu_out (tarred into $RET/<name>.tgz by `pack <name>`)
#   numpy / tqdm wheels from .whl (carried) into /tmp/site; PYTHONPATH, CuPy's kernel cache, quiet Numba
# Only a few files come back per call, so results travel as one archive, rewritten after each step.
RET=${RET:?the folder the device call returns}
OUT=$PWD/artifacts/gpu_out
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD CUPY_CACHE_DIR=$PWD/artifacts/cupy_cache NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 \
  NUMBA_CUDA_WARN_ON_IMPLICIT_COPY=0
pack() { tar czf "$RET/$1.tgz.part" -C artifacts gpu_out && mv "$RET/$1.tgz.part" "$RET/$1.tgz"; }
