"""SiTU, routing, dropless MoE and the LatentMoE block against closed forms and per-token references."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3jax import K3Config
from k3jax.nn.layers import KeyGen
from k3jax.nn.moe import MoE, activation
from k3jax.ops.attnres import attnres_mix
from k3jax.ops.grouped import (GROUPED_STRATEGIES, argsort_ids, compact_index, choose_tile, grouped_matmul, moe_grouped, moe_per_token,
                               padded_caps, resolve_strategy, tile_count)
from k3jax.ops.routing import router_topk
from k3jax.ops.situ import situ_glu, situ_glu_reference

any_float = st.floats(allow_nan=False, allow_infinity=True, width=32)
moderate = st.floats(min_value=-8.0, max_value=8.0, width=32)


@settings(max_examples=300, deadline=None)
@given(a=any_float, u=any_float)
def test_situ_is_bounded_for_any_input(a, u):
    """|SiTU(a, u)| < β·β_lin = 100 (fp32 can round tanh and σ to exactly 1 for huge inputs: then ≤)."""
    y = float(situ_glu(jnp.float32(a), jnp.float32(u), 4.0, 25.0))
    assert np.isfinite(y) and abs(y) <= 100.0


@settings(max_examples=200, deadline=None)
@given(a=moderate, u=moderate)
def test_situ_strict_bound_where_nothing_saturates(a, u):
    assert abs(float(situ_glu(jnp.float32(a), jnp.float32(u), 4.0, 25.0))) < 100.0


def test_situ_closed_form_and_gate_minimum():
    a = np.linspace(-6, 6, 2001).astype(np.float32)
    u = np.linspace(-90, 90, 2001).astype(np.float32)
    want = (4 * np.tanh(a / 4) / (1 + np.exp(-a))) * (25 * np.tanh(u / 25))
    np.testing.assert_allclose(situ_glu(jnp.asarray(a), jnp.asarray(u)), want, rtol=1e-5, atol=1e-5)
    gate = np.asarray(situ_glu(jnp.asarray(a), jnp.ones_like(a) * 1e9))  # up factor saturates at 25
    i = int(np.argmin(gate))
    assert abs(gate[i] / 25 - (-0.270)) < 1e-3 and abs(a[i] - (-1.22)) < 0.01      # spec §7.1
    # β = None means 1 and β_lin = None leaves the up branch uncapped
    np.testing.assert_allclose(situ_glu(jnp.asarray(a), jnp.asarray(u), None, None),
                               np.tanh(a) / (1 + np.exp(-a)) * u, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("betas", [(4.0, 25.0), (None, None), (4.0, None)])
def test_situ_hand_written_backward_matches_autodiff(rng, betas):
    """The custom VJP against JAX's autodiff of the reference formula, over the saturating range too."""
    a = jnp.asarray(rng.normal(size=(64, 48)) * 12, jnp.float32)
    u = jnp.asarray(rng.normal(size=(64, 48)) * 60, jnp.float32)
    g = jnp.asarray(rng.normal(size=(64, 48)), jnp.float32)
    got = jax.vjp(lambda a, u: situ_glu(a, u, *betas), a, u)[1](g)
    want = jax.vjp(lambda a, u: situ_glu_reference(a, u, *betas), a, u)[1](g)
    for x, y in zip(got, want):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(y))))
    # bf16 inputs: fp32 inside, gradients in the inputs' dtype, as autodiff returns them
    ab, ub, gb = (x.astype(jnp.bfloat16) for x in (a, u, g))
    got = jax.vjp(lambda a, u: situ_glu(a, u, *betas), ab, ub)[1](gb)
    want = jax.vjp(lambda a, u: situ_glu_reference(a, u, *betas), ab, ub)[1](gb)
    for x, y in zip(got, want):
        assert x.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=2e-2,
                                   atol=2e-2 * float(jnp.max(jnp.abs(y.astype(jnp.float32)))))


def test_bias_changes_selection_but_not_weights(rng):
    logits = jnp.asarray(rng.normal(size=(64, 16)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(16,)) * 2, jnp.float32)
    w0, i0 = router_topk(logits, None, 4, renormalize=False)
    w1, i1 = router_topk(logits, bias, 4, renormalize=False)
    assert bool(jnp.any(jnp.sort(i0, -1) != jnp.sort(i1, -1)))          # the bias moves the choice
    s = jax.nn.sigmoid(logits)
    np.testing.assert_allclose(w1, jnp.take_along_axis(s, i1, -1), rtol=1e-6)  # weights = unbiased scores
    wn, _ = router_topk(logits, bias, 4, renormalize=True, scaling_factor=2.5)
    np.testing.assert_allclose(jnp.sum(wn, -1), 2.5, rtol=1e-6)
    # the selected experts are exactly the top-k of s + bias
    want = np.argsort(-(np.asarray(s) + np.asarray(bias)), -1)[:, :4]
    np.testing.assert_array_equal(np.sort(i1, -1), np.sort(want, -1))


