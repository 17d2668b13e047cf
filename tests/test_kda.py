"""KDA paths against each other, fla's reference and closed forms (fp32 and fp64); the registered chunked
implementations by one conformance test, the benchmark variants (``benchmarks/kda_variants.py``) by a small one."""

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import device_env, fla_naive_module
from k3jax.ops.kda import (causal_conv1d, causal_conv1d_reference, conv_window_advance, kda_gate_lower_bound,
                           kda_gate_softplus, kda_recurrent, kda_replay, kda_step)
from k3jax.ops.kda_chunked import KDA_CHUNKED_IMPLS, kda_chunked
from k3jax.ops.norm import l2_norm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))      # benchmarks/ (the variants)


def make_inputs(rng, T, gate, B=2, H=3, K=32, V=16, init=False, dtype=np.float32):
    q = l2_norm(jnp.asarray(rng.normal(size=(B, T, H, K)), dtype))
    k = l2_norm(jnp.asarray(rng.normal(size=(B, T, H, K)), dtype))
    v = jnp.asarray(rng.normal(size=(B, T, H, V)), dtype)
    f = jnp.asarray(rng.normal(size=(B, T, H, K)) * 2, dtype)
    dt_bias = jnp.asarray(rng.normal(size=(H, K)), dtype)
    A_log = jnp.asarray(rng.uniform(-1, 1, size=(H,)), dtype)
    g = kda_gate_lower_bound(f, dt_bias, A_log, -5.0) if gate == "lower_bound" else kda_gate_softplus(f, dt_bias, A_log)
    beta = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(B, T, H)), dtype))
    s0 = jnp.asarray(rng.normal(size=(B, H, K, V)), dtype) if init else None
    return q, k, v, g, beta, s0


def rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def test_lower_bound_gate_range_and_no_overflow(rng):
    """γ ∈ (−5, 0); a 64-token chunk at the bound spans e^{−320}: the chunked form stays finite and exact."""
    q, k, v, _, beta, _ = make_inputs(rng, 128, "lower_bound")
    g = jnp.full(q.shape, -4.999, jnp.float32)
    o_ref, _ = kda_recurrent(q, k, v, g, beta)
    o, _ = kda_chunked(q, k, v, g, beta, safe_gate=True)
    assert bool(jnp.all(jnp.isfinite(o))) and rel(o, o_ref) <= 1e-5
    f = jnp.asarray(rng.normal(size=(4, 5)) * 50, jnp.float32)
    gam = kda_gate_lower_bound(f, jnp.zeros((4, 5)), jnp.zeros(4), -5.0)
    assert bool(jnp.all((gam >= -5) & (gam <= 0)))  # σ saturates in fp32, so the ends are reachable


def test_closed_forms_single_token_and_no_decay(rng):
    """T=1 from zero state: o = β (q·k) v · scale; with g=0, β=1, orthonormal keys the state stores v exactly."""
    q, k, v, g, beta, _ = make_inputs(rng, 1, "lower_bound")
    o, s = kda_chunked(q, k, v, g, beta, output_final_state=True)
    qk = jnp.sum(q * k, -1) * q.shape[-1] ** -0.5
    np.testing.assert_allclose(o, (beta * qk)[..., None] * v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s, jnp.einsum("bhk,bhv->bhkv", beta[:, 0, :, None] * k[:, 0], v[:, 0]), rtol=1e-5,
                               atol=1e-6)
    K, V, T = 16, 4, 10
    keys = jnp.eye(K)[:T][None, :, None, :]                                   # orthonormal keys
    vals = jnp.asarray(rng.normal(size=(1, T, 1, V)), jnp.float32)
    _, S = kda_chunked(keys, keys, vals, jnp.zeros((1, T, 1, K)), jnp.ones((1, T, 1)), output_final_state=True)
    np.testing.assert_allclose(S[0, 0, :T], vals[0, :, 0], rtol=1e-6, atol=1e-6)


