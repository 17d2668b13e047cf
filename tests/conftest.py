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


# XLA:CPU compiles the tests' programs with LLVM's cheap pipeline: at test sizes compilation is most of the suite's
# time, and the backend optimisation level changes code generation, not the operations' semantics (every comparison
# in the suite has a tolerance or compares two programs compiled alike). K3JAX_TEST_XLA_OPT=1 keeps XLA's default.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# 8 simulated devices share 2 cores with the other pytest worker: one device's thread can reach a collective well
# after the others, past XLA:CPU's default 40 s (the processes also get the thread pool that keeps their collectives
# from deadlocking: k3jax.parallel.host, NPROC). A rendezvous stuck for 300 s is a hang: the process aborts with
# XLA's message rather than running into the test's own time-out.
COLLECTIVE_XLA_FLAGS = "--xla_cpu_collective_call_terminate_timeout_seconds=300"


def xla_flags_for_tests(extra: str = "") -> str:
    """XLA_FLAGS for this test session and the processes it starts: the environment's, the fast-compile flags
    (unless ``K3JAX_TEST_XLA_OPT=1``) and ``extra``."""
    flags = [os.environ.get("XLA_FLAGS", "")]
    if os.environ.get("K3JAX_TEST_XLA_OPT") != "1" and "xla_backend_optimization_level" not in flags[0]:
        flags.append(TEST_XLA_FLAGS)
    if "collective_call_terminate_timeout" not in flags[0]:
        flags.append(COLLECTIVE_XLA_FLAGS)
    return " ".join(f for f in [*flags, extra] if f)


def pytest_configure(config):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["XLA_FLAGS"] = xla_flags_for_tests()          # before any test starts a JAX backend (read at its start)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False     # xdist keeps the order of pytest_collection_modifyitems (below)
    # One persistent XLA compilation cache for the session, here and in the subprocesses the tests start (they
    # inherit the environment): many tests compile the same training step or forward again, in a new process or
    # under a new jit, and on CPU that compile is most of their time. Keys are the HLO and the compile options, so
    # a hit is the same executable; K3JAX_TEST_JAX_CACHE=DIR keeps one across runs, K3JAX_TEST_JAX_CACHE=off skips.
    # Compiles from 0.1 s on are kept: a model's eager random initialisation compiles ~20 kernels of 0.3–0.8 s
    # each, again in every process that builds one (the training subprocesses, both workers).
    cache = os.environ.get("K3JAX_TEST_JAX_CACHE")
    if cache == "off":
        return
    if not cache:
        cache = tempfile.mkdtemp(prefix="k3jax-test-jax-cache-")
        _CACHE_MADE.append(cache)
        os.environ["K3JAX_TEST_JAX_CACHE"] = cache     # pytest-xdist workers start after this: they share it
    os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.1"
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)


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


def device_env(devices: int) -> dict:
    """The environment of a subprocess with ``devices`` simulated CPU devices: the tests' XLA flags, the device
    count and the client thread pool their collectives need (``NPROC``, :mod:`k3jax.parallel.host`)."""
    from k3jax.parallel.host import host_device_flag

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags_for_tests()}
    host_device_flag(devices, env)
    return env


def run_device_check(script: Path, *args: str, devices: int = 8, timeout: int = 900) -> dict:
    """Run a check script beside the tests in a subprocess with ``devices`` simulated CPU devices (the flag must be
    set before JAX starts, so not in this process) and return the JSON of its last stdout line."""
    import json
    import subprocess

    res = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout,
                         env=device_env(devices))
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


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


def small_train_config(out, **kw):
    """The small training run (8 steps of 2×32 tokens) of test_train's runs and test_balance's step: the 3-layer
    test preset (KDA + dense MLP, KDA + routed MoE, MLA + routed MoE; AttnRes blocks of 2 cross a block boundary),
    as the EP training checks train it.

    Keep them the same: the jitted step's HLO depends on the model, the optimizer (its schedule: ``steps``), the
    balancing settings and the batch shape, not on the output directory, the save/eval cadence or the initializer
    (test_train's NaN test), so these tests lower one step and one eval step, compiled once per session and then
    read from the persistent compilation cache (they run on one worker, in the xdist group ``train_step``).
    ``model_overrides`` in ``kw`` apply to the preset."""
    from k3jax.train.loop import TrainConfig

    base = {"model": "test", "model_overrides": {},
            "out": str(out), "steps": 8, "batch_size": 2, "seq_len": 32, "corpus_bytes": 200_000,
            "eval_every": 4, "eval_batches": 1, "save_every": 3, "progress": False, "async_save": False}
    base["model_overrides"].update(kw.pop("model_overrides", {}))
    base.update(kw)
    return TrainConfig.from_dict(base)