def test_group_limited_selection(rng):
    logits = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)
    _, idx = router_topk(logits, None, 2, n_group=4, topk_group=1)
    assert bool(jnp.all(idx[:, 0] // 4 == idx[:, 1] // 4))              # both picks from the one kept group


def routed(rng, N, E, D, I, k, mode):
    x = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
    logits = jnp.asarray(rng.normal(size=(N, E)), jnp.float32)
    bias = np.zeros(E, np.float32)
    if mode == "one_expert":
        bias[:k] = 100.0                          # every token to the same k experts (expert 0 gets all N)
    elif mode == "one_rank":
        bias[: E // 4] = 100.0                    # all tokens to the experts of rank 0 of 4
    w, idx = router_topk(logits, jnp.asarray(bias), k)
    ws = [jnp.asarray(rng.normal(size=s) / np.sqrt(s[1]), jnp.float32) for s in ((E, D, I), (E, D, I), (E, I, D))]
    return x, idx, w, ws


@pytest.mark.parametrize("strategy", GROUPED_STRATEGIES)
@pytest.mark.parametrize("mode", ["random", "one_expert", "one_rank"])
def test_dropless_grouped_matches_per_token(rng, mode, strategy):
    N, E, D, I, k = 48, 16, 24, 20, 4
    x, idx, w, (w1, w3, w2) = routed(rng, N, E, D, I, k, mode)
    if mode == "one_expert":
        assert int(jnp.sum(idx == 0)) == N
    act = lambda a, u: situ_glu(a, u, 4.0, 25.0)  # noqa: E731
    y = moe_grouped(x, idx, w, w1, w3, w2, act, strategy=strategy)
    y_ref = moe_per_token(x, idx, w, w1, w3, w2, act)
    assert float(jnp.max(jnp.abs(y - y_ref))) <= 1e-5 * float(jnp.max(jnp.abs(y_ref)))
    # and against an explicit dense evaluation of every expert on every token
    dense = jnp.stack([act(x @ w1[e], x @ w3[e]) @ w2[e] for e in range(E)], 1)          # [N, E, D]
    y_dense = jnp.sum(jnp.take_along_axis(dense, idx[..., None], 1) * w[..., None], 1)
    assert float(jnp.max(jnp.abs(y - y_dense))) <= 1e-5 * float(jnp.max(jnp.abs(y_dense)))
    grads = jax.grad(lambda *a: jnp.sum(moe_grouped(*a, act, strategy=strategy) ** 2), argnums=(0, 2, 3, 4, 5))
    grads_ref = jax.grad(lambda *a: jnp.sum(moe_per_token(*a, act) ** 2), argnums=(0, 2, 3, 4, 5))
    for name, g, g_ref in zip(("x", "weights", "w1", "w3", "w2"), grads(x, idx, w, w1, w3, w2),
                              grads_ref(x, idx, w, w1, w3, w2)):
        assert float(jnp.max(jnp.abs(g - g_ref))) <= 1e-5 * float(jnp.max(jnp.abs(g_ref))), name


@settings(max_examples=15, deadline=None)
@given(P=st.integers(1, 300), n=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_argsort_ids_and_compact_index_equal_numpy(P, n, seed):
    """The sort-free / single-key helpers against numpy's stable argsort (many ties: n ids over P entries)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, n, P)
    np.testing.assert_array_equal(np.asarray(_argsort_ids(jnp.asarray(ids, jnp.int32), n)),
                                  np.argsort(ids, kind="stable"))
    mask = rng.random((3, P)) < rng.random()
    k = int(rng.integers(1, P + 1))
    want = np.full((3, k), P)
    for b in range(3):
        hits = np.flatnonzero(mask[b])[:k]
        want[b, :len(hits)] = hits
    np.testing.assert_array_equal(np.asarray(_compact_index(jnp.asarray(mask), k)), want)
    np.testing.assert_array_equal(np.asarray(_compact_index(jnp.asarray(mask[0]), k)), want[0])


_argsort_ids = jax.jit(argsort_ids, static_argnums=1)
_compact_index = jax.jit(compact_index, static_argnums=1)


def test_argsort_ids_falls_back_past_int32():
    ids = jnp.asarray([3, 1, 3, 0], jnp.int32)
    np.testing.assert_array_equal(np.asarray(argsort_ids(ids, 2 ** 30)), [3, 1, 0, 2])


@pytest.mark.parametrize("strategy,tile", [("tiles", 8), ("tiles", 16), ("tiles", None), ("padded", None)])
def test_grouped_matmul_equals_per_group_numpy(rng, strategy, tile):
    # adversarial group sizes: empty groups (first, middle, last), one group with every row, sizes that are and
    # are not multiples of the tile, and Σ sizes < M (the rows past the groups must come back as zeros). "padded"
    # (padded_layouts(40, 7, ·): boxes of 8 and 16 rows, a box of 8 + 3 tiles of 16, the tiles) runs its box and
    # box + tiles branches: largest group ≤ 8 ([1]*7), ≤ 16 (the first and fourth), and past both (one group with
    # every row: 32 rows past the box of 8 in two tiles)
    M, D, I, G = 40, 6, 5, 7
    x = rng.normal(size=(M, D))
    w = rng.normal(size=(G, D, I))
    dy = rng.normal(size=(M, I))
    for sizes in ([0, 5, 0, 8, 16, 11, 0], [0, 0, 40, 0, 0, 0, 0], [1] * 7, [3, 0, 9, 0, 2, 0, 1], [40] + [0] * 6):
        sizes = np.asarray(sizes)
        g = np.repeat(np.arange(G), sizes)
        want = np.zeros((M, I))
        want[:len(g)] = np.einsum("md,mdi->mi", x[:len(g)], w[g])
        f = lambda x_, w_: grouped_matmul(x_, w_, jnp.asarray(sizes, jnp.int32), strategy=strategy,  # noqa: E731
                                          tile=tile)
        y, pull = jax.vjp(f, jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
        np.testing.assert_allclose(np.asarray(y), want, atol=1e-5, err_msg=str(sizes))
        dx, dw = pull(jnp.asarray(dy, jnp.float32))
        dx_want = np.zeros((M, D))
        dx_want[:len(g)] = np.einsum("mi,mdi->md", dy[:len(g)], w[g])
        dw_want = np.zeros((G, D, I))
        np.add.at(dw_want, g, np.einsum("md,mi->mdi", x[:len(g)], dy[:len(g)]))
        np.testing.assert_allclose(np.asarray(dx), dx_want, atol=1e-5, err_msg=str(sizes))
        np.testing.assert_allclose(np.asarray(dw), dw_want, atol=1e-5, err_msg=str(sizes))
        ragged = jax.lax.ragged_dot(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32),
                                    jnp.asarray(sizes, jnp.int32), precision=jax.lax.Precision.HIGHEST)
        np.testing.assert_allclose(np.asarray(y), np.asarray(ragged), atol=1e-5)


def test_padded_grouped_matmul_runs_each_capacity_rung(rng):
    # 128 rows in 4 groups: capacities 40, 48 and 64 (1.25×, 1.5×, 2× the mean of 32); the largest group picks
    # the rung — 40, 45 (the 1.5× rung), 64, and 100 (past them all: the tiles) — against numpy, values and grads
    M, D, I, G = 128, 6, 5, 4
    assert padded_caps(M, G) == (40, 48, 64)
    x, w, dy = rng.normal(size=(M, D)), rng.normal(size=(G, D, I)), rng.normal(size=(M, I))
    f = jax.jit(lambda x_, w_, s_: jax.vjp(lambda a, b: grouped_matmul(a, b, s_, strategy="padded"), x_, w_)[1](
        jnp.asarray(dy, jnp.float32)))
    fy = jax.jit(lambda x_, w_, s_: grouped_matmul(x_, w_, s_, strategy="padded"))
    for sizes in ([40, 30, 30, 28], [45, 30, 30, 23], [64, 20, 20, 24], [100, 10, 10, 8]):
        g = np.repeat(np.arange(G), sizes)
        args = (jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), jnp.asarray(sizes, jnp.int32))
        np.testing.assert_allclose(np.asarray(fy(*args)), np.einsum("md,mdi->mi", x, w[g]), atol=1e-5,
                                   err_msg=str(sizes))
        dx, dw = f(*args)
        dw_want = np.zeros((G, D, I))
        np.add.at(dw_want, g, np.einsum("md,mi->mdi", x, dy))
        np.testing.assert_allclose(np.asarray(dx), np.einsum("mi,mdi->md", dy, w[g]), atol=1e-5, err_msg=str(sizes))
        np.testing.assert_allclose(np.asarray(dw), dw_want, atol=1e-5, err_msg=str(sizes))


def test_tile_choice_bounds_the_padding():
    # few large groups get large tiles, many small groups small ones; the static tile count covers any sizes
    assert choose_tile(2048, 16, 256, 1536) > choose_tile(2048, 224, 64, 96)
    # "auto": padded capacities for few large groups (the 100m preset's), tiles for many small ones (a MoonEP rank)
    assert padded_caps(40, 7) == (8, 16) and padded_caps(2048, 16) == (160, 192, 256)
    assert resolve_strategy(None, 2048, 16) == "padded" and resolve_strategy("auto", 2048, 224) == "tiles"
    assert resolve_strategy("auto", 4, 16) == "tiles" and resolve_strategy("ragged", 2048, 16) == "ragged"
    for M, G, t in ((2048, 16, 128), (2048, 224, 8), (40, 7, 16)):
        worst = sum(-(-s // t) for s in [1] * (G - 1) + [M - (G - 1)])   # G−1 groups of one row, one of the rest
        assert worst <= tile_count(M, G, t)


def test_latent_moe_block_closed_form(rng):
    """y = up(RMSNorm(Σ_j w_j E_j(down x))) + shared(x): router on full-width x, norm between combine and up."""
    cfg = K3Config.from_preset("test")
    moe = MoE(cfg, keys=KeyGen(jax.random.key(3)))
    moe.e_score_correction_bias[...] = jnp.asarray(rng.normal(size=(8,)), jnp.float32)
    moe.routed_expert_norm.weight[...] = jnp.asarray(rng.uniform(0.5, 1.5, size=(32,)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(2, 5, 64)), jnp.float32)
    y, (counts, scores) = moe(x)
    assert scores is None                               # router scores only when asked (training)
    xf = np.asarray(x).reshape(10, 64)
    s = 1 / (1 + np.exp(-(xf @ np.asarray(moe.gate.kernel[...]))))
    idx = np.argsort(-(s + np.asarray(moe.e_score_correction_bias[...])), -1)[:, :2]
    w = np.take_along_axis(s, idx, -1)
    w = w / w.sum(-1, keepdims=True) * cfg.routed_scaling_factor
    z = xf @ np.asarray(moe.routed_expert_down_proj.kernel[...])
    act = activation(cfg)
    e1, e3, e2 = (np.asarray(a[...]) for a in (moe.experts.w1, moe.experts.w3, moe.experts.w2))
    comb = np.zeros((10, 32), np.float32)
    for t in range(10):
        for j in range(2):
            e = idx[t, j]
            comb[t] += w[t, j] * (np.asarray(act(jnp.asarray(z[t] @ e1[e]), jnp.asarray(z[t] @ e3[e]))) @ e2[e])
    normed = comb / np.sqrt((comb ** 2).mean(-1, keepdims=True) + 1e-5) * np.asarray(moe.routed_expert_norm.weight[...])
    sh = moe.shared_experts
    shared = np.asarray(act(jnp.asarray(xf @ np.asarray(sh.gate_proj.kernel[...])),
                            jnp.asarray(xf @ np.asarray(sh.up_proj.kernel[...])))) @ np.asarray(sh.down_proj.kernel[...])
    want = normed @ np.asarray(moe.routed_expert_up_proj.kernel[...]) + shared
    np.testing.assert_allclose(np.asarray(y).reshape(10, 64), want, rtol=2e-4, atol=2e-5)
    # for the training step's balancing, the same call also reports the (unbiased) sigmoid router scores
    _, (counts2, scores) = moe(x, router_scores=True)
    np.testing.assert_allclose(np.asarray(scores), s, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(counts2), np.asarray(counts))
    np.testing.assert_array_equal(np.asarray(counts), np.bincount(idx.ravel(), minlength=8))
    np.testing.assert_array_equal(counts, np.bincount(idx.reshape(-1), minlength=8))


def test_attnres_mix_closed_form(rng):
    blocks = [jnp.asarray(rng.normal(size=(3, 8)) * s, jnp.float32) for s in (1.0, 5.0)]
    p = jnp.asarray(rng.normal(size=(3, 8)), jnp.float32)
    wn, wp = rng.normal(size=8), rng.normal(size=(1, 8))
    out = attnres_mix(blocks, p, jnp.asarray(wn), jnp.asarray(wp), 1e-5)
    cand = np.stack([np.asarray(b, np.float64) for b in blocks] + [np.asarray(p, np.float64)])
    s = ((cand / np.sqrt((cand ** 2).mean(-1, keepdims=True) + 1e-5)) * (wn * wp[0])).sum(-1)
    pi = np.exp(s - s.max(0)) / np.exp(s - s.max(0)).sum(0)
    np.testing.assert_allclose(out, (pi[..., None] * cand).sum(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(attnres_mix([], p, jnp.asarray(wn), jnp.asarray(wp), 1e-5), p)
    # zero pseudo-query → uniform average of the candidates
    np.testing.assert_allclose(attnres_mix(blocks, p, jnp.ones(8), jnp.zeros((1, 8)), 1e-5), cand.mean(0), rtol=1e-6)


def test_mla_attention_in_query_blocks_equals_the_float64_softmax(rng):
    """The long-sequence path of ``mla_attention`` (queries in blocks, each rematerialised for the backward pass;
    T = 37 not a multiple of the block, packed documents, queries offset into the keys as under context
    parallelism) against a float64 NumPy softmax attention, and its gradients against the one-block path's."""
    from k3jax.ops.attention import mla_attention

    B, T, S, N, Dn, Dr, Dv, off = 2, 37, 45, 3, 8, 4, 5, 8
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    qn, qr, kn, kr, v = f(B, T, N, Dn), f(B, T, N, Dr), f(B, S, N, Dn), f(B, S, Dr), f(B, S, N, Dv)
    kv_seg = np.zeros((B, S), np.int32)
    kv_seg[0, 20:], kv_seg[1, 11:], kv_seg[1, 30:] = 1, 1, 2
    seg = kv_seg[:, off:off + T]
    s = (np.einsum("btnd,bsnd->bnts", *map(np.float64, (qn, kn))) +
         np.einsum("btnd,bsd->bnts", *map(np.float64, (qr, kr)))) * 0.3
    mask = (np.arange(S)[None, :] <= off + np.arange(T)[:, None]) & (seg[:, None, :, None] == kv_seg[:, None, None])
    p = np.exp(np.where(mask, s, -np.inf) - np.max(np.where(mask, s, -np.inf), -1, keepdims=True))
    ref = np.einsum("bnts,bsnd->btnd", p / p.sum(-1, keepdims=True), np.float64(v))

    def attn(q_block):       # jitted: op-by-op dispatch of the blocked map and its transpose is slow on CPU
        return jax.jit(lambda qn, qr, kn, kr, v: mla_attention(qn, qr, kn, kr, v, 0.3, jnp.asarray(seg),
                                                       kv_segment_ids=jnp.asarray(kv_seg), q_offset=off,
                                                       q_block=q_block))

    args = (qn, qr, kn, kr, v)
    np.testing.assert_allclose(attn(8)(*args), ref, atol=1e-5)
    np.testing.assert_allclose(attn(None)(*args), ref, atol=1e-5)
    w = f(B, T, N, Dv)
    grads = [jax.jit(jax.grad(lambda *a, q=q: jnp.sum(attn(q)(*a) * w), argnums=range(5)))(*args)
             for q in (8, None)]
    for gb, gd in zip(*grads):
        np.testing.assert_allclose(gb, gd, atol=1e-5)


def test_matmul_acc_accumulates_in_fp32_both_ways_and_matches_numpy():
    """bf16 projections (ops.precision.matmul_acc): the forward and both backward products take bf16 operands with
    fp32 accumulation (the products XLA:CPU runs on AMX) and equal numpy's float64 products of the same bf16
    values, rounded once to bf16."""
    import ml_dtypes

    from k3jax.ops.precision import matmul_acc

    rng = np.random.default_rng(0)
    bf = jnp.bfloat16
    x = jnp.asarray(rng.normal(size=(2, 5, 6)), bf)
    w = jnp.asarray(rng.normal(size=(6, 3, 4)), bf)
    g = jnp.asarray(rng.normal(size=(2, 5, 3, 4)), jnp.float32)
    y, pull = jax.vjp(lambda x, w: matmul_acc(x, w, 1), x, w)
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    g64 = np.asarray(g.astype(bf), np.float64)                       # the cotangent rounded to bf16 first
    as_bf = lambda a: np.asarray(a, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)  # noqa: E731
    assert y.dtype == bf
    np.testing.assert_allclose(np.asarray(y, np.float64), as_bf(np.einsum("btd,dhk->bthk", x64, w64)), rtol=1e-2,
                               atol=1e-2)
    dx, dw = pull(g.astype(bf))
    np.testing.assert_allclose(np.asarray(dx, np.float64), as_bf(np.einsum("bthk,dhk->btd", g64, w64)), rtol=1e-2,
                               atol=1e-2)
    np.testing.assert_allclose(np.asarray(dw, np.float64), as_bf(np.einsum("btd,bthk->dhk", x64, g64)), rtol=1e-2,
                               atol=1e-2)
    # every product's operands are bf16 (an fp32 × bf16 product would run at the fp32 rate)
    closed = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(matmul_acc(x, w, 1).astype(jnp.float32) ** 2),
                                     argnums=(0, 1)))(x, w)
    eqns = [e for e in _all_eqns(closed.jaxpr) if e.primitive.name == "dot_general"]
    assert len(eqns) >= 3                                            # the forward, dx and dw
    assert all(v.aval.dtype == bf for e in eqns for v in e.invars), [[v.aval for v in e.invars] for e in eqns]


def _f32_dots(compiled_text: str) -> list[str]:
    """The dots of an optimized HLO module whose operands are both fp32 (each operand's type read off its
    definition)."""
    import re
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", compiled_text))
    out = []
    for line in compiled_text.splitlines():
        m = re.search(r" dot\(([^)]*)\)", line)
        if m:
            ops = [o.strip().split()[-1].lstrip("%") for o in m.group(1).split(",")]
            if all(types.get(o) == "f32" for o in ops):
                out.append(line.strip()[:160])
    return out


@pytest.mark.parametrize("shape", [(16, 24), (3, 12, 5), (2, 6, 9), (7, 4), (2, 1, 3)])
def test_transposed_copy_is_the_transpose(shape):
    from k3jax.ops.precision import transposed_copy
    a = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
    np.testing.assert_array_equal(np.asarray(jax.jit(transposed_copy)(a)), np.swapaxes(np.asarray(a), -1, -2))


def test_bf16_products_and_weight_gradients_stay_bf16_after_xla():
    """XLA:CPU converts a bf16 product to fp32 (the fp32 rate, no matrix unit) when it is asked for a bf16 result
    or when the product contracts its first operand's leading axis — the form of a weight gradient. The bf16
    backward of matmul_acc and of the grouped FFN must keep every product's operands bf16 in the optimized
    module (the weight gradients through ops.precision.transposed_copy), and their fp32 forms are untouched."""
    from k3jax.ops.grouped import _grouped_ffn, ffn_layouts
    from k3jax.ops.precision import matmul_acc
    rng = np.random.default_rng(5)
    act = lambda a, u: jax.nn.silu(a) * u  # noqa: E731
    M, G, D, I = 64, 4, 16, 24
    sizes = jnp.asarray([20, 12, 16, 16], jnp.int32)
    for dt in (jnp.bfloat16, jnp.float32):
        x = jnp.asarray(rng.normal(size=(64, 24)), dt)          # tokens flattened: one leading axis
        w = jnp.asarray(rng.normal(size=(24, 32)), dt)
        dense = jax.jit(jax.grad(lambda x, w: jnp.sum(matmul_acc(x, w, 1).astype(jnp.float32) ** 2), argnums=(0, 1)))
        xs = jnp.asarray(rng.normal(size=(M, D)), dt)
        W = [jnp.asarray(rng.normal(size=s), dt) for s in ((G, D, I), (G, D, I), (G, I, D))]
        layouts = ffn_layouts("padded", M, G, D, I)
        grouped = jax.jit(jax.grad(lambda xs, *W: jnp.sum(_grouped_ffn(xs, sizes, *W, act, layouts)
                                                          .astype(jnp.float32) ** 2), argnums=(0, 1, 2, 3)))
        for f, args in ((dense, (x, w)), (grouped, (xs, *W))):
            text = f.lower(*args).compile().as_text()
            f32 = _f32_dots(text)
            if dt == jnp.bfloat16:
                assert not f32, f32
            else:
                assert f32 and "bf16[" not in text


def test_grouped_ffn_bf16_matches_float64_of_the_bf16_values(rng):
    """The grouped FFN with bf16 operands (every layout: box, box + tiles from two weight parts, tiles): products
    accumulated in fp32 and rounded once, so values and gradients are float64's products of the same bf16 values
    to bf16's rounding."""
    from k3jax.ops.grouped import _grouped_ffn, choose_tile, padded_layouts
    M, G, D, I, split = 64, 8, 16, 24, 5
    bf = jnp.bfloat16
    layouts = padded_layouts(M, G, choose_tile(M, G, D, 3 * I))
    r64 = lambda a: np.asarray(jnp.asarray(a, bf), np.float64)  # noqa: E731
    x, dy = r64(rng.normal(size=(M, D))), r64(rng.normal(size=(M, D)))
    W = [r64(rng.normal(size=s) / 2) for s in ((G, D, I), (G, D, I), (G, I, D))]
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731

    def f(x_, s_, *ws, layout):
        parts = [(w[:split], w[split:]) for w in ws]
        y, pull = jax.vjp(lambda x__, *p: _grouped_ffn(x__, s_, *p, lambda a, u: jax.nn.silu(a) * u, (layout,)),
                          x_, *parts)
        dx, *dws = pull(jnp.asarray(dy, jnp.float32))       # the output is fp32 (the accumulation)
        return y, dx, [jnp.concatenate(d, 0) for d in dws]

    for layout, sizes in zip(layouts, ([16, 8, 8, 8, 8, 8, 8, 0], [40, 24, 0, 0, 0, 0, 0, 0],
                                       [0, 17, 0, 17, 0, 17, 0, 13])):
        g = np.repeat(np.arange(G), sizes)
        a, u = np.einsum("md,mdi->mi", x, W[0][g]), np.einsum("md,mdi->mi", x, W[1][g])
        h = a * sig(a) * u
        y_want = np.einsum("mi,mid->md", h, W[2][g])
        dh = np.einsum("md,mid->mi", dy, W[2][g])
        da, du = dh * u * sig(a) * (1 + a * (1 - sig(a))), dh * a * sig(a)
        dws_want = [np.zeros_like(w) for w in W]
        np.add.at(dws_want[0], g, np.einsum("md,mi->mdi", x, da))
        np.add.at(dws_want[1], g, np.einsum("md,mi->mdi", x, du))
        np.add.at(dws_want[2], g, np.einsum("mi,md->mid", h, dy))
        y, dx, dws = jax.jit(partial(f, layout=layout))(jnp.asarray(x, bf), jnp.asarray(sizes, jnp.int32),
                                                         *(jnp.asarray(w, bf) for w in W))
        assert dx.dtype == bf and all(d.dtype == bf for d in dws)
        dx_want = np.einsum("mi,mdi->md", da, W[0][g]) + np.einsum("mi,mdi->md", du, W[1][g])
        for got, want in ((y, y_want), (dx, dx_want), *zip(dws, dws_want)):
            got = np.asarray(got, np.float64)
            scale = np.abs(want).max()
            np.testing.assert_allclose(got, want, atol=0.03 * scale, rtol=0.03)


def test_matmul_acc_fp32_gradients_equal_autodiff_of_the_einsum():
    """In fp32 matmul_acc is the plain product: values and gradients equal jax's autodiff of ``jnp.einsum``."""
    from k3jax.ops.precision import matmul_acc

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(3, 7, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(8, 2, 5)), jnp.float32)
    loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))  # noqa: E731
    ours = jax.value_and_grad(loss(lambda x, w: matmul_acc(x, w, 1)), argnums=(0, 1))(x, w)
    ref = jax.value_and_grad(loss(lambda x, w: jnp.einsum("btd,dhk->bthk", x, w, precision="highest")),
                             argnums=(0, 1))(x, w)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def _all_eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            if hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                yield from _all_eqns(v.jaxpr)
            elif hasattr(v, "eqns"):
                yield from _all_eqns(v)