def test_step_matches_recurrent(rng):
    q, k, v, g, beta, s0 = make_inputs(rng, 9, "softplus", init=True)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    s = s0
    outs = []
    for t in range(9):
        o, s = kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)
        outs.append(o)
    np.testing.assert_allclose(jnp.stack(outs, 1), o_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(s, s_ref, rtol=1e-6, atol=1e-6)


def test_chunked_in_float64_is_exact(rng, x64):
    q, k, v, g, beta, s0 = make_inputs(rng, 100, "lower_bound", init=True, dtype=np.float64)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o, s = kda_chunked(q, k, v, g, beta, initial_state=s0, output_final_state=True, safe_gate=True)
    assert o.dtype == jnp.float64
    assert rel(o, o_ref) <= 1e-12 and rel(s, s_ref) <= 1e-12

    def loss(fn, *a):  # cotangents on both the outputs and the final state, in float64 throughout
        o, s = fn(*a[:5], initial_state=a[5], output_final_state=True)
        return jnp.sum(o * o) + jnp.sum(s * s)

    chunked = lambda *a, **kw: kda_chunked(*a, **kw, safe_gate=True)  # noqa: E731
    g_ref = jax.grad(lambda *a: loss(kda_recurrent, *a), argnums=tuple(range(6)))(q, k, v, g, beta, s0)
    g_chk = jax.grad(lambda *a: loss(chunked, *a), argnums=tuple(range(6)))(q, k, v, g, beta, s0)
    for name, a, b in zip("q k v g beta s0".split(), g_chk, g_ref):
        assert a.dtype == jnp.float64 and rel(a, b) <= 1e-10, name


def test_causal_conv_matches_numpy_and_carries_state(rng):
    B, T, C, W = 2, 11, 5, 4
    x = rng.normal(size=(B, T, C)).astype(np.float32)
    w = rng.normal(size=(C, W)).astype(np.float32)
    y, st = causal_conv1d(jnp.asarray(x), jnp.asarray(w), activation=None)
    xp = np.concatenate([np.zeros((B, W - 1, C), np.float32), x], 1)
    ref = np.stack([sum(w[:, j] * xp[:, t + j] for j in range(W)) for t in range(T)], 1)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(st, x[:, -(W - 1):])
    y1, s1 = causal_conv1d(jnp.asarray(x[:, :6]), jnp.asarray(w))
    y2, _ = causal_conv1d(jnp.asarray(x[:, 6:]), jnp.asarray(w), s1)
    yfull, _ = causal_conv1d(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(jnp.concatenate([y1, y2], 1), yfull, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("activation", ["silu", None])
def test_causal_conv_backward_matches_torch_and_autodiff(rng, activation):
    # causal_conv1d's hand-written backward against torch's depthwise conv1d + silu (values and gradients of x and
    # the weight, from a zero window) and against autodiff of the plain definition (causal_conv1d_reference) with
    # a carried window and document resets (gradients of x, weight and window)
    import torch

    B, T, C, W = 2, 13, 6, 4
    x = rng.normal(size=(B, T, C)).astype(np.float32)
    w = rng.normal(size=(C, W)).astype(np.float32)
    st = rng.normal(size=(B, W - 1, C)).astype(np.float32)
    ct = rng.normal(size=(B, T, C)).astype(np.float32)
    reset = np.zeros((B, T), bool)
    reset[0, 5] = reset[1, 1] = reset[1, 2] = reset[1, 9] = True

    def ours(x_, w_, s_=None, r_=None):
        return jnp.sum(causal_conv1d(x_, w_, s_, activation, r_)[0] * ct)

    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    ty = torch.nn.functional.conv1d(tx.transpose(1, 2), tw[:, None, :], padding=W - 1, groups=C)[..., :T]
    ty = (torch.nn.functional.silu(ty) if activation else ty).transpose(1, 2)
    (ty * torch.tensor(ct)).sum().backward()
    y = causal_conv1d(jnp.asarray(x), jnp.asarray(w), activation=activation)[0]
    np.testing.assert_allclose(np.asarray(y), ty.detach().numpy(), rtol=1e-5, atol=1e-5)
    gx, gw = jax.grad(ours, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(gx), tx.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gw), tw.grad.numpy(), rtol=1e-5, atol=1e-5)

    for n in (T, 2):                  # and a chunk shorter than the window (its gradient reaches every tap)
        ct_n = ct[:, :n]

        def ours_n(x_, w_, s_, r_):
            y_, s2 = causal_conv1d(x_, w_, s_, activation, r_)
            return jnp.sum(y_ * ct_n) + 0.5 * jnp.sum(s2)          # the new window's cotangent too

        def ref_n(x_, w_, s_, r_):
            y_, s2 = causal_conv1d_reference(x_, w_, s_, activation, r_)
            return jnp.sum(y_ * ct_n) + 0.5 * jnp.sum(s2)

        args = (jnp.asarray(x[:, :n]), jnp.asarray(w), jnp.asarray(st), jnp.asarray(reset[:, :n]))
        got = jax.grad(ours_n, argnums=(0, 1, 2))(*args)
        want = jax.grad(ref_n, argnums=(0, 1, 2))(*args)
        for name, a, b in zip(("x", "weight", "window"), got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=f"{name} T={n}")
        assert float(jnp.max(jnp.abs(got[2]))) > 0                # the window's gradient is exercised


def test_replay_of_each_prefix_equals_fla(rng):
    """Speculative replay: the state after the first n of T recorded tokens (n different per row, every n from 0 to
    T) equals fla's ``naive_recurrent_kda`` run over exactly those n tokens from the same initial state."""
    import torch

    T = 5
    q, k, v, g, beta, s0 = make_inputs(rng, T, "lower_bound", B=T + 1, init=True)
    n = np.arange(T + 1, dtype=np.int32)                          # row b keeps b tokens
    got = kda_replay(s0, k, v, g, beta, jnp.asarray(n))
    t = lambda x: torch.from_numpy(np.array(x, np.float32))  # noqa: E731
    for b in range(T + 1):
        want = np.array(s0[b])
        if n[b]:
            _, S = fla_naive().naive_recurrent_kda(*(t(a[b:b + 1, :n[b]]) for a in (q, k, v, g, beta)),
                                                   initial_state=t(s0[b:b + 1]), output_final_state=True)
            want = S.numpy()[0]
        assert rel(got[b], jnp.asarray(want)) < 1e-5, b
    with pytest.raises(ValueError, match="kda_replay"):
        kda_replay(s0, k, v, g, beta, jnp.zeros((2,), jnp.int32))


def test_conv_window_advance_keeps_the_last_inputs(rng):
    B, T, C, W = 3, 4, 5, 4
    win = rng.normal(size=(B, W - 1, C)).astype(np.float32)
    x = rng.normal(size=(B, T, C)).astype(np.float32)
    n = np.array([0, 1, 4], np.int32)
    got = np.asarray(conv_window_advance(jnp.asarray(win), jnp.asarray(x), jnp.asarray(n)))
    for b in range(B):
        np.testing.assert_array_equal(got[b], np.concatenate([win[b], x[b, :n[b]]])[-(W - 1):])
    _, full = causal_conv1d(jnp.asarray(x), jnp.asarray(rng.normal(size=(C, W)), jnp.float32), jnp.asarray(win))
    np.testing.assert_array_equal(got[2], np.asarray(full)[2])       # all T kept: the conv's own new window


def test_bad_shapes_are_named():
    z = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match=r"beta must be \[B, T, H\]"):
        kda_chunked(z, z, z, z, jnp.zeros((1, 4)))
    with pytest.raises(ValueError, match=r"initial_state must be \[B, H, K, V\]"):
        kda_recurrent(z, z, z, z, jnp.zeros((1, 4, 2)), initial_state=jnp.zeros((1, 2, 8)))


def test_document_resets(rng):
    """reset zeroes the state before a token: a document equals itself run alone (the recurrence and the short
    conv; the chunked implementations equal the recurrence with resets in the conformance test)."""
    q, k, v, g, beta, s0 = make_inputs(rng, 150, "softplus", init=True)
    reset = jnp.zeros((2, 150), bool).at[0, 40].set(True).at[0, 64].set(True).at[1, 100].set(True)
    o, s = kda_recurrent(q, k, v, g, beta, initial_state=s0, output_final_state=True, reset=reset)
    alone, s_alone = kda_recurrent(q[:1, 64:], k[:1, 64:], v[:1, 64:], g[:1, 64:], beta[:1, 64:],
                                   output_final_state=True)
    assert rel(o[:1, 64:], alone) <= 1e-6 and rel(s[:1], s_alone) <= 1e-6
    x = jnp.asarray(rng.normal(size=(2, 150, 6)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
    y, _ = causal_conv1d(x, w, reset=reset)
    y_alone, _ = causal_conv1d(x[:1, 64:], w)
    np.testing.assert_allclose(y[:1, 64:], y_alone, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------- the registered implementations: one conformance test
PRODUCTION = [("fused", 32), ("scan", 64)]   # (implementation, chunk): the CPU default and the accelerator default


@functools.cache
def fla_naive():
    return fla_naive_module()


def fla_by_documents(fla, q, k, v, g, beta, s0, reset):
    """fla's ``naive_recurrent_kda`` run document by document (it has no resets): ``(o, final state)``."""
    import torch

    t = lambda x: torch.from_numpy(np.array(x, np.float32))  # noqa: E731
    outs, states = [], []
    for b in range(q.shape[0]):
        starts = np.flatnonzero(np.asarray(reset[b])).tolist()
        cuts = sorted({0, *starts, q.shape[1]})
        S, o_b = (None if 0 in starts else t(s0[b:b + 1])), []
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            x = [t(a[b:b + 1, lo:hi]) for a in (q, k, v, g, beta)]
            o, S = fla.naive_recurrent_kda(*x, initial_state=S if lo == 0 else None, output_final_state=True)
            o_b.append(o.numpy())
        outs.append(np.concatenate(o_b, axis=1))
        states.append(S.numpy())
    return np.concatenate(outs), np.concatenate(states)


def conformance_case(gate, T, B, H, K=16, V=8, seed=0):
    """Inputs with an initial state, resets (one on a 32/64 chunk boundary, others inside chunks) and cotangents
    for o and the final state."""
    rng = np.random.default_rng(seed)
    q, k, v, g, beta, s0 = make_inputs(rng, T, gate, B=B, H=H, K=K, V=V, init=True)
    reset = jnp.zeros((B, T), bool).at[0, 30].set(True).at[0, 64].set(True).at[-1, 45].set(True)
    w = jnp.asarray(rng.normal(size=v.shape), jnp.float32)
    ws = jnp.asarray(rng.normal(size=s0.shape), jnp.float32)
    return (q, k, v, g, beta, s0), reset, w, ws


def values_and_grads(fn, args, reset, w, ws):
    """``(o, S, gradients w.r.t. q, k, v, g, β, S₀)`` of ``Σ o·w + Σ S·ws``, in one compiled call."""
    def loss(*a):
        o, s = fn(*a[:5], initial_state=a[5], output_final_state=True, reset=reset)
        return jnp.sum(o * w) + jnp.sum(s * ws), (o, s)

    (_, (o, s)), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(*args)
    return o, s, grads


@functools.cache
def recurrent_reference(gate, T, B, H):
    args, reset, w, ws = conformance_case(gate, T, B, H)
    return values_and_grads(kda_recurrent, args, reset, w, ws)


def assert_matches(got, ref, tol=1e-5, grad_tol=1e-4):
    (o, s, grads), (o_ref, s_ref, g_ref) = got, ref
    assert rel(o, o_ref) <= tol and rel(s, s_ref) <= tol, (rel(o, o_ref), rel(s, s_ref))
    for name, a, b in zip("q k v g beta s0".split(), grads, g_ref):
        assert rel(a, b) <= grad_tol, (name, rel(a, b))


def test_production_list_covers_every_registered_implementation():
    assert sorted(i for i, _ in PRODUCTION) == sorted(KDA_CHUNKED_IMPLS)


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
@pytest.mark.parametrize("impl,chunk", PRODUCTION)
def test_chunked_implementation_conformance(impl, chunk, gate):
    """Each registered implementation (on CPU too, the accelerator default included) against ``kda_recurrent`` —
    outputs, final state and the gradients of all six inputs, with an initial state and document resets — and
    against fla's ``naive_recurrent_kda`` (run document by document). B·H = 8 pairs and T = 90: the fused path
    runs two blocks of two 32-token chunks (the last padded), the separate-pass path two 64-token chunks."""
    B, H, T = 2, 4, 90
    args, reset, w, ws = conformance_case(gate, T, B, H)
    run = functools.partial(kda_chunked, impl=impl, chunk_size=chunk, safe_gate=gate == "lower_bound")
    got = values_and_grads(run, args, reset, w, ws)
    assert got[0].shape == args[2].shape and got[1].shape == args[5].shape
    assert_matches(got, recurrent_reference(gate, T, B, H))
    fla = fla_naive()
    o_fla, s_fla = fla_by_documents(fla, *args, reset)
    assert rel(got[0], o_fla) <= 1e-5 and rel(got[1], s_fla) <= 1e-5


# ------------------------------------------------------------------ benchmark variants (benchmarks/kda_variants.py)
VARIANT_CASES = [dict(solve="neumann", scan="associative"), dict(solve="rowscan", cumsum="native"),
                 dict(impl="fused", block=5, intra_vjp="autodiff"), dict(impl="scan", block=5, intra_vjp="autodiff"),
                 dict(recompute=False), dict(chunk_size=16, sub_chunk=8, safe_gate=False)]


@pytest.mark.parametrize("kw", VARIANT_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_benchmark_variants_match_recurrent(kw):
    """The variants ``benchmarks/kda.py`` times are the same recurrence: values, final state and gradients on the
    conformance test's lower-bound-gate inputs, two stage swaps per compile where they are independent. ``block=5``
    runs the fused path one chunk a step (B·H = 8 pairs a chunk) and the separate-pass intra pass in ``lax.map``
    blocks of 5 pairs (24 pairs, the last block padded)."""
    from benchmarks.kda_variants import kda_variant

    B, H, T = 2, 4, 90
    args, reset, w, ws = conformance_case("lower_bound", T, B, H)
    run = functools.partial(kda_variant, **{"chunk_size": 32, "safe_gate": True, **kw})
    assert_matches(values_and_grads(run, args, reset, w, ws), recurrent_reference("lower_bound", T, B, H))


def test_benchmark_variant_names_are_checked():
    from benchmarks.kda_variants import kda_variant

    z = jnp.zeros((1, 32, 1, 8))
    with pytest.raises(ValueError, match=r"solve must be one of \('neumann', 'rowscan'\) or None, got 'lu'"):
        kda_variant(z, z, z, z, jnp.zeros((1, 32, 1)), solve="lu")
    with pytest.raises(ValueError, match=r"replaces the state scan of impl='scan', not of 'fused'"):
        kda_variant(z, z, z, z, jnp.zeros((1, 32, 1)), impl="fused", scan="associative")


@pytest.mark.parametrize("method", ["blocked", "neumann", "rowscan"])
def test_unit_lower_inverse_matches_numpy(rng, method):
    """The production inverse by blocks and the benchmark variants' ones against LAPACK in fp64."""
    from benchmarks.kda_variants import SOLVES
    from k3jax.ops.unit_lower import unit_lower_inverse

    inverse = unit_lower_inverse if method == "blocked" else SOLVES[method]
    a = np.tril(rng.normal(size=(3, 64, 64)) * 0.15, -1).astype(np.float32)
    ref = np.linalg.inv(a.astype(np.float64) + np.eye(64))                          # LAPACK, fp64
    t = np.asarray(inverse(jnp.asarray(a), 16), np.float64)
    assert float(np.abs(t - ref).max() / np.abs(ref).max()) <= 1e-5
    assert np.all(np.triu(t, 1) == 0) and np.allclose(np.diagonal(t, axis1=1, axis2=2), 1.0)


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_intra_chunk_vjp_equals_autodiff_in_float64(rng, x64, gate):
    """The hand-written VJP of the intra-chunk pass (solve through T, Gram tiles, db = x⊙dx − y⊙dy) against
    ``jax.vjp`` of the same forward, every output given a random cotangent, with a document reset inside a chunk."""
    from k3jax.ops.kda_chunked import _intra_backward, _intra_forward

    q, k, v, g, beta, _ = make_inputs(rng, 64, gate, B=1, H=3, dtype=np.float64)
    flat = lambda x: jnp.moveaxis(x, 2, 1).reshape(6, 32, *x.shape[3:])  # noqa: E731  [pairs, n, ·]
    xs = [flat(x) for x in (q, k, v, g)] + [jnp.moveaxis(beta, 2, 1).reshape(6, 32)]
    reset = jnp.zeros((6, 32), bool).at[1, 9].set(True).at[4, 20].set(True)
    kw = dict(sub=16, safe_gate=gate == "lower_bound")
    outs = jax.eval_shape(lambda *a: _intra_forward(*a, reset, **kw)[0], *xs)
    cts = tuple(jnp.asarray(rng.normal(size=o.shape)) for o in outs)

    @jax.jit                # both sides in one compile (not op by op), in float64 as before
    def vjps(xs, cts):
        _, saved = _intra_forward(*xs, reset, **kw)
        return _intra_backward(saved, cts), jax.vjp(lambda *a: _intra_forward(*a, reset, **kw)[0], *xs)[1](cts)

    for name, a, b in zip("q k v g beta".split(), *vjps(xs, cts)):
        assert a.dtype == jnp.float64 and rel(a, b) <= 1e-11, name


def test_bfloat16_inputs_stay_within_1e2_of_float32(rng):
    """bf16 q, k, v, g, β with fp32 internals: outputs, final state and gradients within 1e-2 relative (max-norm)
    of the fp32 run on the same (bf16-representable) values, and of the fp32 run on the unrounded inputs."""
    q, k, v, g, beta, s0 = make_inputs(rng, 200, "lower_bound", B=1, H=2, K=64, V=64)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v, g, beta)]
    o32, s32 = kda_chunked(q, k, v, g, beta, output_final_state=True, safe_gate=True)
    o16, s16 = kda_chunked(*bf, output_final_state=True, safe_gate=True)
    assert o16.dtype == jnp.bfloat16 and s16.dtype == jnp.float32
    assert rel(o16.astype(jnp.float32), o32) <= 1e-2 and rel(s16, s32) <= 1e-2
    rounded = [x.astype(jnp.float32) for x in bf]
    o_r, _ = kda_chunked(*rounded, output_final_state=True, safe_gate=True)
    assert rel(o16.astype(jnp.float32), o_r) <= 1e-2
    assert rel(o16.astype(jnp.float32), o_r) < rel(o16.astype(jnp.float32), o32) + 1e-2
    loss = lambda *x: jnp.sum(kda_chunked(*x, safe_gate=True)[0].astype(jnp.float32) ** 2)  # noqa: E731
    g32 = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)
    g16 = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(*bf)
    for name, a, b in zip("q k v g beta".split(), g16, g32):
        assert a.dtype == jnp.bfloat16 and rel(a.astype(jnp.float32), b) <= 1e-2, name


def test_bad_settings_are_named():
    z = jnp.zeros((1, 64, 1, 8))
    with pytest.raises(ValueError, match=r"safe_gate needs sub_chunk ≤ 16"):
        kda_chunked(z, z, z, z, jnp.zeros((1, 64, 1)), safe_gate=True, sub_chunk=32)
    with pytest.raises(ValueError, match=r"impl must be one of \('fused', 'scan'\), got 'parallel'"):
        kda_chunked(z, z, z, z, jnp.zeros((1, 64, 1)), impl="parallel")
    with pytest.raises(ValueError, match=r"chunk_size must be a positive multiple of sub_chunk=16; got 24"):
        kda_chunked(z, z, z, z, jnp.zeros((1, 64, 1)), chunk_size=24)
    with pytest.raises(TypeError, match="solve"):
        kda_chunked(z, z, z, z, jnp.zeros((1, 64, 1)), solve="neumann")     # variants live in benchmarks/


@pytest.mark.slow
def test_heads_split_over_two_host_devices_equal_one_device_and_numpy():
    """``k3jax.parallel.heads``: outputs, final state and gradients of the head-split kernel on 2 CPU devices equal
    the one-device kernel's exactly (same code per head), match the float64 NumPy recurrence of the independent
    reference and ``kda_recurrent``'s gradients; bad meshes are named."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    res = subprocess.run([sys.executable, str(Path(__file__).with_name("kda_heads_check.py"))], capture_output=True,
                         text=True, timeout=600, env=device_env(2))
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["devices"] == 2 and out["mesh"] == {"heads": 2}
    assert out["output_split_over"] == ["P(None, None, 'heads')", "P(None, 'heads')"]
    assert out["vs_one_device"] == {"o": 0.0, "S": 0.0}
    assert out["vs_numpy_float64"] <= 1e-5
    assert all(v == 0.0 for v in out["grad_vs_one_device"].values()), out["grad_vs_one_device"]
    assert all(v <= 1e-4 for v in out["grad_vs_recurrent"].values()), out["grad_vs_recurrent"]
    assert "3 heads do not split over 2 devices" in out["errors"]["heads_not_divisible"]
    assert "no 'tensor'" in out["errors"]["no_such_axis"]
    assert out["head_mesh_of_3_heads"] == {"heads": 1}


def test_host_device_flag_adds_the_count_once_and_keeps_other_flags():
    from k3jax.parallel.heads import host_device_flag

    env = {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}
    assert host_device_flag(3, env) == 3
    assert env["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=3"
    assert host_device_flag(5, env) == 3                         # a count already there wins
    assert env["XLA_FLAGS"].count("device_count") == 1
    empty: dict = {}
    assert host_device_flag(None, empty) >= 1 and "device_count=" in empty["XLA_FLAGS"]
