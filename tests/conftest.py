"""Shared test fixtures. The hardware question is answered once, in workbench.hardware."""
import zlib

import numpy as np
import pytest
# per-tier skip summary and WORKBENCH_REQUIRE_TIERS (hooks defined in tests/tier_report.py)
from tier_report import pytest_collection_modifyitems, pytest_terminal_summary  # noqa: F401


@pytest.fixture
def rng(request):
    """Fresh random data for every test, reproducible from the test's name (crc32: Python's str hash is salted per
    process, so it gave every run other data)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


# Hypothesis: derandomized and bounded by default (CI's two cores), a longer random search on request
# (WORKBENCH_FUZZ=long bash tests/run_all.sh, or pytest with that variable set).
try:
    import os

    from hypothesis import HealthCheck, settings

    settings.register_profile("ci", derandomize=True, deadline=None, max_examples=60,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    settings.register_profile("long", derandomize=False, deadline=None, max_examples=5000,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    settings.load_profile("long" if os.environ.get("WORKBENCH_FUZZ") == "long" else "ci")
except ImportError:  # hypothesis is a test extra; tiers that do not use it still run without it
    pass
