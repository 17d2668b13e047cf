import os
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the numpy reference and fixture writers live beside the tests


@pytest.fixture
def x64():
    """Run a test with 64-bit JAX (reference comparisons at float64 precision), restoring the setting after."""
    prev = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", prev)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def pytest_configure(config):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
