"""The whole model against an independent float64 NumPy reference of the spec, and K3-only closed forms."""

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import k3jax
import k3jax.nn.model as model_mod
from conftest import jit_forward
from k3jax import K3Config, K3ForCausalLM
from k3jax.params import parameter_table
from make_k3_fixture import write_random_k3_checkpoint
from reference_k3_numpy import forward as reference_forward
from reference_k3_numpy import load_release_checkpoint
from small_models import scannable


def test_k3_parameter_counts_from_eval_shape():
    """jax.eval_shape of the k3 preset (nothing allocated): spec §10's exact total and activated figures."""
    t = parameter_table(K3Config.from_preset("k3"))
    assert t.total == 2_779_484_476_000
    assert round(t.activated / 1e9, 2) == 104.19
    # spec §10 closed forms per component
    H, P = 7168, 12288
    kda = 5 * H * P + H * 128 + 128 * P + H * 96 + 3 * P * 4 + 96 + P + 128
    assert t.components["KDA layers"] == 69 * kda == 69 * 443_740_384
    assert t.components["MLA layers"] == 24 * 232_196_096
    assert t.routed_experts == 92 * 896 * 3 * 3584 * 3072
    assert t.total - (t.routed_experts - t.routed_experts_active) == 105_364_017_760  # embedding counted
    assert t.embedding == 163840 * 7168


@pytest.fixture(scope="module")
def k3_fixture(tmp_path_factory):
    d = tmp_path_factory.mktemp("k3")
    text = scannable().to_dict()           # 5 layers: the scanned model (layers 1–2 a scan) is checked too
    write_random_k3_checkpoint(d, text, seed=0)
    ids = np.random.default_rng(0).integers(0, text["vocab_size"], size=(2, 40))
    tc, tensors = load_release_checkpoint(d)
    ref = np.stack([reference_forward(tc, tensors, row) for row in ids])
    return d, ids, ref


def test_k3_forward_matches_numpy_reference_float64(k3_fixture, x64):
    d, ids, ref = k3_fixture
    model = k3jax.load_pretrained(d, dtype="float64")
    ids = jnp.asarray(ids, jnp.int32)
    # scan_layers: layers 1 and 2 (KDA + MoE, layer 2 sealing an AttnRes block) as a scan
    assert model.model.scan_plan == (1, 1, 2)
    for kw in ({}, {"kda_kernel": "recurrent", "moe_grouped": False}, {"scan_layers": True}):
        out = np.asarray(jit_forward(model, ids, **kw).logits)
        assert out.dtype == np.float64
        assert np.max(np.abs(out - ref)) <= 1e-9 * np.max(np.abs(ref))


def test_k3_forward_matches_numpy_reference_float32(k3_fixture):
    d, ids, ref = k3_fixture
    model = k3jax.load_pretrained(d, dtype="float32")
    out = np.asarray(jit_forward(model, jnp.asarray(ids, jnp.int32)).logits)
    assert np.max(np.abs(out - ref)) <= 1e-4 * np.max(np.abs(ref))


def k3_schedule_tiny_dims() -> K3Config:
    """The released K3 layer/AttnRes schedule (93 layers, block 12, MLA lists) with toy widths."""
    k3 = K3Config.from_preset("k3")
    lac = dataclasses.replace(k3.linear_attn_config, num_heads=1, head_dim=8)
    return k3.replace(vocab_size=32, hidden_size=16, intermediate_size=16, linear_attn_config=lac,
                      num_attention_heads=1, num_key_value_heads=1, q_lora_rank=8, kv_lora_rank=8,
                      qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_experts=4, num_experts_per_token=2,
                      moe_intermediate_size=8, routed_expert_hidden_size=8, dtype="float32")


