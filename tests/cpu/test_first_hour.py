"""What a newcomer meets first: the README and its walk, the CLI's messages and exit codes, `doctor`, the config a
repacked checkpoint carries, the per-tier skip summary, and the licence."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import readme_walk
import tier_report

import workbench
from workbench import cli, doctor, examples, repacked_config
from workbench.checkpoint import load, repack, synthetic, verify
from workbench.formats import packing

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """cli.main in this process; argparse's usage errors (SystemExit) become their exit code."""
    try:
        rc = cli.main(list(argv))
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


# ---- README ---------------------------------------------------------------------------------------------------
def test_readme_opens_with_a_paragraph_then_the_two_commands_that_ci_runs():
    before_code = README.split("```", 1)[0]
    prose = [line for line in before_code.splitlines() if line.strip() and not line.startswith("#")]
    assert len(" ".join(prose)) > 200, "an opening paragraph saying what this is and for whom"
    first = re.search(r"```bash\n(.*?)```", README, re.S).group(1).splitlines()
    assert len(first) == 2 and first[0].endswith("workbench tour")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert first[1] in ci, "CI must run exactly the README's test command"
    require = ci.index("export WORKBENCH_REQUIRE_TIERS=compile,browser")
    assert require < ci.index(first[1])


def test_readme_picture_exists_and_notebook_installs_are_editable():
    pictures = re.findall(r"!\[[^\]]+\]\(([^)]+)\)", README)
    assert pictures and all((ROOT / p).is_file() and p.startswith("docs/img/") for p in pictures)
    blocks = re.findall(r"```bash\n(.*?)```", README + (ROOT / "docs" / "notebooks.md").read_text(), re.S)
    installs = re.findall(r"pip install (\S+)", "\n".join(blocks))
    local = [target for target in installs if target.strip("'\"").startswith(".") or target == "-e"]
    assert local and all(target == "-e" for target in local), installs


def test_readme_walk_runs_verbatim(tmp_path):
    commands = readme_walk.walk_commands()
    verbs = [c.split()[1] for c in commands]
    assert verbs == ["example-checkpoint", "inspect", "repack", "verify", "explore"]
    assert all(c.startswith("workbench ") for c in commands)
    done = readme_walk.run_walk(tmp_path, commands)
    for command, proc in zip(commands, done):
        assert proc.returncode == 0, f"{command}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert len(done) == len(commands)
    assert "(gptq, 4-bit, group size 128)" in done[0].stdout  # what the walk's first step says it writes
    assert "verify: OK" in done[3].stdout
    notebook = re.search(r"wrote (\S+\.ipynb)", done[4].stdout).group(1)
    assert (tmp_path / notebook).is_file()
    # the walk's second block opens that notebook
    assert readme_walk.walk_blocks()[1] == [f"jupyter lab {notebook}"]


def test_user_facing_text_has_no_internal_words():
    # the pages a newcomer reads first
    pages = ("docs/ARCHITECTURE.md", "docs/notebooks.md", "docs/checkpoints.md")
    texts = {"README.md": README}
    texts.update({page: (ROOT / page).read_text() for page in pages})
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    texts.update({f"workbench {name} --help": p.format_help() for name, p in sub.choices.items()})
    for where, text in texts.items():
        for word in ("the seed", "issue's bar", "the issue") + (("``",) if where.startswith("workbench") else ()):
            assert word not in text, f"{where} says {word!r}"
        assert not re.search(r"\bRound \d", text), where


# ---- CLI: messages and exit codes ------------------------------------------------------------------------------
def test_version(capsys):
    rc, out, _ = run_cli(capsys, "--version")
    assert rc == 0 and out.strip() == f"marlin-workbench {workbench.__version__}"


@pytest.mark.parametrize("argv,named", [
    (("tour", "--k", "100"), "K = 100 is not a positive multiple of 128"),
    (("tour", "--n", "64"), "N = 64 is not a positive multiple of 128"),
    (("tour", "--k", "0"), "K = 0 is not a positive multiple of 128"),
    (("tour", "--n", "12x"), "N = '12x' is not an integer"),
    (("tour", "--seed", "-1"), "seed = '-1' is not a non-negative integer"),
    (("example-checkpoint", "x", "--bits", "3"), "--bits 3 is not 4 or 8"),
    (("example-checkpoint", "x", "--group-size", "100"), "--group-size 100 is not -1"),
    (("example-checkpoint", "x", "--format", "block-fp8", "--bits", "4"), "it takes no --bits 4"),
    (("example-checkpoint", "x", "--format", "awq", "--act-order"), "no act-order"),
    (("example-checkpoint", "x", "--act-order", "--group-size", "-1"), "--act-order needs groups"),
])
def test_usage_errors_exit_2_and_name_the_value(capsys, tmp_path, monkeypatch, argv, named):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and named in err, (rc, out, err)
    assert not (tmp_path / "x").exists()


