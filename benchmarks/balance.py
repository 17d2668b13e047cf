"""Quantile Balancing vs DeepSeek's sign update on a synthetic skewed, drifting router.

    .venv/bin/python -m benchmarks.balance [--experts 896 --k 16 --tokens 16384 --steps 100] [--json out.json]

Router logits ``ℓ_t = base + drift_e(t) + 0.1·noise_t``: ``base`` = per-expert skew N(0, 1) + per-token N(0, 1) (a
fixed population of token representations), ``drift`` a slow per-expert random walk (σ 0.05 per step), fresh
noise (σ ``--noise``, default 0.1) each step. Methods: QB with the histogram (``--bins``), QB with the exact
sort-based quantile, and the sign update. Each step routes with the current bias (sigmoid scores, top-k of s + b) and records
MaxVio = max load / mean load − 1; then each method computes the bias for the next step from this step's batch
only (causal).
Reported: steps until MaxVio ≤ 5% (first time), MaxVio after ``steps`` steps, and the mean over the last 10.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.balance import (bias_bounds, max_violation, quantile_bias_exact, quantile_from_histogram,
                               required_bias_histogram, sign_update)
from k3jax.ops.routing import expert_counts


def run(method: str, n: int, k: int, m: int, steps: int, seed: int, gamma: float, bins: int, noise: float) -> dict:
    rng = np.random.default_rng(seed)
    base = (rng.normal(size=n)[None, :] + rng.normal(size=(m, n))).astype(np.float32)
    drift = np.zeros(n, np.float32)
    b = jnp.zeros(n, jnp.float32)
    bounds = bias_bounds(b)

    @jax.jit
    def step(logits, b, bounds):
        s = jax.nn.sigmoid(logits)
        idx = jax.lax.top_k(s + b, k)[1]
        counts = expert_counts(idx, n)
        if method == "quantile":
            hist = required_bias_histogram(s, b, k, bounds, bins)
            nb = quantile_from_histogram(hist, bounds, k)
        elif method == "quantile_exact":
            nb = quantile_bias_exact(s, b, k)
        else:
            nb = sign_update(b, counts, gamma)
        return max_violation(counts), nb, bias_bounds(nb)

    vio = []
    t0 = time.perf_counter()
    for _ in range(steps):
        drift += 0.05 * rng.normal(size=n).astype(np.float32)
        logits = jnp.asarray(base + drift + noise * rng.normal(size=(m, n)).astype(np.float32))
        v, b, bounds = step(logits, b, bounds)
        vio.append(float(v))
    first = next((i + 1 for i, v in enumerate(vio) if v <= 0.05), None)
    return {"method": method, "steps_to_maxvio_5pct": first, "maxvio_final": vio[-1],
            "maxvio_last10_mean": float(np.mean(vio[-10:])), "maxvio": vio, "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=896)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--gamma", type=float, default=1e-3)
    ap.add_argument("--bins", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise", type=float, default=0.1, help="fresh per-step logit noise (σ)")
    ap.add_argument("--methods", nargs="+", default=["quantile", "quantile_exact", "sign"],
                    choices=["quantile", "quantile_exact", "sign"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    res = {"benchmark": "balance", "machine": platform.machine(), "jax": jax.__version__,
           "backend": jax.default_backend(),
           "setup": {"experts": a.experts, "k": a.k, "tokens_per_step": a.tokens, "steps": a.steps,
                     "sign_gamma": a.gamma, "bins": a.bins},
           "runs": [run(m, a.experts, a.k, a.tokens, a.steps, a.seed, a.gamma, a.bins, a.noise)
                    for m in a.methods]}
    for r in res["runs"]:
        print(f"{r['method']:>8}: MaxVio ≤ 5% after {r['steps_to_maxvio_5pct']} steps; after {a.steps} steps "
              f"{r['maxvio_final']:.3f} (last-10 mean {r['maxvio_last10_mean']:.3f}); {r['seconds']:.1f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
