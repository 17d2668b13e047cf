"""KDA against fla-core 0.6.0's naive references (torch, CPU), loaded by file path (its package imports triton).

The registered chunked implementations meet fla's recurrence (document by document, with resets) in
``tests/test_kda.py``'s conformance test; here the token scan, the decode step and the default chunked kernel
against fla's chunked form."""

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fla_naive_module
from k3jax.ops.kda import kda_recurrent, kda_step
from k3jax.ops.kda_chunked import kda_chunked

pytestmark = pytest.mark.oracle
import torch  # noqa: E402  (a test dependency: make test installs it; missing, the file fails to import)


@pytest.fixture(scope="module")
def fla_naive():
    return fla_naive_module()


def inputs(seed, T, gate, init, B=2, H=3, K=32, V=24):
    r = np.random.default_rng(seed)
    norm = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
    q = norm(r.normal(size=(B, T, H, K))).astype(np.float32)
    k = norm(r.normal(size=(B, T, H, K))).astype(np.float32)
    v = r.normal(size=(B, T, H, V)).astype(np.float32)
    z = r.normal(size=(B, T, H, K)) * 2
    g = (-5.0 / (1 + np.exp(-z)) if gate == "lower_bound" else -np.exp(0.3) * np.logaddexp(0, z)).astype(np.float32)
    beta = (1 / (1 + np.exp(-r.normal(size=(B, T, H))))).astype(np.float32)
    s0 = r.normal(size=(B, H, K, V)).astype(np.float32) if init else None
    return q, k, v, g, beta, s0


def run_fla(fn, q, k, v, g, beta, s0, **kw):
    t = lambda x: None if x is None else torch.from_numpy(x)  # noqa: E731
    o, s = fn(t(q), t(k), t(v), t(g), t(beta), initial_state=t(s0), output_final_state=True, **kw)
    return o.numpy(), s.numpy()


def rel(a, b):
    return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("T", [1, 15, 64, 100])
@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
@pytest.mark.parametrize("init", [False, True])
def test_kda_vs_fla_naive_recurrent(fla_naive, T, gate, init):
    q, k, v, g, beta, s0 = inputs(T, T, gate, init)
    o_ref, s_ref = run_fla(fla_naive.naive_recurrent_kda, q, k, v, g, beta, s0)
    args = [jnp.asarray(x) for x in (q, k, v, g, beta)]
    s0j = None if s0 is None else jnp.asarray(s0)
    o, s = kda_recurrent(*args, initial_state=s0j, output_final_state=True)
    assert rel(o, o_ref) <= 1e-5
    assert rel(s, s_ref) <= 1e-5


def test_kda_step_vs_fla_naive_recurrent(fla_naive):
    q, k, v, g, beta, s0 = inputs(7, 1, "lower_bound", True)
    o_ref, s_ref = run_fla(fla_naive.naive_recurrent_kda, q, k, v, g, beta, s0)
    o, s = kda_step(*(jnp.asarray(x[:, 0]) for x in (q, k, v, g, beta)), jnp.asarray(s0))
    assert rel(o, o_ref[:, 0]) <= 1e-5 and rel(s, s_ref) <= 1e-5


def test_kda_chunked_vs_fla_naive_chunk(fla_naive):
    q, k, v, g, beta, s0 = inputs(3, 128, "lower_bound", True)
    o_ref, s_ref = run_fla(fla_naive.naive_chunk_kda, q, k, v, g, beta, s0, chunk_size=64)
    o, s = kda_chunked(*(jnp.asarray(x) for x in (q, k, v, g, beta)), initial_state=jnp.asarray(s0),
                       output_final_state=True, safe_gate=True)
    assert rel(o, o_ref) <= 1e-5 and rel(s, s_ref) <= 1e-5
