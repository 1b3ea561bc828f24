"""Shared test fixtures. The hardware question is answered once, in workbench.hardware."""
import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """Fresh random data for every test, reproducible from the test's name."""
    seed = abs(hash(request.node.nodeid)) % (2**32)
    return np.random.default_rng(seed)
