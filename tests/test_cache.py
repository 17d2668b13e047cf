"""Typed caches and the one forward: pytrees with named fields, slot-independent reads and writes, the same
layer math with and without a cache, parameter axes metadata, and routing statistics kept out of inference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import jit_forward
from k3jax import K3Config, K3ForCausalLM
from k3jax.nn.cache import Cache, KDACache, MLACache, init_cache
from k3jax.parallel.rules import LOGICAL_TO_MESH, axes_tree, variable_axes


@pytest.fixture(scope="module")
def cfg():
    return K3Config.from_preset("test")


@pytest.fixture(scope="module")
def model(cfg):
    return K3ForCausalLM(cfg, rngs=nnx.Rngs(4))


def filled(cfg, batch=3, length=16, seed=0) -> Cache:
    """A cache whose every leaf holds distinct random values (so a wrong row shows)."""
    c = init_cache(cfg, batch, length)
    leaves, tree = jax.tree.flatten(c)
    rng = np.random.default_rng(seed)          # drawn on the host: no random-kernel compile per leaf shape
    new = [jnp.asarray(rng.normal(size=x.shape), x.dtype) if x.dtype != jnp.int32
           else jnp.arange(x.shape[0], dtype=jnp.int32) + 5 for x in leaves]
    return jax.tree.unflatten(tree, new)


def test_init_cache_types_shapes_and_pytree(cfg):
    c = init_cache(cfg, 2, 32)
    assert isinstance(c, Cache) and len(c.layers) == cfg.num_hidden_layers
    lac = cfg.linear_attn_config
    for kind, lc in zip(cfg.layer_types, c.layers):
        if kind == "kda":
            assert isinstance(lc, KDACache)
            assert lc.state.shape == (2, lac.num_heads, lac.head_dim, lac.head_dim) and lc.state.dtype == jnp.float32
            assert lc.conv_q.shape == (2, lac.short_conv_kernel_size - 1, lac.num_heads * lac.head_dim)
        else:
            assert isinstance(lc, MLACache)
            assert lc.c_kv.shape == (2, 32, cfg.kv_lora_rank) and lc.k_r.shape == (2, 32, cfg.qk_rope_head_dim)
    assert c.lengths.shape == (2,) and c.capacity == 32 and c.batch == 2
    # a pytree with named fields: it crosses jit and comes back with the same structure
    out = jax.jit(lambda x: jax.tree.map(lambda a: a + 1, x))(c)
    assert isinstance(out, Cache) and isinstance(out.layers[0], type(c.layers[0]))
    assert jax.tree.structure(out) == jax.tree.structure(c)


def test_slot_operations_touch_only_their_rows(cfg):
    c = filled(cfg, batch=4)
    other = filled(cfg, batch=2, seed=1)

    def rows(x, idx):
        return [np.asarray(a)[idx] for a in jax.tree.leaves(x)]

    w = c.write_slots(jnp.asarray([2, 0]), other)
    for a, b, o in zip(jax.tree.leaves(w), jax.tree.leaves(c), jax.tree.leaves(other)):
        a, b, o = np.asarray(a), np.asarray(b), np.asarray(o)
        np.testing.assert_array_equal(a[[1, 3]], b[[1, 3]])          # untouched slots: bit for bit
        np.testing.assert_array_equal(a[2], o[0])
        np.testing.assert_array_equal(a[0], o[1])
    r = c.reset_slots(1)
    for a, b in zip(jax.tree.leaves(r), jax.tree.leaves(c)):
        a, b = np.asarray(a), np.asarray(b)
        assert not a[1].any()
        np.testing.assert_array_equal(a[[0, 2, 3]], b[[0, 2, 3]])
    cp = c.copy_slot(3, 0)
    for a, b in zip(rows(cp, [0, 1, 2, 3]), rows(c, [3, 1, 2, 3])):
        np.testing.assert_array_equal(a, b)
    sub = c.read_slots(jnp.asarray([3, 1]))
    assert sub.batch == 2
    for a, b in zip(rows(sub, [0, 1]), rows(c, [3, 1])):
        np.testing.assert_array_equal(a, b)


def test_decoding_one_slot_leaves_the_others_and_matches_it_alone(cfg, model):
    """Slots of one cache are independent: a row's logits do not depend on what the other rows hold."""
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 6)), jnp.int32)
    cache = init_cache(cfg, 3, 16)
    out = jit_forward(model, ids, cache=cache, n_new=jnp.asarray([6, 4, 0], jnp.int32))
    assert out.cache.lengths.tolist() == [6, 4, 0]
    # slot 2 received no tokens: its KDA state and windows are still empty (MLA wrote padding there, masked
    # by its length 0 until overwritten)
    for lc in out.cache.layers:
        if isinstance(lc, KDACache):
            for leaf in jax.tree.leaves(lc):
                assert not np.asarray(leaf)[2].any()
    alone = jit_forward(model, ids[1:2, :4], cache=init_cache(cfg, 1, 16), n_new=jnp.asarray([4], jnp.int32))
    np.testing.assert_allclose(np.asarray(out.logits)[1, :4], np.asarray(alone.logits)[0], atol=1e-5)
    # continue slot 1 only (one decode token), then compare with the same step alone
    nxt = jnp.asarray([[7], [8], [9]], jnp.int32)
    step = jit_forward(model, nxt, cache=out.cache, n_new=jnp.asarray([0, 1, 0], jnp.int32))
    step_alone = jit_forward(model, nxt[1:2], cache=alone.cache, n_new=jnp.asarray([1], jnp.int32))
    np.testing.assert_allclose(np.asarray(step.logits)[1], np.asarray(step_alone.logits)[0], atol=1e-5)
    for a, b in zip(jax.tree.leaves(step.cache.read_slots(0)), jax.tree.leaves(out.cache.read_slots(0))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))   # slot 0 untouched by slot 1's step


