"""The machine's roofline, measured in the same process as a benchmark: jitted GEMM FLOP/s and memory bandwidth."""

from __future__ import annotations

import platform
import time

import jax
import jax.numpy as jnp


def _best(f, *args, reps: int = 5) -> float:
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t)
    return best


def gemm_flops(n: int = 2048, dtype=jnp.float32) -> float:
    """FLOP/s of a jitted ``n×n @ n×n`` (best of 5)."""
    a = jnp.ones((n, n), dtype)
    return 2 * n**3 / _best(jax.jit(lambda x, y: x @ y), a, a)


def memory_bandwidth(mib: int = 256) -> float:
    """Bytes/s of a jitted ``y = x + 1`` over ``mib`` MiB of fp32 (read + write counted)."""
    x = jnp.zeros((mib * 2**20 // 4,), jnp.float32)
    return 2 * x.nbytes / _best(jax.jit(lambda v: v + 1.0), x)


def machine() -> dict:
    """Machine, backend and versions, plus the roofline figures."""
    return {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "jax": jax.__version__, "backend": jax.default_backend(),
            "device": str(jax.devices()[0].device_kind), "devices": jax.device_count(),
            "gemm_flops_fp32": gemm_flops(), "memory_bytes_per_s": memory_bandwidth()}
