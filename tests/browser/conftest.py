"""Fixtures for the real-browser test: a private JupyterLab server on 127.0.0.1, stopped by its PID."""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from workbench import doctor

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def _require_browser() -> None:
    """Skip with the reason when Chromium, Playwright or JupyterLab is missing. Whether that is allowed is decided
    once, for the whole tier, in tests/tier_report.py: with browser in WORKBENCH_REQUIRE_TIERS the run stops first."""
    problems = doctor.tier_problems("browser")
    if problems:
        pytest.skip("browser test needs " + "; ".join(problems))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyter_lab(tmp_path):
    """(base_url, token, root_dir) of a JupyterLab serving tmp_path; the server is stopped afterwards."""
    _require_browser()
    port, token = _free_port(), secrets.token_hex(16)
    runtime = tmp_path / "runtime"
    root = tmp_path / "root"
    root.mkdir()
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(runtime), NUMBA_ENABLE_CUDASIM="1",
               NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS="0")
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           f"--ServerApp.token={token}", f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
           "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(tmp_path / "jupyterlab.log", "wb")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {server.returncode}: "
                                   f"{(tmp_path / 'jupyterlab.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("jupyter lab did not answer within 60 s")
            time.sleep(0.3)
        yield base, token, root
    finally:
        # SIGTERM to the server we started (its own session: the group id is its PID), which shuts its kernels down
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=10)
        log.close()


@pytest.fixture
def chromium():
    """(executable, launch args) for Playwright's chromium.launch."""
    return doctor.chromium_path(), CHROMIUM_ARGS


@pytest.fixture
def copy_notebook():
    def copy(name: str, root) -> str:
        here = os.path.dirname(os.path.abspath(__file__))
        shutil.copy(os.path.join(here, "..", "..", "notebooks", name), root / name)
        return name

    return copy