# Files whose module fixtures are expensive (checkpoints written, subprocess runs, reference models, a server),
# or whose tests compile the same kernels (test_kda; test_layers' three routings of one MoE, test_moonep's jitted
# planner), stay on one xdist worker (``--dist loadgroup``); the tests of every other file are spread over the
# workers one by one. (test_ep groups only the two tests that share its 8-device training run, and "train_step" the
# tests that share one compiled training step: test_balance's and test_train's; see there)
_KEEP_TOGETHER = {"test_cache", "test_checkpoints", "test_infer", "test_kda", "test_layers", "test_loader",
                  "test_model", "test_moonep", "test_paged_cache", "test_prefix_cache", "test_serve", "test_fla_kda",
                  "test_speculative", "test_vision",
                  "test_transformers_kimi_linear"}

# The longest units of work (an xdist group, or one test) first, in this order (about that many seconds each on
# this 2-core machine, both workers busy); then every other test marked slow, then the rest, each in collection
# order. xdist hands the units out in this order (its own reordering, by test count, is turned off in
# pytest_configure) and a worker takes the next unit when it has 2 tests or fewer left, so both workers end on
# short tests at about the same time, not one of them on a long test started last.
_LONGEST_FIRST = [
    "pipeline",                                                            # 500 s: two 8-device subprocesses (float64 check; 3 trainings)
    "ep_train",                                                            # 300 s: 8-device training, 2 processes
    "context_parallel",                                                    # 180 s: 8 devices, one subprocess
    "tests/test_cli.py::test_demo_trains_and_beats_unigram",               # 150 s
    "test_speculative",                                                    # 140 s: two schedulers, one a draft's
    "test_kda",                                                            # 115 s
    "test_serve",                                                          # 120 s
    "test_infer",                                                          # 85 s
    "train_step",                                                          # 70 s: one compile, then cache reads
    "test_checkpoints",                                                    # 65 s
    "test_transformers_kimi_linear",                                       # 60 s
    "test_prefix_cache",                                                   # 65 s: one scheduler, verify on
    "tests/test_serve_concurrency.py::test_scrapes_during_preemption_hits_speculation_and_disconnects",   # 26 s
    "test_vision",                                                         # 50 s: a multimodal checkpoint
    "tests/test_scan.py::test_scanned_prefill_decode_verify_and_groups_equal_unrolled",   # 75 s
    "tests/test_scan.py::test_scanned_equals_unrolled_gradients",          # 75 s
    "tests/test_scan.py::test_engine_with_scanned_layers_decodes_like_unrolled",        # 50 s
    "test_model",                                                          # 35 s
    "test_cache",                                                          # 30 s
    "test_moonep",                                                         # 25 s: the hypothesis test most of it
    "tests/test_ep.py::test_expert_parallel_moe_equals_single_device",     # 24 s
    "test_paged_cache",                                                    # 20 s
]


def _unit(item) -> str:
    group = item.get_closest_marker("xdist_group")
    return group.args[0] if group is not None else item.nodeid


@pytest.hookimpl(trylast=True)        # after xdist's own hook (see the end)
def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.module.__name__.rsplit(".", 1)[-1]
        if name in _KEEP_TOGETHER:
            item.add_marker(pytest.mark.xdist_group(name))
    rank = {u: i for i, u in enumerate(_LONGEST_FIRST)}
    first: dict[str, tuple] = {}
    units = [_unit(item) for item in items]
    for i, (item, u) in enumerate(zip(items, units)):
        key = (rank[u],) if u in rank else (len(rank), item.get_closest_marker("slow") is None, i)
        first[u] = min(first.get(u, key), key)
    order = {id(item): (first[u], i) for i, (item, u) in enumerate(zip(items, units))}   # a unit stays in order
    items.sort(key=lambda item: order[id(item)])
    # --dist loadgroup puts tests with the same xdist_group on one worker by reading the group from the node id
    # ("…::test@group"), which xdist 3.8 appends by assigning ``item._nodeid``; pytest 9 keeps the id in
    # ``item._id``, so that assignment does nothing and every group was split over the workers (each worker
    # computing the group's module fixtures again). Append it where pytest 9 reads it, unless xdist did.
    if getattr(config.option, "loadgroup", False):
        from _pytest.nodeid import NodeId

        for item in items:
            group = item.get_closest_marker("xdist_group")
            if group is not None and "@" not in item.nodeid.rsplit("]", 1)[-1]:
                item._id = NodeId.parse(f"{item.nodeid}@{group.args[0]}")