def test_cached_forward_from_empty_equals_uncached(cfg, model):
    """The one forward: continuing an empty cache computes what the plain forward computes."""
    # [3, 6] into a cache of 3 × 16: the shapes of the first cached forward of the test above (one compile for both)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 6)), jnp.int32)
    plain = jit_forward(model, ids)
    assert plain.cache is None and plain.router_scores is None          # inference returns no training outputs
    cached = jit_forward(model, ids, cache=init_cache(cfg, 3, 16), n_new=jnp.asarray([6, 6, 6], jnp.int32))
    np.testing.assert_allclose(np.asarray(cached.logits), np.asarray(plain.logits), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cached.expert_counts), np.asarray(plain.expert_counts))
    with pytest.raises(ValueError, match="cache: batch"):
        jax.eval_shape(lambda c: model(ids, cache=c), init_cache(cfg, 2, 16))


def test_every_variable_has_logical_axes_and_the_labels_are_right(cfg, model):
    state = nnx.state(model)
    axes = {".".join(map(str, p)): variable_axes(v) for p, v in nnx.to_flat_state(state)}
    for p, v in nnx.to_flat_state(state):
        assert getattr(v, "axes", None) is not None, f"{p}: no logical axes"
        assert len(v.axes) == len(v.shape)
    names = {a for ax in axes.values() for a in ax if a}
    assert {"experts", "heads", "embed", "vocab", "mlp", "latent"} <= names <= set(LOGICAL_TO_MESH) | {
        "q_lora", "kv_lora", "gate_rank", "router"}
    kda, mla, moe = "model.layers.1.self_attn", "model.layers.2.self_attn", "model.layers.1.block_sparse_moe"
    assert axes[f"{kda}.dt_bias"] == ("heads", None)                    # [heads, head_dim], not a matrix
    assert axes[f"{kda}.f_b_proj.kernel"] == ("gate_rank", "heads", None)
    assert axes[f"{mla}.kv_b_proj.kernel"] == ("kv_lora", "heads", None)
    assert axes[f"{moe}.gate.kernel"] == ("embed", "router")            # router scores are not split
    assert axes[f"{moe}.experts.w1"][0] == "experts"
    assert axes["model.embed_tokens"] == ("vocab", "embed") and axes["lm_head.kernel"] == ("embed", "vocab")
    assert not any("qb_bounds" in k for k in axes)                      # dead state is gone
    tree = axes_tree(state)
    assert tree["model"]["layers"][1]["self_attn"]["dt_bias"] == ("heads", None)
