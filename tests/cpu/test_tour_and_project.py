"""The `workbench tour` main job, and the project's promises about its set-up."""
import re
import sys
from pathlib import Path

import pytest

from workbench import cli, tour

ROOT = Path(__file__).resolve().parents[2]


def test_tour_is_all_exact_at_a_small_size():
    rows = tour.run_tour(size_k=256, size_n=128, progress=False)
    assert len(rows) >= 14
    assert all(r.exact for r in rows), [(r.fmt, r.detail) for r in rows if not r.exact]


def test_tour_command_exit_code_and_table(capsys):
    assert cli.main(["tour", "--k", "256", "--n", "128", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "bit-exact" in out and "block-FP8" in out and "all" in out


def test_tour_reports_bad_shape_as_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["tour", "--k", "100", "--no-progress"])
    assert exc.value.code == 2
    assert "K = 100 is not a positive multiple of 128" in capsys.readouterr().err


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).strip().splitlines()
    assert len(block) == 2 and "workbench tour" in block[0]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert block[1] in ci


def test_environment_yml_installs_from_pyproject():
    env = (ROOT / "environment.yml").read_text()
    assert "-e .[" in env and "python=3.11" in env
    if sys.version_info >= (3, 11):
        import tomllib

        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        named = re.search(r"-e \.\[([^\]]*)\]", env).group(1).split(",")
        assert all(x in extras for x in named)