@pytest.mark.parametrize("M,G,split,cases", [
    # 128 rows in 4 groups: the boxes 40, 48, 64 (1.25×, 1.5×, 2× the mean of 32), then the tiles
    (128, 4, 2, [([40, 30, 30, 28], 0), ([45, 30, 30, 23], 1), ([64, 20, 20, 24], 2), ([100, 10, 10, 8], 3),
                 ([30, 30, 20, 0], 0)]),
    # 64 rows in 8 groups (mean 8 < 32): the box 16, a box of 8 + 4 tiles of 16 (rows past 8 in whole tiles),
    # then the tiles; parts of 5 and 3 experts, so tiles gather weights from both parts
    (64, 8, 5, [([16, 8, 8, 8, 8, 8, 8, 0], 0), ([40, 24, 0, 0, 0, 0, 0, 0], 1), ([0, 0, 0, 0, 0, 0, 0, 64], 1),
                ([30, 20, 0, 5, 0, 0, 0, 0], 1), ([25, 25, 14, 0, 0, 0, 0, 0], 2), ([0, 17, 0, 17, 0, 17, 0, 13], 1)]),
])
def test_grouped_ffn_each_layout_and_weight_parts_match_numpy(rng, M, G, split, cases):
    # the grouped FFN's custom VJP (gate/up rows as residuals) in each layout of padded_layouts — boxes, box +
    # tiles, tiles (which one ran checked by layout_index) — with the weights whole and as two parts along the
    # expert axis (MoonEP's home and fetched experts, never concatenated): values and all four gradients against a
    # numpy SiLU-GLU FFN, with Σ sizes < M in some cases (the rows past the groups give 0). The tiles (the
    # fallback) run in a scan of chunks of tiles: once as grouped_ffn sizes the chunks, once in chunks of 3 tiles
    # (several steps, the last one padded)
    from k3jax.ops.grouped import _grouped_ffn, choose_tile, ffn_layouts, layout_index, padded_layouts
    D, I = 6, 5
    layouts = padded_layouts(M, G, choose_tile(M, G, D, 3 * I))
    assert len(layouts) == (4 if G == 4 else 3) and layouts[-1].box == 0, layouts
    chunked = ffn_layouts("padded", M, G, D, I)
    assert chunked[:-1] == layouts[:-1] and chunked[-1].chunk > 0 and layouts[-1].tiles % 3, chunked
    menus = (chunked, (*layouts[:-1], layouts[-1]._replace(chunk=3)))
    assert sorted({want for _, want in cases}) == list(range(len(layouts)))      # every layout runs
    x, dy = rng.normal(size=(M, D)), rng.normal(size=(M, D))
    W = [rng.normal(size=s) / 2 for s in ((G, D, I), (G, D, I), (G, I, D))]
    act = lambda a, u: jax.nn.silu(a) * u  # noqa: E731
    sig = lambda v: 1 / (1 + np.exp(-v))   # noqa: E731

    def numpy_ffn(sizes):
        g = np.repeat(np.arange(G), sizes)
        n = len(g)
        a, u = np.einsum("md,mdi->mi", x[:n], W[0][g]), np.einsum("md,mdi->mi", x[:n], W[1][g])
        h = a * sig(a) * u
        y = np.zeros((M, D))
        y[:n] = np.einsum("mi,mid->md", h, W[2][g])
        dh = np.einsum("md,mid->mi", dy[:n], W[2][g])
        da, du = dh * u * sig(a) * (1 + a * (1 - sig(a))), dh * a * sig(a)
        dx = np.zeros((M, D))
        dx[:n] = np.einsum("mi,mdi->md", da, W[0][g]) + np.einsum("mi,mdi->md", du, W[1][g])
        dws = [np.zeros_like(w) for w in W]
        np.add.at(dws[0], g, np.einsum("md,mi->mdi", x[:n], da))
        np.add.at(dws[1], g, np.einsum("md,mi->mdi", x[:n], du))
        np.add.at(dws[2], g, np.einsum("mi,md->mid", h, dy[:n]))
        return y, dx, dws

    for sizes, want in cases:
        assert int(layout_index(jnp.asarray(sizes, jnp.int32), layouts)) == want, (sizes, layouts)
    for parts, menu in ((False, menus[0]), (True, menus[0]), (True, menus[1])):
        def run(x_, s_, w1, w3, w2, parts=parts, menu=menu):
            ws = [(w[:split], w[split:]) if parts else w for w in (w1, w3, w2)]
            y, pull = jax.vjp(lambda x__, *ws_: _grouped_ffn(x__, s_, *ws_, act, menu), x_, *ws)
            dx, *dws = pull(jnp.asarray(dy, jnp.float32))
            return y, dx, [jnp.concatenate(d, 0) if parts else d for d in dws]

        f = jax.jit(run)
        for sizes, want in cases:
            if menu is menus[1] and want < len(layouts) - 1:
                continue
            y, dx, dws = f(jnp.asarray(x, jnp.float32), jnp.asarray(sizes, jnp.int32), *(jnp.asarray(w, jnp.float32)
                                                                                            for w in W))
            y_want, dx_want, dws_want = numpy_ffn(sizes)
            msg = f"sizes {sizes}, parts {parts}, tiles {menu[-1]}"
            np.testing.assert_allclose(np.asarray(y), y_want, atol=2e-5, err_msg=msg)
            np.testing.assert_allclose(np.asarray(dx), dx_want, atol=2e-5, err_msg=msg)
            for d, d_want in zip(dws, dws_want):
                np.testing.assert_allclose(np.asarray(d), d_want, atol=2e-5, err_msg=msg)
