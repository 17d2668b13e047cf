"""KDA layer (spec §4.2): projections, short convs, gates, the KDA recurrence, gated output norm."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import K3Config
from k3jax.nn.cache import KDACache, KDAPending, KDARecord
from k3jax.nn.layers import KeyGen, Proj, TokenGroups, param
from k3jax.ops.kda import (causal_conv1d, conv_window_advance, kda_gate_lower_bound, kda_gate_softplus,
                           kda_recurrent, kda_step)
from k3jax.ops.kda_chunked import kda_chunked
from k3jax.ops.norm import gated_rms_norm, l2_norm
from k3jax.ops.precision import acc_dtype
from k3jax.parallel.context import ContextParallel, causal_conv1d_context_parallel, kda_context_parallel


class KDAttention(nnx.Module):
    """Kimi Delta Attention over ``x [B, T, hidden]`` (already normed) → ``[B, T, hidden]``.

    q/k/v: projection → depthwise causal conv → silu → heads; q, k L2-normed, q·K^(−1/2) (in the kernel);
    γ = gate(f_b(f_a(x)) + dt_bias), β = σ(b(x)); o = KDA(q, k, v, γ, β); o = GN(o, g(x)); out = o_proj(o).

    Token-wise parts (:meth:`token_inputs`, :meth:`output`) and the sequence mixing (:meth:`mix`) are separate
    methods: :meth:`__call__` runs them on one batch, :meth:`forward_groups` the token-wise ones once over several
    row groups' tokens and the mixing per group.
    """

    def __init__(self, cfg: K3Config, *, keys: KeyGen):
        lac = cfg.linear_attn_config
        H, nh, hd, W = cfg.hidden_size, lac.num_heads, lac.head_dim, lac.short_conv_kernel_size
        dt, std = jnp.dtype(cfg.dtype), cfg.initializer_range
        f32 = jnp.promote_types(dt, jnp.float32)  # fp32 parameters of the release (fp64 in reference runs)
        self.num_heads, self.head_dim, self.eps = nh, hd, cfg.rms_norm_eps
        self.gate_kind = cfg.kda_gate
        self.lower_bound = lac.gate_lower_bound
        self.full_rank_gate = bool(lac.use_full_rank_gate)
        P = nh * hd
        proj = functools.partial(Proj, dtype=dt, init_std=std, keys=keys)
        self.q_proj = proj(H, (nh, hd), axes=("embed", "heads", None))
        self.k_proj = proj(H, (nh, hd), axes=("embed", "heads", None))
        self.v_proj = proj(H, (nh, hd), axes=("embed", "heads", None))
        bound = 1.0 / math.sqrt(W)  # PyTorch's default Conv1d init for a depthwise kernel (fan_in = W)
        conv = lambda: param(jax.random.uniform(keys(), (P, W), f32, -bound, bound), ("heads", None))  # noqa: E731
        self.q_conv1d, self.k_conv1d, self.v_conv1d = conv(), conv(), conv()
        # low-rank gates [hidden, rank] → [rank, heads, head_dim]: Muon takes f_b as one matrix; g_b stays on AdamW
        self.f_a_proj = proj(H, hd, axes=("embed", "gate_rank"))
        self.f_b_proj = proj(hd, (nh, hd), axes=("gate_rank", "heads", None), muon="matrix")
        self.A_log = param(jnp.log(jax.random.uniform(keys(), (nh,), f32, 1.0, 16.0)), ("heads",))
        dt0 = jnp.exp(jax.random.uniform(keys(), (nh, hd), f32, math.log(1e-3), math.log(1e-1)))
        dt0 = jnp.maximum(dt0, 1e-4)
        self.dt_bias = param(dt0 + jnp.log(-jnp.expm1(-dt0)), ("heads", None))  # softplus⁻¹(dt)
        self.b_proj = proj(H, nh, axes=("embed", "heads"), muon="matrix")
        if self.full_rank_gate:
            self.g_proj = proj(H, (nh, hd), axes=("embed", "heads", None))
        else:
            self.g_a_proj = proj(H, hd, axes=("embed", "gate_rank"))
            self.g_b_proj = proj(hd, (nh, hd), axes=("gate_rank", "heads", None), muon=None)
        self.o_norm = param(jnp.ones((hd,), jnp.promote_types(dt, jnp.float32)), (None,))
        self.o_proj = proj((nh, hd), H, axes=("heads", None, "embed"))

    def gate(self, x: jax.Array) -> jax.Array:
        """Activated log-decay γ ``[B, T, nh, hd]`` (fp32)."""
        f = self.f_b_proj(self.f_a_proj(x))
        if self.gate_kind == "lower_bound":
            return kda_gate_lower_bound(f, self.dt_bias[...], self.A_log[...], self.lower_bound)
        return kda_gate_softplus(f, self.dt_bias[...], self.A_log[...])

    def conv(self, w: nnx.Param, u: jax.Array, window: jax.Array | None, reset: jax.Array | None,
             cp: ContextParallel | None = None) -> jax.Array:
        """Depthwise causal conv of projected inputs ``u [B, T, P]`` (continuing ``window [B, W−1, P]`` when given)
        → silu, as heads ``[B, T, nh, hd]``. ``cp``: time split over a context axis (no window; the halo comes from
        the previous rank)."""
        B, T, _ = u.shape
        if cp is not None:
            return causal_conv1d_context_parallel(u, w[...], cp, reset).reshape(B, T, self.num_heads, self.head_dim)
        y, _ = causal_conv1d(u, w[...], state=window, reset=reset)
        return y.reshape(B, T, self.num_heads, self.head_dim)

    def conv_branch(self, proj: Proj, w: nnx.Param, x: jax.Array, window: jax.Array | None,
                    reset: jax.Array | None, cp: ContextParallel | None = None) -> tuple[jax.Array, jax.Array]:
        """Projection → :meth:`conv` as heads ``[B, T, nh, hd]``; also the projected inputs ``[B, T, P]`` (what the
        next conv window is made of)."""
        B, T, _ = x.shape
        u = proj(x).reshape(B, T, self.num_heads * self.head_dim)
        return self.conv(w, u, window, reset, cp), u

    def token_inputs(self, x: jax.Array) -> tuple[tuple[jax.Array, jax.Array, jax.Array], jax.Array, jax.Array]:
        """The token-wise part before the mixing, ``x [.., T, hidden]`` → the conv inputs ``(u_q, u_k, u_v)``
        ``[.., T, P]`` (P = nh·hd), the log-decay γ ``[.., T, nh, hd]`` and β = σ(b(x)) ``[.., T, nh]`` (fp32)."""
        u = tuple(p(x).reshape(*x.shape[:-1], self.num_heads * self.head_dim)
                  for p in (self.q_proj, self.k_proj, self.v_proj))
        return u, self.gate(x), jax.nn.sigmoid(self.b_proj(x).astype(acc_dtype(x)))

    def mix(self, u: tuple[jax.Array, jax.Array, jax.Array], g: jax.Array, beta: jax.Array, *,
            cache: KDACache | None, n_new: jax.Array | None, reset: jax.Array | None = None, kernel: str = "chunked",
            record: bool = False, cp: ContextParallel | None = None
            ) -> tuple[jax.Array, KDACache | KDAPending | None]:
        """The sequence mixing of one row group, from :meth:`token_inputs` ``[B, T, ..]``: the short convs (from the
        cache's windows), q, k L2-normed, padding (t ≥ ``n_new[b]``) masked to γ = 0, β = 0, then the recurrence
        o = KDA(q, k, v, γ, β) ``[B, T, nh, hd]`` and the new cache (see :meth:`__call__`; ``cp`` already resolved,
        ``n_new`` given with a cache)."""
        T = g.shape[1]
        windows = (None, None, None) if cache is None else cache.windows
        q, k, v = (self.conv(w, x, win, reset, cp)
                   for w, x, win in zip((self.q_conv1d, self.k_conv1d, self.v_conv1d), u, windows))
        q, k = l2_norm(q), l2_norm(k)
        S0 = None
        if cache is not None:
            valid = jnp.arange(T)[None, :] < n_new[:, None]                              # [B, T]
            g = jnp.where(valid[..., None, None], g, 0.0)
            beta = jnp.where(valid[..., None], beta, 0.0)
            S0 = cache.state
        want_state = cache is not None and not record
        if kernel == "recurrent" or (record and T > 1):
            o, S = kda_recurrent(q, k, v, g, beta, initial_state=S0, output_final_state=want_state, reset=reset)
        elif T == 1 and S0 is not None and reset is None:
            o, S = kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S0)
            o = o[:, None]
        elif cp is not None:
            o, S = kda_context_parallel(q, k, v, g, beta, cp, safe_gate=self.gate_kind == "lower_bound",
                                        reset=reset)
        else:
            o, S = kda_chunked(q, k, v, g, beta, initial_state=S0, output_final_state=want_state,
                               safe_gate=self.gate_kind == "lower_bound", reset=reset)
        if cache is None:
            new = None
        elif record:
            new = KDAPending(cache, KDARecord(k, v, g, beta, *u))
        else:
            new = KDACache(S, *(conv_window_advance(w, x, n_new) for w, x in zip(windows, u)))
        return o, new

    def output(self, o: jax.Array, x: jax.Array) -> jax.Array:
        """After the mixing, token-wise: ``o [.., T, nh, hd]`` → GN(o, g(x)) → o_proj, ``[.., T, hidden]``."""
        gate = self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        return self.o_proj(gated_rms_norm(o.astype(x.dtype), gate, self.o_norm[...], self.eps))

    def __call__(self, x: jax.Array, *, cache: KDACache | None = None, n_new: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, kernel: str = "chunked", record: bool = False,
                 cp: ContextParallel | None = None) -> tuple[jax.Array, KDACache | KDAPending | None]:
        """``x [B, T, hidden]`` → ``(y [B, T, hidden], new cache or None)``.

        Without a cache: the whole sequence from a zero state (training / one-shot prefill). With ``cache``
        (:class:`KDACache`): continue each slot's state and conv windows; only the first ``n_new[b]`` tokens of
        row b are real — padding leaves the state alone (decay 0 and β = 0 there; the window keeps the last W−1
        real inputs). T = 1 with a cache runs :func:`kda_step`. ``segment_ids [B, T]``: packed documents; state
        and conv windows restart where the id changes. ``kernel``: ``"chunked"`` or ``"recurrent"`` (reference).

        ``record=True`` (speculative verification, needs ``cache``): the outputs of all T tokens, but the cache
        comes back as a :class:`KDAPending` — the state and windows *before* the chunk and the chunk's per-token
        inputs (:class:`KDARecord`), from which :meth:`KDAPending.accept` rebuilds the state after any prefix of
        it, instead of a state per position. The outputs come from the token-by-token recurrence (T is a draft
        length + 1), the same arithmetic as decode.

        ``cp`` (:class:`~k3jax.parallel.context.ContextParallel`, without a cache): time split over the mesh's
        context axis — conv halos by ``ppermute``, the recurrence by per-rank affine summaries.
        """
        B, T, _ = x.shape
        if kernel not in ("chunked", "recurrent"):
            raise ValueError(f"kernel: expected 'chunked' or 'recurrent', got {kernel!r}")
        if record and (cache is None or segment_ids is not None):
            raise ValueError("record: needs a cache and no segment_ids (it verifies a continuation of each slot)")
        if cache is not None and n_new is None:
            n_new = jnp.full((B,), T, jnp.int32)
        reset = None
        if segment_ids is not None:
            reset = jnp.concatenate([jnp.zeros((B, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
        if cp is not None and (cache is not None or kernel != "chunked" or not cp.active):
            cp = None                        # decode / reference kernels / a context axis of one: no split
        u, g, beta = self.token_inputs(x)
        o, new = self.mix(u, g, beta, cache=cache, n_new=n_new, reset=reset, kernel=kernel, record=record, cp=cp)
        return self.output(o, x), new

    def forward_groups(self, x: jax.Array, groups: TokenGroups, caches: tuple[KDACache, ...],
                       n_new: tuple[jax.Array, ...], record: tuple[bool, ...]
                       ) -> tuple[jax.Array, tuple[KDACache | KDAPending, ...]]:
        """Several row groups in one call: ``x [1, N, hidden]`` holds every group's tokens (:class:`TokenGroups`);
        the projections, gates and output run once on all N tokens, the mixing (:meth:`mix`) per group on
        ``[B_g, T_g, ..]`` with ``caches[g]``, ``n_new[g] [B_g]`` and ``record[g]`` as :meth:`__call__` with a
        cache does. Returns ``(y [1, N, hidden], the groups' new caches)``."""
        u, g, beta = self.token_inputs(x)
        outs, new = [], []
        for i, (c, n, r) in enumerate(zip(caches, n_new, record, strict=True)):
            o, c = self.mix(tuple(groups.part(a, i) for a in u), groups.part(g, i), groups.part(beta, i),
                            cache=c, n_new=n, record=r)
            outs.append(o)
            new.append(c)
        return self.output(groups.join(outs), x), tuple(new)
