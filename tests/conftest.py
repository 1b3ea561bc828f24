"""Shared test fixtures. The hardware question is answered once, in workbench.hardware."""
import zlib

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """Fresh random data for every test, reproducible from the test's name (crc32: Python's str hash is salted per
    process, so it gave every run other data)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