def test_attnres_candidate_counts_for_the_k3_schedule(monkeypatch):
    calls = []
    real = model_mod.attnres_mix

    def spy(blocks, partial, *a):
        calls.append(len(blocks) + 1)
        return real(blocks, partial, *a)

    monkeypatch.setattr(model_mod, "attnres_mix", spy)
    # trace only, of an abstract model (nnx.eval_shape: the 93 layers' parameters are never initialised)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: K3ForCausalLM(k3_schedule_tiny_dims())))
    jax.eval_shape(lambda st, ids: nnx.merge(graphdef, st)(ids).logits, state, jax.ShapeDtypeStruct((1, 4), jnp.int32))
    expected = [2]                                                     # layer 0: attention read is the identity
    for i in range(1, 93):
        expected += [(i - 1) // 12 + 2, i // 12 + 2]                   # spec §6.3
    expected.append(9)                                                 # output read: 8 sealed + live partial
    assert calls == expected
    assert calls[2 * 12 - 1: 2 * 12 + 1] == [2, 3]                    # layer 12: 2 / 3
    assert calls[2 * 84 - 1: 2 * 84 + 1] == [8, 9]                    # layer 84: 8 / 9


def test_embedding_is_first_block_and_layer0_read_is_identity(monkeypatch):
    cfg = K3Config.from_preset("test")
    model = K3ForCausalLM(cfg, rngs=nnx.Rngs(1))
    ids = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]], jnp.int32)
    emb = model.model.embed_tokens[...][ids]
    seen = {}
    real_mix = model_mod.attnres_mix
    real_norm = model_mod.RMSNorm.__call__

    def spy_mix(blocks, partial, *a):
        seen.setdefault("blocks", [b for b in blocks])
        return real_mix(blocks, partial, *a)

    def spy_norm(self, a):                                            # the first norm is layer 0's input norm
        seen.setdefault("attn_in", a)
        return real_norm(self, a)

    monkeypatch.setattr(model_mod, "attnres_mix", spy_mix)
    monkeypatch.setattr(model_mod.RMSNorm, "__call__", spy_norm)
    graphdef, state = nnx.split(model)

    @jax.jit                        # one compile of the forward, not op by op; what the spies saw comes back out
    def forward(st, ids):
        seen.clear()
        nnx.merge(graphdef, st)(ids)
        return seen["attn_in"], seen["blocks"][0]

    attn_in, block0 = forward(state, ids)
    np.testing.assert_array_equal(attn_in, emb)                       # layer 0 attention reads x0 unchanged
    np.testing.assert_array_equal(block0, emb)                        # the embedding is sealed as block 0


def test_expert_counts_and_static_shapes():
    cfg = K3Config.from_preset("test")
    model = K3ForCausalLM(cfg)
    # [2, 8]: test_causality's input shape, so that the two share one compile of the jitted forward
    out = jit_forward(model, jnp.zeros((2, 8), jnp.int32) + jnp.arange(8))
    assert out.logits.shape == (2, 8, cfg.vocab_size)
    assert out.expert_counts.shape == (len(cfg.moe_layers), cfg.num_experts)
    np.testing.assert_array_equal(out.expert_counts.sum(-1), 2 * 8 * cfg.num_experts_per_token)


def test_causality():
    model = K3ForCausalLM(K3Config.from_preset("test"), rngs=nnx.Rngs(2))
    a = jnp.asarray([[5, 6, 7, 8, 9, 10, 11, 12]], jnp.int32)
    b = a.at[0, 5].set(100)
    both = jit_forward(model, jnp.concatenate([a, b])).logits
    la, lb = both[:1], both[1:]
    np.testing.assert_allclose(la[:, :5], lb[:, :5], atol=1e-6)
    assert float(jnp.max(jnp.abs(la[:, 5:] - lb[:, 5:]))) > 1e-4


def test_bad_input_ids():
    model = K3ForCausalLM(K3Config.from_preset("test"))
    with pytest.raises(ValueError, match=r"input_ids: expected integer ids of shape \[B, T\]"):
        model(jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="input_ids"):
        model(jnp.zeros((1, 4), jnp.float32))
