"""Find the SASS instruction the H200 rejects in kernels_cuda builds, without a GPU.

    python bench/sass_ldgsts_check.py gemm|moe NAMES_FILE [--kernel-dir DIR] [--part I --parts N] [--cuobjdump PATH]

Round 6 (bench/NOTES_gemm.md "Round 6b"): ptxas 13.0 can emit a cp.async whose shared address is split into a
per-thread register plus a uniform register *beside* an L2 cache-policy descriptor, e.g.
``LDGSTS.E.BYPASS.128 [R5+UR0], desc[UR1][R8.64]``; the H200 faults on it with CUDA_ERROR_ILLEGAL_INSTRUCTION. This
builds the named template instantiations (one per line of NAMES_FILE, e.g. ``mwb::marlin_gemm<__half, 5, 1, 2, 4, 6,
0, 1, false, false>``) with NVRTC and the options CuPy passes (``-ftz=true``, ``--device-as-default-execution-space``:
without them the bad form may not appear), disassembles them and prints every function that contains the form. Needs
``cuobjdump`` (CUDA toolkit or the ``nvidia-cuda-cuobjdump`` wheel; not a project dependency); exits 1 if any is found.
A clean run covers only the names given: the faulting MoE kernel of round 6b was missing from the first lists.
"""
from __future__ import annotations

import argparse
import io
import re
import shutil
import subprocess
import sys
import tempfile

BAD = re.compile(r"LDGSTS[^;]*\[R\d+\+UR\d+")
BATCH = 25  # name expressions per NVRTC program: one front-end parse for many kernels


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", choices=("gemm", "moe"))
    ap.add_argument("names", help="file with one template name expression per line")
    ap.add_argument("--part", type=int, default=0)
    ap.add_argument("--parts", type=int, default=1, help="split the list over several processes")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    ap.add_argument("--kernel-dir", help="build this copy of kernels_cuda/ instead (e.g. a patch applied elsewhere)")
    args = ap.parse_args(argv)

    from cuda import core, pathfinder

    from workbench import gemm, moe

    if args.kernel_dir:
        import pathlib

        gemm.KERNEL_DIR = pathlib.Path(args.kernel_dir)
    src = gemm.kernel_source() if args.source == "gemm" else moe.moe_kernel_source()
    names = [line.strip() for line in open(args.names) if line.strip()][args.part::args.parts]
    include = pathfinder.find_nvidia_header_directory("cudart")
    options = core.ProgramOptions(std="c++17", arch="sm_90", include_path=[include], ftz=True,
                                  device_as_default_execution_space=True)
    bad_functions = 0
    with tempfile.TemporaryDirectory() as tmp:
        cubin = f"{tmp}/batch.cubin"
        for i in range(0, len(names), BATCH):
            module = core.Program(src, "c++", options=options).compile(
                "cubin", name_expressions=names[i:i + BATCH], logs=io.StringIO())
            with open(cubin, "wb") as f:
                f.write(bytes(module.code))
            sass = subprocess.run([args.cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
            for function in re.split(r"\n\s*Function : ", sass)[1:]:
                hits = BAD.findall(function)
                if hits:
                    bad_functions += 1
                    print(f"BAD {len(hits)} {function.split(chr(10), 1)[0][:140]}", flush=True)
            print(f"{min(i + BATCH, len(names))}/{len(names)} scanned", flush=True)
    print(f"functions with the rejected form: {bad_functions}")
    return 1 if bad_functions else 0


if __name__ == "__main__":
    sys.exit(main())
