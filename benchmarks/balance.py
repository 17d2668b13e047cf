"""Quantile Balancing vs DeepSeek's sign update on a synthetic skewed, drifting router.

    .venv/bin/python -m benchmarks.balance [--experts 896 --k 16 --tokens 16384 --steps 100] [--json out.json]

Router logits ``ℓ_t = base + drift_e(t) + noise_t``: ``base`` = per-expert skew N(0, 1) + per-token N(0, 1) (a
fixed population of token representations), ``drift`` a per-expert random walk (σ ``drift`` per step) and fresh
per-step noise (σ ``noise``). Scenarios: ``stationary`` (0, 0), ``drift`` (0.005, 0.02) and ``fast`` (0.05, 0.1).
Methods: ``quantile`` (k3jax's QB: two-level 1000-bin histograms, ``--passes`` fixed-point passes),
``quantile_coarse`` (one pass, one 1000-bin histogram, linear inside the bin: the literal spec), ``quantile_exact``
(sort-based, same passes; the best any causal bias can do, run for ``--exact-steps``) and ``sign``
(b += γ·sign(mean − load)). Each step routes with the current bias (sigmoid scores, top-k of s + b) and records
MaxVio = max load / mean load − 1; then each method computes the bias for the next step from this step's batch
only (causal). Step 1 routes with b = 0.
Reported: the first step with MaxVio ≤ 5%, MaxVio at the last step, and the mean over the last 10.
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

from k3jax.ops.balance import (bias_bounds, max_violation, quantile_balance_update, quantile_bias_exact,
                               quantile_from_histogram, required_bias_histogram, sign_update)

SCENARIOS = {"stationary": (0.0, 0.0), "drift": (0.005, 0.02), "fast": (0.05, 0.1)}
from k3jax.ops.routing import expert_counts


def run(method: str, n: int, k: int, m: int, steps: int, seed: int, gamma: float, bins: int, drift_sigma: float,
        noise: float, passes: int) -> dict:
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
            nb = quantile_balance_update(s, b, k, bins, passes)
        elif method == "quantile_coarse":
            nb = quantile_from_histogram(required_bias_histogram(s, b, k, bounds, bins), bounds, k)
        elif method == "quantile_exact":
            nb = quantile_bias_exact(s, b, k, passes=passes)
        else:
            nb = sign_update(b, counts, gamma)
        return max_violation(counts), nb, bias_bounds(nb)

    vio = []
    t0 = time.perf_counter()
    for _ in range(steps):
        drift += drift_sigma * rng.normal(size=n).astype(np.float32)
        logits = jnp.asarray(base + drift + noise * rng.normal(size=(m, n)).astype(np.float32))
        v, b, bounds = step(logits, b, bounds)
        vio.append(float(v))
    first = next((i + 1 for i, v in enumerate(vio) if v <= 0.05), None)
    return {"method": method, "passes": passes if method in ("quantile", "quantile_exact") else 1, "steps_to_maxvio_5pct": first, "maxvio_final": vio[-1],
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
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--exact-steps", type=int, default=10, help="steps for the (slow, sort-based) exact reference")
    ap.add_argument("--methods", nargs="+", default=["quantile", "quantile_coarse", "quantile_exact", "sign"],
                    choices=["quantile", "quantile_coarse", "quantile_exact", "sign"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    res = {"benchmark": "balance", "machine": platform.machine(), "jax": jax.__version__,
           "backend": jax.default_backend(),
           "setup": {"experts": a.experts, "k": a.k, "tokens_per_step": a.tokens, "steps": a.steps,
                     "sign_gamma": a.gamma, "bins": a.bins, "passes": a.passes,
                     "scenarios": {k: {"drift_sigma": SCENARIOS[k][0], "noise_sigma": SCENARIOS[k][1]}
                                   for k in a.scenarios}},
           "runs": []}
    for sc in a.scenarios:
        for m in a.methods:
            steps = min(a.steps, a.exact_steps) if m == "quantile_exact" else a.steps
            r = run(m, a.experts, a.k, a.tokens, steps, a.seed, a.gamma, a.bins, *SCENARIOS[sc], a.passes)
            r["scenario"] = sc
            res["runs"].append(r)
            print(f"{sc:>10} {r['method']:>15}: first MaxVio ≤ 5% at step {r['steps_to_maxvio_5pct']}; step {steps} "
                  f"{r['maxvio_final']:.3f} (last-10 mean {r['maxvio_last10_mean']:.3f}); {r['seconds']:.1f} s",
                  flush=True)
            if a.json:
                Path(a.json).write_text(json.dumps(res, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
