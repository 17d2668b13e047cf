import os
import shutil
import sys
import tempfile
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


_CACHE_MADE: list[str] = []


def pytest_configure(config):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # One persistent XLA compilation cache for the session, here and in the subprocesses the tests start (they
    # inherit the environment): many tests compile the same training step or forward again, in a new process or
    # under a new jit, and on CPU that compile is most of their time. Keys are the HLO and the compile options, so
    # a hit is the same executable; K3JAX_TEST_JAX_CACHE=DIR keeps one across runs, K3JAX_TEST_JAX_CACHE=off skips.
    cache = os.environ.get("K3JAX_TEST_JAX_CACHE")
    if cache == "off":
        return
    if not cache:
        cache = tempfile.mkdtemp(prefix="k3jax-test-jax-cache-")
        _CACHE_MADE.append(cache)
        os.environ["K3JAX_TEST_JAX_CACHE"] = cache     # pytest-xdist workers start after this: they share it
    os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "1"
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def pytest_unconfigure(config):
    for d in _CACHE_MADE:
        shutil.rmtree(d, ignore_errors=True)


def fla_naive_module():
    """fla-core 0.6.0's naive KDA references (torch), loaded by file path (fla's package imports triton). fla and
    torch are test dependencies (``pip install -e '.[test]'``, what ``make test`` installs): missing, it fails."""
    import importlib.util

    spec = importlib.util.find_spec("fla")
    if spec is None or importlib.util.find_spec("torch") is None:
        pytest.fail("the oracle extra (fla-core==0.6.0, torch) is not installed: pip install -e '.[test]'")
    path = Path(spec.submodule_search_locations[0]) / "ops" / "kda" / "naive.py"
    mod_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


_FORWARDS: dict = {}


def jit_forward(model, input_ids, **kw):
    """``model(input_ids, **kw)`` through one jitted function per model config (shared by every test and module
    in the process): an eager forward compiles each primitive on its own, a jitted one compiles once per shape.
    ``kw`` holds arrays (``segment_ids``, ``cache``, ``n_new``) or hashable settings (``kda_kernel``, …)."""
    import json

    from flax import nnx

    graphdef, state = nnx.split(model)
    key = json.dumps(model.config.to_dict(), sort_keys=True, default=str)
    arrays = {k: v for k, v in kw.items() if v is None or hasattr(v, "shape") or k == "cache"}
    static = tuple(sorted((k, v) for k, v in kw.items() if k not in arrays))
    fn = _FORWARDS.get((key, static))
    if fn is None:
        fn = _FORWARDS[(key, static)] = jax.jit(
            lambda st, ids, arr: nnx.merge(graphdef, st)(ids, **arr, **dict(static)))
    return fn(state, input_ids, arrays)


# Files whose module fixtures are expensive (checkpoints written, subprocess runs, reference models) stay on one
# xdist worker (``--dist loadgroup``); the tests of every other file are spread over the workers one by one.
# (test_ep groups only the two tests that share its 8-device training run; see there)
_KEEP_TOGETHER = {"test_cache", "test_checkpoints", "test_infer", "test_loader", "test_model",
                  "test_fla_kda", "test_transformers_kimi_linear"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.module.__name__.rsplit(".", 1)[-1]
        if name in _KEEP_TOGETHER:
            item.add_marker(pytest.mark.xdist_group(name))