def test_tour_rejects_bad_sizes_in_python_too():
    from workbench import tour

    with pytest.raises(ValueError, match="N = 96 is not a positive multiple of 128"):
        tour.run_tour(size_k=128, size_n=96, progress=False)


def test_example_checkpoint_refuses_a_non_empty_directory(capsys, tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    rc, _, err = run_cli(capsys, "example-checkpoint", str(tmp_path))
    assert rc == 2 and f"{tmp_path} exists and is not empty" in err and "--force" in err
    assert sorted(os.listdir(tmp_path)) == ["keep.txt"]


@pytest.mark.parametrize("fmt", examples.FORMATS)
def test_example_checkpoint_every_format_is_marlin_compatible(capsys, tmp_path, fmt):
    rc, out, _ = run_cli(capsys, "example-checkpoint", str(tmp_path / fmt), "--format", fmt)
    assert rc == 0 and f"{len(examples.LAYERS)} quantized layers" in out
    rc, out, err = run_cli(capsys, "inspect", str(tmp_path / fmt))
    assert rc == 0, err
    assert f"{len(examples.LAYERS)} Marlin-compatible, 0 not" in out


def test_inspect_and_repack_say_one_layer_not_one_layers(capsys, tmp_path):
    synthetic.random_model(str(tmp_path / "one"), synthetic.Options(), {"model.layers.0.mlp.up_proj": (128, 64)})
    rc, out, _ = run_cli(capsys, "inspect", str(tmp_path / "one"))
    assert rc == 0 and "\n1 quantized layer (" in out and "2 tensors carried over" in out
    rc, _, err = run_cli(capsys, "repack", str(tmp_path / "one"), "--out", str(tmp_path / "m"), "--no-progress")
    assert rc == 0 and "repack: 1 quantized layer (" in err and "(1 file)" in err
    rc, _, err = run_cli(capsys, "repack", str(tmp_path / "one"), "--out", str(tmp_path / "m"))
    assert rc == 2 and "already exists" in err and "--force" in err and "force=True" not in err


def test_tour_with_numba_and_no_gpu_picks_the_simulator(tmp_path):
    """A fresh process without NUMBA_ENABLE_CUDASIM: the CLI must choose the simulator before numba.cuda loads.
    (The tour's cases are cut to one real Numba op to keep this fast; tests/sim runs the whole tour.)"""
    from workbench.backends import _cuda_driver_has_device

    if _cuda_driver_has_device():
        pytest.skip("a CUDA GPU is here, so --backend numba runs on it rather than in the simulator")
    script = (
        "import sys, numpy as np\n"
        "from workbench import cli, ops, tour\n"
        "def one_case(k, n, seed, backend):\n"
        "    s = np.arange(k // 128 * n, dtype=np.float16).reshape(k // 128, n)\n"
        "    def run():\n"
        "        out = np.asarray(ops.marlin_permute_scales(s, k, n, 128, backend=backend))\n"
        "        return bool(np.array_equal(ops.marlin_unpermute_scales(out, k, n, 128), s)), 'scales'\n"
        "    return [('scales', run)]\n"
        "tour.tour_cases = one_case\n"
        "sys.exit(cli.main(['tour', '--backend', 'numba', '--k', '128', '--n', '128', '--no-progress']))\n")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "device: CPU (Numba CUDA simulator); backend: numba" in proc.stdout
    assert "all 1 case bit-exact" in proc.stdout


def test_tour_help_has_no_markup(capsys):
    rc, out, _ = run_cli(capsys, "tour", "--help")
    assert rc == 0 and "``" not in out and "multiple of 128" in out


# ---- doctor ----------------------------------------------------------------------------------------------------
def test_doctor_names_what_it_found_and_exits_0(capsys):
    rc, out, _ = run_cli(capsys, "doctor")
    assert rc == 0
    found = out.split("found:", 1)[1].split("paths:", 1)[0]
    for name in ("GPU", "CUDA", "CuPy", "Numba", "NumPy"):
        assert re.search(rf"^  {name}\s+\S", found, re.M), name
    np_line = re.search(r"^  NumPy\s+(\S+)", found, re.M).group(1)
    assert np_line == np.__version__
    lines = out.split("paths:", 1)[1].strip("\n").splitlines()
    rows = [re.fullmatch(r"  (on |off)  (\S.*?)\s{2,}(\S.*)", line) for line in lines]
    assert all(rows), lines  # every path, on or off, with its reason
    states = {m.group(2): m.group(1).strip() for m in rows}
    assert states["NumPy reference"] == "on" and "Numba kernels, GPU" in states


def test_doctor_says_why_the_browser_tier_is_off(monkeypatch):
    monkeypatch.setenv("WORKBENCH_CHROMIUM", "/nonexistent/chromium")
    problems = doctor.tier_problems("browser")
    assert any("no Chromium at /nonexistent/chromium" in p and "apt-get install chromium" in p for p in problems)


def test_required_tiers_rejects_unknown_names(monkeypatch):
    monkeypatch.setenv(doctor.REQUIRE_ENV, "compile, browsr")
    with pytest.raises(ValueError, match="'browsr'"):
        doctor.required_tiers()
    monkeypatch.setenv(doctor.REQUIRE_ENV, "compile,browser")
    assert doctor.required_tiers() == {"compile", "browser"}


def test_doctor_reports_a_numba_that_cannot_compile(monkeypatch):
    """Under the simulator the compiler is not probed, and says so (the probe itself runs in `workbench doctor`)."""
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    doctor.probe_numba.cache_clear()
    try:
        ok, why = doctor.probe_numba()
    finally:
        doctor.probe_numba.cache_clear()
    assert not ok and "NUMBA_ENABLE_CUDASIM=1" in why


# ---- the config a repacked checkpoint carries ------------------------------------------------------------------
@pytest.mark.parametrize("style", ["config.json", "quantize_config.json"])
def test_repacked_config_says_marlin_workbench_and_keeps_the_source_settings(tmp_path, style):
    opt = synthetic.Options(config_style=style)
    src = synthetic.random_model(str(tmp_path / "src"), opt, {"model.layers.0.mlp.up_proj": (128, 128)})
    repack(src, tmp_path / "out", progress=False, log=lambda msg: None)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == repacked_config.QUANT_METHOD == "marlin-workbench"
    assert qc["format_version"] == workbench.FORMAT_VERSION and qc["load_with"] == "workbench.load(path)"
    assert qc["source_quantization_config"] == synthetic.quant_config(opt)
    assert qc["source_quantization_config_file"] == style
    assert config["model_type"] == "llama"  # the rest of the source's config.json is kept
    assert not (tmp_path / "out" / "quantize_config.json").exists()  # AutoGPTQ would read it as GPTQ
    assert repacked_config.is_repacked_config(config)
    assert verify(tmp_path / "out", src, progress=False).ok
    assert set(load(tmp_path / "out")) == {"model.layers.0.mlp.up_proj"}


def test_outputs_written_before_the_config_change_still_load_and_verify(tmp_path):
    src = examples.write_example(tmp_path / "src")
    repack(src, tmp_path / "out", progress=False, log=lambda msg: None)
    shutil.copy(tmp_path / "src" / "config.json", tmp_path / "out" / "config.json")  # the old output's config
    assert not repacked_config.is_repacked_config(json.loads((tmp_path / "out" / "config.json").read_text()))
    assert verify(tmp_path / "out", src, progress=False).ok
    assert len(load(tmp_path / "out")) == len(examples.LAYERS)


# ---- the explorer on a checkpoint's layer ---------------------------------------------------------------------
def test_layer_explorer_shows_the_codes_the_source_checkpoint_holds(tmp_path):
    from safetensors.numpy import load_file

    from workbench.explore import layer_explorer

    src = examples.write_example(tmp_path / "src")
    repack(src, tmp_path / "out", progress=False, log=lambda msg: None)
    layer = "model.layers.0.mlp.gate_proj"
    ex = layer_explorer(tmp_path / "out", layer)
    qweight = load_file(str(tmp_path / "src" / "model.safetensors"))[f"{layer}.qweight"]
    codes = packing.unpack_rows(qweight, 4)  # (K, N) from the GPTQ words: an independent reading
    for k, n in [(0, 0), (5, 70), (17, 3), (127, 255), (64, 128)]:
        e = ex.element(k, n)
        assert e["field_code"] == e["code"] == codes[k, n], (k, n, e)
    before = ex.stored.value
    ex.explorer.k.value = 6
    assert ex.stored.value != before and "(k=6, n=70)" in ex.stored.value


@pytest.mark.parametrize("fmt,bits,act_order,sym", [
    ("gptq", 8, True, True), ("gptq", 4, False, False), ("awq", 4, False, False),
    ("compressed-tensors", 4, True, True), ("block-fp8", 8, False, True)])
def test_layer_explorer_field_code_is_the_stored_code_in_every_format(tmp_path, fmt, bits, act_order, sym):
    from workbench.explore import layer_explorer

    opt = examples.example_options(fmt, bits, 128, act_order, sym)
    repack(examples.write_example(tmp_path / "src", opt), tmp_path / "out", progress=False, log=lambda msg: None)
    ex = layer_explorer(tmp_path / "out", "model.layers.0.mlp.gate_proj")
    assert ex.weight.weight_type == synthetic._weight_type(opt)
    positions = [(k, n) for k in range(0, ex.weight.size_k, 7) for n in range(0, ex.weight.size_n, 5)]
    wrong = [(k, n) for k, n in positions if ex.element(k, n)["field_code"] != ex.element(k, n)["code"]]
    assert not wrong, wrong[:5]


def test_explore_names_the_layers_when_one_is_missing(capsys, tmp_path):
    examples.write_example(tmp_path / "src")
    rc, _, err = run_cli(capsys, "explore", str(tmp_path / "src"), "--layer", "nope",
                         "--notebook", str(tmp_path / "e.ipynb"))
    assert rc == 2 and "no quantized layer named 'nope'" in err and "model.layers.0.mlp.gate_proj" in err
    rc, _, err = run_cli(capsys, "explore", str(tmp_path / "src"), "--layer", "model.layers.0.mlp.down_proj",
                         "--notebook", str(tmp_path / "e.ipynb"))
    assert rc == 2 and "K x N = 256 x 128" in err
    assert not (tmp_path / "e.ipynb").exists()


# ---- skip summary and required tiers ---------------------------------------------------------------------------
class _Report:
    def __init__(self, nodeid, reason):
        self.nodeid, self.longrepr = nodeid, ("file.py", 1, f"Skipped: {reason}")


def test_summary_lines_count_reasons_per_tier():
    reports = [_Report("tests/compile/test_a.py::t1", "nvcc is not on PATH")] * 3 + [
        _Report("tests/compile/test_b.py::t2", "one half covers 8 rows"),
        _Report("notebooks/07_performance.ipynb::Cell 2", "no GPU")]
    lines = tier_report.summary_lines({"compile", "cpu", "notebooks"}, reports)
    assert lines == ["compile: 4 skipped: 3 × nvcc is not on PATH; 1 × one half covers 8 rows",
                     "cpu: nothing skipped",
                     "notebooks: 1 skipped: 1 × no GPU"]


RUN_ALL_SUMMARY = "--- skipped, by tier (every pytest run above) ---"


def _fake_suite(root: Path) -> None:
    """A tree shaped like this repository's: run_all.sh, the shared conftest, one test file per tier."""
    (root / "tests" / "cpu").mkdir(parents=True)
    (root / "pytest.ini").write_text("[pytest]\n")  # the rootdir, as pyproject.toml is here
    (root / "tests" / "compile").mkdir()
    (root / "tests" / "browser").mkdir()
    shutil.copy(ROOT / "tests" / "run_all.sh", root / "tests" / "run_all.sh")
    (root / "tests" / "conftest.py").write_text(
        "from tier_report import pytest_collection_modifyitems, pytest_terminal_summary  # noqa: F401\n")
    (root / "tests" / "cpu" / "test_c.py").write_text("def test_ok():\n    pass\n")
    (root / "tests" / "compile" / "test_k.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('i', range(3))\ndef test_nvcc(i):\n"
        "    pytest.skip('nvcc is not on PATH')\n")
    (root / "tests" / "browser" / "test_b.py").write_text("def test_browser():\n    pass\n")


def _suite_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (doctor.REQUIRE_ENV, "CI", tier_report.SUMMARY_ENV)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def test_run_all_ends_with_one_skip_line_per_tier(tmp_path):
    _fake_suite(tmp_path)
    proc = subprocess.run(["bash", str(tmp_path / "tests" / "run_all.sh")], capture_output=True, text=True,
                          env=_suite_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    tail = proc.stdout.split(RUN_ALL_SUMMARY, 1)[1].strip().splitlines()
    assert tail == ["cpu: nothing skipped", "compile: 3 skipped: 3 × nvcc is not on PATH", "browser: nothing skipped"]


def test_a_required_tier_with_a_missing_tool_is_an_error(tmp_path):
    _fake_suite(tmp_path)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", str(tmp_path / "tests" / "browser")]
    missing = "/nonexistent/chromium"
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env=_suite_env(WORKBENCH_CHROMIUM=missing, WORKBENCH_REQUIRE_TIERS="browser",
                                         PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"))
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    assert f"asks for the browser tier, but it cannot run here: no Chromium at {missing}" in proc.stderr


def test_browser_conftest_skips_on_ci_without_chromium(monkeypatch):
    """CI=1 (set by common CI services) alone does not turn the skip into a failure; WORKBENCH_REQUIRE_TIERS does."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("browser_conftest", ROOT / "tests" / "browser" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("CI", "1")
    monkeypatch.setenv("WORKBENCH_CHROMIUM", "/nonexistent/chromium")
    with pytest.raises(pytest.skip.Exception, match="no Chromium at /nonexistent/chromium"):
        module._require_browser()


# ---- licence ---------------------------------------------------------------------------------------------------
def test_license_is_the_apache_2_text_pyproject_declares():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == {"text": "Apache-2.0"}
