"""`workbench doctor` on the compiler path: it compiles a test kernel with the real Numba CUDA compiler and, when
that fails, says why. The failure that motivated it is a NumPy newer than the installed numba-cuda: the compiler
calls ``numpy.row_stack``, which NumPy 2.5 removed. A fresh process without that function reproduces it exactly."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _doctor(prelude: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    code = prelude + "\nimport sys\nfrom workbench import cli\nsys.exit(cli.main(['doctor']))\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def _compile_line(out: str) -> str:
    return next(line for line in out.splitlines() if "Numba offline compile" in line)


def _require_compiler() -> None:
    from workbench import doctor

    ok, why = doctor.probe_numba()
    if not ok:
        pytest.skip(f"the Numba CUDA compiler cannot run here: {why}")


def test_doctor_says_the_compiler_path_is_on_when_it_compiles():
    _require_compiler()
    proc = _doctor("")
    assert proc.returncode == 0, proc.stderr
    assert _compile_line(proc.stdout).lstrip().startswith("on ")


def test_doctor_names_a_numpy_the_compiler_cannot_work_with():
    _require_compiler()  # otherwise the path is off for another reason
    proc = _doctor("import numpy\nif hasattr(numpy, 'row_stack'):\n    del numpy.row_stack")
    assert proc.returncode == 0, proc.stderr  # doctor reports, it does not fail
    line = _compile_line(proc.stdout)
    assert line.lstrip().startswith("off") and "row_stack" in line, line
