"""The machine's roofline, measured in the same process as a benchmark: jitted GEMM FLOP/s and memory bandwidth.

    .venv/bin/python -m benchmarks.roofline [--json out.json]

fp32 GEMM FLOP/s of a jitted n×n @ n×n at full fp32 precision (``Precision.HIGHEST``, as the KDA kernels use; no
TF32), n = 2048 on CPU and 8192 on an accelerator — on one device, and, where the host is split into several CPU
devices (``benchmarks.run`` does that, see ``k3jax.parallel.heads``), also with its rows split over all of them;
``gemm_flops_fp32`` is the better of the two, so that no contender is measured against a slower GEMM than the
machine can run — and the bytes/s of a jitted ``x + 1`` over 256 MiB of fp32
(read + write), best of 5 after warm-up, with the machine, backend, device and versions.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax.parallel.heads import host_cores


def _best(f, *args, reps: int = 5) -> float:
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t)
    return best


def gemm_runs(n: int | None = None, dtype=jnp.float32) -> tuple[dict[str, Callable[[], object]], float]:
    """The roofline's GEMM, a jitted ``n×n @ n×n`` at ``Precision.HIGHEST`` (n = 2048 on CPU, 8192 elsewhere), as
    zero-argument calls that block until done: ``gemm`` on one device and, with several devices,
    ``gemm_over_devices`` with the left factor's rows split over as many as divide n; ``({name: call}, FLOPs)``."""
    n = n or (2048 if jax.default_backend() == "cpu" else 8192)
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    mm = jax.jit(lambda x, y: jnp.matmul(x, y, precision=jax.lax.Precision.HIGHEST))
    runs = {"gemm": lambda: jax.block_until_ready(mm(a, a))}
    d = max(c for c in range(1, jax.device_count() + 1) if n % c == 0)
    if d > 1:
        mesh = Mesh(np.array(jax.devices()[:d]), ("rows",))
        x, y = jax.device_put(a, NamedSharding(mesh, P("rows", None))), jax.device_put(a, NamedSharding(mesh, P()))
        runs["gemm_over_devices"] = lambda: jax.block_until_ready(mm(x, y))
    return runs, 2.0 * n**3


def gemm_flops(n: int | None = None, dtype=jnp.float32) -> float:
    """FLOP/s of the one-device GEMM of :func:`gemm_runs` (best of 5)."""
    runs, flops = gemm_runs(n, dtype)
    return flops / _best(runs["gemm"])


def gemm_flops_over_devices(n: int | None = None, dtype=jnp.float32) -> float | None:
    """FLOP/s of the GEMM with its rows split over the devices (best of 5); None on one device."""
    runs, flops = gemm_runs(n, dtype)
    return flops / _best(runs["gemm_over_devices"]) if "gemm_over_devices" in runs else None


def memory_bandwidth(mib: int = 256) -> float:
    """Bytes/s of a jitted ``y = x + 1`` over ``mib`` MiB of fp32 (read + write counted)."""
    x = jnp.zeros((mib * 2**20 // 4,), jnp.float32)
    return 2 * x.nbytes / _best(jax.jit(lambda v: v + 1.0), x)


_MEASURED: dict | None = None


def machine(fresh: bool = False) -> dict:
    """Machine, backend and versions, plus the roofline figures — measured on the first call in a process and
    reused after (so every benchmark of one ``benchmarks.run`` shares one roofline); ``fresh`` measures again."""
    global _MEASURED
    if _MEASURED is None or fresh:
        _MEASURED = _measure()
    return dict(_MEASURED)


def _measure() -> dict:
    one, over = gemm_flops(), gemm_flops_over_devices()
    return {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "jax": jax.__version__, "backend": jax.default_backend(),
            "device": str(jax.devices()[0].device_kind), "devices": jax.device_count(),
            "cpus": host_cores(),
            "gemm_flops_fp32": max(one, over or 0.0), "gemm_flops_fp32_one_device": one,
            "gemm_flops_fp32_over_devices": over, "memory_bytes_per_s": memory_bandwidth()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    res = {"benchmark": "roofline", **machine()}
    print(f"{res['device']} ({res['backend']}): fp32 GEMM {res['gemm_flops_fp32'] / 1e9:,.1f} GFLOP/s, memory "
          f"{res['memory_bytes_per_s'] / 1e9:,.1f} GB/s", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
