"""Rematerialization by name (k3jax.nn.remat): every policy gives ``none``'s loss and gradients, each keeps what it
says for the backward (residuals listed by ``jax.ad_checkpoint.saved_residuals``), bad names are named errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import K3Config
from k3jax.config import ConfigError
from k3jax.nn.model import K3ForCausalLM
from k3jax.nn.remat import REMAT_NAMES, remat_policy, saved_residuals
from k3jax.train.loop import TrainConfig

B, T = 2, 32


def small_config(**kw) -> K3Config:
    """The test preset — KDA with a dense FFN (layer 0, sealing block 0), KDA + MoE, MLA + MoE (sealing block 1,
    left partial) — AttnRes blocks of 2."""
    return K3Config.from_preset("test").replace(**kw)


def model_and_loss(cfg: K3Config):
    """The model's graph and params (pseudo-queries and all weights jittered, so no AttnRes read is a uniform
    average) and ``loss(params, remat)``: the mean log-probability of token 0 over a fixed batch."""
    m = K3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    graph, params, rest = nnx.split(m, nnx.Param, ...)
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda p: jnp.asarray(np.asarray(p) + 0.05 * rng.standard_normal(p.shape), p.dtype), params)
    ids = jax.random.randint(jax.random.key(2), (B, T), 0, cfg.vocab_size)

    def loss(params, remat):
        out = nnx.merge(graph, params, rest)(ids, remat=remat)
        return jnp.mean(jax.nn.log_softmax(out.logits)[..., 0])

    return params, loss


@pytest.fixture(scope="module")
def test_model():
    return model_and_loss(small_config())


def grads(loss, params, name):
    """Loss and gradients under policy ``name``, compiled without XLA's backend optimizations (half the compile
    time; the policies differ in what the program keeps, which XLA's passes do not change)."""
    f = jax.jit(jax.value_and_grad(lambda p: loss(p, name)))
    return f.lower(params).compile({"xla_backend_optimization_level": 0})(params)


def test_every_policy_gives_the_gradients_of_none(test_model):
    params, loss = test_model
    want_v, want_g = grads(loss, params, "none")
    want = [np.asarray(g) for g in jax.tree.leaves(want_g)]
    assert max(float(np.max(np.abs(g))) for g in want) > 1e-3            # gradients that can differ
    for name in REMAT_NAMES[1:]:
        v, g = grads(loss, params, name)
        assert float(v) == pytest.approx(float(want_v), abs=1e-6), name
        err = max(float(np.max(np.abs(np.asarray(a) - b))) for a, b in zip(jax.tree.leaves(g), want))
        assert err <= 1e-6, (name, err)


def residual_bytes(loss, params, name) -> int:
    """Bytes the backward keeps: the residuals JAX lists for ``loss``'s VJP, excluding the parameters."""
    return sum(n for _, n in saved_residuals(lambda p: loss(p, name), params))


def test_policies_keep_less_in_order_and_attnres_keeps_what_a_plain_residual_keeps(test_model):
    """:func:`small_config`: ``attnres`` drops each read's stacked fp32 candidates,
    ``minimal`` keeps the matmul outputs only, ``full`` the layer inputs only (``offload``'s named activations
    live in host memory: not listed). Against the same model with plain residuals (no AttnRes), ``attnres`` keeps
    at most the sealed blocks more (each ``[B, T, hidden]`` fp32): each read keeps the partial sum where a plain
    layer keeps its norm's input."""
    params, loss = test_model
    kept = {name: residual_bytes(loss, params, name) for name in REMAT_NAMES}
    assert kept["none"] > kept["attnres"] > kept["minimal"] > kept["full"], kept
    assert kept["offload"] <= kept["minimal"], kept
    cfg = small_config()
    plain_params, plain_loss = model_and_loss(small_config(attn_res_block_size=None))
    plain = residual_bytes(plain_loss, plain_params, "none")
    blocks = -(-cfg.num_hidden_layers // cfg.attn_res_block_size)
    assert kept["attnres"] <= plain + blocks * B * T * cfg.hidden_size * 4, (plain, kept["attnres"])


def test_bad_names_are_named_errors():
    assert remat_policy(None).name == "none" and remat_policy("full").layer is not None
    with pytest.raises(ValueError, match="remat: expected one of none, attnres, minimal, offload, full"):
        remat_policy("sometimes")
    with pytest.raises(ConfigError, match="remat"):
        TrainConfig.load(None, ["remat=everything"])
    assert TrainConfig.load(None, ["remat=attnres"]).remat == "attnres"
