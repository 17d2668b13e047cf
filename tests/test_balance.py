"""Quantile Balancing against its exact sort-based reference, its causality, and the integer psum over devices."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import jit_forward, small_train_config
from k3jax import K3ForCausalLM
from k3jax.ops.balance import (bias_bounds, max_violation, quantile_balance_update, quantile_bias_exact,
                               quantile_from_histogram, required_bias, required_bias_histogram, sign_update)
from k3jax.ops.routing import expert_counts, router_topk


def skewed_scores(rng, N=4096, n=64, skew=2.0):
    logits = rng.normal(size=(N, n)) + np.linspace(skew, -skew, n)[None, :]
    return jax.nn.sigmoid(jnp.asarray(logits, jnp.float32))


def test_histogram_quantile_within_one_bin_of_exact(rng):
    s = skewed_scores(rng)
    b = jnp.asarray(rng.normal(size=64) * 0.2, jnp.float32)
    bounds = bias_bounds(b)
    bins = 1000
    hist = required_bias_histogram(s, b, 8, bounds, bins)
    assert hist.dtype == jnp.int32 and int(hist.sum()) == 4096 * 64
    width = float(bounds[1] - bounds[0]) / bins
    exact = quantile_bias_exact(s, b, 8, center=False)
    approx = quantile_from_histogram(hist, bounds, 8, center=False)
    assert float(jnp.max(jnp.abs(approx - exact))) <= width
    # every required bias lies inside the persistent bounds (sigmoid scores in (0, 1))
    r = required_bias(s, b, 8)
    assert float(r.min()) >= float(bounds[0]) and float(r.max()) <= float(bounds[1])


@pytest.mark.parametrize("passes", [1, 3])
def test_two_level_histogram_quantile_within_a_fine_bin_of_exact(rng, passes):
    """Coarse bins over [min b − 1, max b + 1], then 1000 fine bins inside the crossing bin: the k/n quantile to
    (coarse width)/1000 of the sort-based one, pass by pass."""
    s = skewed_scores(rng)
    b = jnp.asarray(rng.normal(size=64) * 0.2, jnp.float32)
    exact = quantile_bias_exact(s, b, 8, center=False, passes=passes)
    approx = quantile_balance_update(s, b, 8, bins=1000, passes=passes, center=False)
    prev = quantile_bias_exact(s, b, 8, center=False, passes=passes - 1) if passes > 1 else b
    fine = float(jnp.diff(bias_bounds(prev))[0]) / 1000 ** 2
    # each pass reads to one fine bin; a pass's error moves the next pass's α by at most as much (Lipschitz 1)
    assert float(jnp.max(jnp.abs(approx - exact))) <= passes * fine
    coarse_only = quantile_from_histogram(required_bias_histogram(s, b, 8, bias_bounds(b)), bias_bounds(b), 8,
                                          center=False)
    if passes == 1:        # the fine read is what buys the accuracy: coarse-only misses by up to a coarse bin
        assert float(jnp.max(jnp.abs(coarse_only - exact))) > 10 * float(jnp.max(jnp.abs(approx - exact)))


def test_fixed_point_passes_balance_the_batch(rng):
    """Passes re-solve with α from the new bias; on the same scores the load converges to k/n per expert."""
    s = skewed_scores(rng, N=8192, skew=3.0)
    logits = jnp.log(s / (1 - s))
    vio = []
    for passes in (1, 2, 4):
        b = quantile_balance_update(s, jnp.zeros(64), 8, passes=passes)
        vio.append(float(max_violation(expert_counts(router_topk(logits, b, 8, renormalize=False)[1], 64))))
    assert vio[0] > vio[1] > vio[2] and vio[2] < 0.05, vio


def test_one_update_balances_a_skewed_router(rng):
    """Selecting with the new bias on the same scores moves every expert towards k/n of the tokens."""
    s = skewed_scores(rng, skew=3.0)
    b0 = jnp.zeros(64)
    c0 = expert_counts(router_topk(jnp.log(s / (1 - s)), b0, 8, renormalize=False)[1], 64)
    b1 = quantile_bias_exact(s, b0, 8)
    c1 = expert_counts(router_topk(jnp.log(s / (1 - s)), b1, 8, renormalize=False)[1], 64)
    assert float(max_violation(c0)) > 1.0
    assert float(max_violation(c1)) < float(max_violation(c0)) / 10     # one closed-form update: >10× better
    b = b1
    for _ in range(3):
        b = quantile_bias_exact(s, b, 8)
    c4 = expert_counts(router_topk(jnp.log(s / (1 - s)), b, 8, renormalize=False)[1], 64)
    assert float(max_violation(c4)) < 0.1
    # DeepSeek's sign update moves by γ only
    np.testing.assert_allclose(jnp.abs(sign_update(b0, c0, 1e-3)), 1e-3)


@pytest.mark.xdist_group("train_step")       # the step test_train's runs compile: one compile (see conftest)
def test_bias_is_causal_and_frozen_at_eval(tmp_path):
    """Step t selects with the bias computed from step t−1; eval forward leaves the bias alone."""
    from k3jax.train.loop import make_step, model_config
    from k3jax.train.optim import make_optimizer, muon_dims_tree

    # The step `train` builds for test_train's small run (same config, state prepared as `train` does: committed to
    # the device), so that its compile is shared; the batch is one of that run's shape [batch_size, seq_len].
    c = small_train_config(tmp_path)
    cfg = model_config(c)
    model = K3ForCausalLM(cfg, rngs=nnx.Rngs(c.seed))
    g, p_st, r_st = nnx.split(model, nnx.Param, ...)
    params, rest = nnx.to_pure_dict(p_st), nnx.to_pure_dict(r_st)
    opt = make_optimizer(muon_dims_tree(p_st), c.steps, c.optim)
    params, rest, opt_state = jax.device_put((params, rest, opt.init(params)), jax.tree.leaves(params)[0].sharding)
    step, eval_step = make_step(g, p_st, r_st, opt, c, cfg)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 512, (c.batch_size, c.seq_len)), jnp.int32)
    batch = {"input_ids": ids, "targets": ids, "segment_ids": jnp.ones_like(ids),
             "loss_mask": jnp.ones(ids.shape, jnp.float32)}
    b_before = np.asarray(rest["model"]["layers"][1]["block_sparse_moe"]["e_score_correction_bias"])
    p1, rest1, o1, m1 = step(params, rest, opt_state, batch)
    b_after = np.asarray(rest1["model"]["layers"][1]["block_sparse_moe"]["e_score_correction_bias"])
    assert not np.allclose(b_before, b_after)                         # an update was computed from this batch …
    # … but this step's routing used the old bias: counts equal a forward with the old bias
    m_old = nnx.merge(g, p_st, r_st)
    np.testing.assert_array_equal(m1["counts"],
                                  jit_forward(m_old, ids, segment_ids=batch["segment_ids"]).expert_counts)
    # eval reads the bias without changing it
    eval_step(p1, rest1, batch)
    np.testing.assert_array_equal(rest1["model"]["layers"][1]["block_sparse_moe"]["e_score_correction_bias"],
                                  b_after)


@pytest.mark.slow
def test_integer_psum_over_8_devices_equals_single_device():
    code = textwrap.dedent("""
        import os
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import PartitionSpec as P
        from k3jax.ops.balance import required_bias_histogram, bias_bounds, quantile_balance_update
        rng = np.random.default_rng(0)
        s = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(8 * 256, 32)), jnp.float32))
        b = jnp.asarray(rng.normal(size=32) * 0.3, jnp.float32)
        bounds = bias_bounds(b)
        mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
        def local(s_shard):
            h = required_bias_histogram(s_shard, b, 4, bounds, 500)
            return jax.lax.psum(h, "data")
        # every side jitted, as inside the training step (an eager shard_map compiles its body op by op)
        f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P()))
        h8 = f(jax.device_put(s, jax.NamedSharding(mesh, P("data"))))
        h1 = jax.jit(lambda s: required_bias_histogram(s, b, 4, bounds, 500))(s)
        assert h8.dtype == jnp.int32
        print("equal", bool(jnp.array_equal(h8, h1)), int(h1.sum()))
        # the whole two-level, multi-pass update with its histograms psum'd equals the single-device one
        upd = lambda s_shard: quantile_balance_update(s_shard, b, 4, 500, 2, reduce=lambda h: jax.lax.psum(h, "data"))
        b8 = jax.jit(jax.shard_map(upd, mesh=mesh, in_specs=P("data"), out_specs=P()))(
            jax.device_put(s, jax.NamedSharding(mesh, P("data"))))
        b1 = jax.jit(lambda s: quantile_balance_update(s, b, 4, 500, 2))(s)
        print("bias equal", bool(jnp.array_equal(b8, b1)))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "equal True" in res.stdout and "bias equal True" in res.stdout
