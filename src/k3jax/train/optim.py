"""Per-Head Muon for matrices (``optax.contrib.muon``'s update, Newton–Schulz run on each parameter's own axes) +
AdamW for everything else; LR schedules; clipping.

Muon orthogonalises each matrix's update. Which parameters are matrices, and how, is metadata set where each
parameter is created (:mod:`k3jax.nn.layers`): ``var.muon`` is None (AdamW), ``"matrix"`` (the first
``var.fan_in`` axes are the input) or ``"batched"`` (axes named ``heads`` / ``experts`` in ``var.axes`` are batch
axes). Attention projections keep a separate heads axis — KDA/MLA q, k, v, g ``[in, heads, head_dim]``,
o ``[heads, head_dim, out]``, MLA q_b/kv_b ``[rank, heads, d]`` — so ``MuonDimensionNumbers`` names only the
reduction and output axes and Newton–Schulz runs per head; routed experts ``[E, in, out]`` per expert; a stacked
run's leading ``layers`` axis (:mod:`k3jax.nn.scan`) is a batch axis too, one matrix per layer as unrolled. Updates
are scaled to Moonlight's RMS (``consistent_rms=0.2``: 0.2·√max(fan_in, fan_out)). AdamW takes embeddings, the
head, norms and gains, AttnRes vectors, conv kernels, A_log, dt_bias. Weight decay is decoupled for both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers as MDN

from k3jax.nn.scan import RUN_AXIS

BATCH_AXES = ("heads", "experts")


def muon_dims(var) -> MDN | None:
    """The Muon dimension numbers of a parameter (an ``nnx.Variable`` with ``axes`` / ``muon`` / ``fan_in``
    metadata), or None for AdamW."""
    kind = getattr(var, "muon", None)
    if kind is None:
        return None
    axes = tuple(var.axes)
    fan_in = int(getattr(var, "fan_in", 1))
    batch = {i for i, a in enumerate(axes) if a in BATCH_AXES} if kind == "batched" else set()
    batch |= {i for i, a in enumerate(axes) if a == RUN_AXIS}        # a stacked run: one matrix per layer
    red = tuple(i for i in range(fan_in) if i not in batch)
    out = tuple(i for i in range(fan_in, len(axes)) if i not in batch)
    if not red or not out:
        raise ValueError(f"muon: a {kind} parameter with axes {axes} (fan_in {fan_in}) has no matrix")
    one = lambda t: t[0] if len(t) == 1 else t  # noqa: E731
    return MDN(reduction_axis=one(red), output_axis=one(out))


def muon_dims_tree(state) -> dict:
    """``MuonDimensionNumbers`` (or None) for every parameter of an ``nnx.State``, nested like its pure dict."""
    from k3jax.parallel.rules import metadata_tree

    return metadata_tree(state, muon_dims)


@dataclass
class OptimConfig:
    lr: float = 2e-2                   # Muon learning rate
    adam_lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 20
    schedule: str = "cosine"           # "cosine" | "wsd" | "constant"
    decay_fraction: float = 0.2        # WSD: final fraction of steps spent decaying
    min_lr_ratio: float = 0.1
    clip_norm: float = 1.0
    consistent_rms: float = 0.2
    # Newton–Schulz operands: "bf16" (products accumulated in fp32, as Muon's and Moonlight's reference
    # implementations run it; on an AMX CPU 2× faster for the 100m preset) | "fp32" (optax.contrib.muon's iteration)
    ns_dtype: str = "bf16"


def schedule(peak: float, steps: int, c: OptimConfig) -> optax.Schedule:
    warm = max(0, min(c.warmup_steps, steps - 1))
    end = peak * c.min_lr_ratio
    if c.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warm, max(steps, warm + 1), end)
    if c.schedule == "wsd":
        decay = max(1, int(steps * c.decay_fraction))
        stable = max(0, steps - warm - decay)
        return optax.join_schedules([optax.linear_schedule(0.0, peak, warm) if warm else optax.constant_schedule(peak),
                                     optax.constant_schedule(peak), optax.linear_schedule(peak, end, decay)],
                                    [warm, warm + stable])
    if c.schedule == "constant":
        if not warm:
            return optax.constant_schedule(peak)
        return optax.join_schedules([optax.linear_schedule(0.0, peak, warm), optax.constant_schedule(peak)], [warm])
    raise ValueError(f"schedule: expected 'cosine', 'wsd' or 'constant', got {c.schedule!r}")


def make_optimizer(dims, steps: int, c: OptimConfig) -> optax.GradientTransformation:
    """Clip by global norm, then Muon / AdamW by parameter: ``dims`` is :func:`muon_dims_tree` of the parameters
    (a pure dict of ``MuonDimensionNumbers`` or None, the parameters' structure).

    Newton–Schulz runs on each parameter's own axes (:func:`make_blockwise_optimizer` without layout plans): the
    update and the state tree of :func:`make_reference_optimizer` (optax's Muon), without its transposes to and
    from a batch of matrices and its unrolled iterations — the 100m preset's update 5.1 → 2.9 s on 2 CPU cores
    (``benchmarks.step_profile``)."""
    if c.ns_dtype not in NS_DTYPES:
        raise ValueError(f"optim.ns_dtype: expected one of {', '.join(NS_DTYPES)}, got {c.ns_dtype!r}")
    return make_blockwise_optimizer(dims, steps, c)


def make_reference_optimizer(dims, steps: int, c: OptimConfig) -> optax.GradientTransformation:
    """The optimizer of :func:`make_optimizer` built from ``optax.contrib.muon`` (fp32 Newton–Schulz): the
    independent reference its updates are tested against."""
    muon = optax.contrib.muon(
        learning_rate=schedule(c.lr, steps, c), weight_decay=c.weight_decay,
        adam_learning_rate=schedule(c.adam_lr, steps, c), adam_weight_decay=c.weight_decay,
        muon_weight_dimension_numbers=lambda _: dims, consistent_rms=c.consistent_rms)
    return optax.chain(optax.clip_by_global_norm(c.clip_norm), muon)


# ------------------------------------------------------------------------- Per-Head Muon over a sharded mesh
NS_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
NS_COEFFS = (3.4445, -4.7750, 2.0315)       # the quintic Newton–Schulz coefficients optax.contrib.muon defaults to


def matrix_axes(dims: MDN, ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``dims``' reduction and output axes as tuples of non-negative axis indices of an ``ndim``-d array."""
    def norm(a):
        return tuple(i % ndim for i in ((a,) if isinstance(a, int) else a))
    return norm(dims.reduction_axis), norm(dims.output_axis)


def newton_schulz(x: jax.Array, dims: MDN, steps: int = 5, coeffs=NS_COEFFS, eps: float = 1e-8, *,
                  shape: tuple[int, ...] | None = None, gram_axes: tuple[str, ...] = (),
                  dtype=None) -> jax.Array:
    """Orthogonalise every matrix of ``x`` (axes not in ``dims`` are batch axes).

    Per batch entry ``X`` [r, c] — the smaller side's axes as rows, so ``A = X Xᵀ`` is the small Gram matrix —
    scaled to unit Frobenius norm, then ``steps`` times ``X ← a X + (b A + c A²) X``: the iteration of
    ``optax.contrib.muon``. ``x`` is laid out as ``[batch, r, c]`` for the iteration (a local transpose), so every
    product contracts row-major operands as XLA's GEMMs want them (on an AMX CPU a bf16 Gram over the leading axis
    ran at 475 GFLOP/s against 1,060 in this layout for the 100m preset's [1024, 512] matrices).

    Inside ``shard_map`` with the larger side split over mesh axes ``gram_axes``: ``x`` is this device's columns,
    ``shape`` the global shape (which side is smaller); the squared norm and the Gram matrix are ``psum``-ed over
    ``gram_axes`` (a small matrix per iteration) and every other product is local.

    ``dtype`` (e.g. bf16): the iteration's operands after the fp32 normalisation, every product accumulated in fp32
    and rounded back (as the Muon and Moonlight reference implementations run it); the result is returned in
    ``x``'s dtype."""
    red, out = matrix_axes(dims, x.ndim)
    batch = tuple(i for i in range(x.ndim) if i not in red + out)
    full = tuple(shape) if shape is not None else x.shape
    size = lambda axes, s=full: math.prod(s[i] for i in axes)  # noqa: E731
    total = (lambda v: jax.lax.psum(v, gram_axes)) if gram_axes else (lambda v: v)  # noqa: E731
    rows, cols = (out, red) if size(red) > size(out) else (red, out)       # Gram over the smaller side
    perm = batch + rows + cols
    xt = jnp.transpose(x, perm)
    b, r, c = size(batch, x.shape), size(rows, x.shape), size(cols, x.shape)
    X = xt.reshape(b, r, c)
    in_dtype = x.dtype
    norm = jnp.sqrt(total(jnp.sum(jnp.square(X.astype(jnp.promote_types(in_dtype, jnp.float32))), axis=(1, 2),
                                  keepdims=True)))
    cd = jnp.dtype(dtype or in_dtype)
    X = (X / (norm + eps)).astype(cd)
    acc = jnp.promote_types(cd, jnp.float32)
    a0, a1, a2 = (jnp.asarray(k, acc) for k in coeffs)
    hi = jax.lax.Precision.HIGHEST

    mm = lambda p, q: jnp.matmul(p, q, precision=hi, preferred_element_type=acc)  # noqa: E731

    def iteration(_, X):
        A = total(jnp.einsum("...ik,...jk->...ij", X, X, precision=hi, preferred_element_type=acc)).astype(cd)
        Bm = (a1 * A + a2 * mm(A, A)).astype(cd)                             # b A + c A², A = X Xᵀ
        return (a0 * X + mm(Bm, X)).astype(cd)

    # a loop, not unrolled: a model has dozens of Muon parameters, and unrolled iterations multiply the update's
    # program (and its compile time) by ``steps``
    Y = jax.lax.fori_loop(0, steps, iteration, X[0] if b == 1 else X)
    return jnp.transpose(Y.reshape(xt.shape), tuple(perm.index(i) for i in range(x.ndim))).astype(in_dtype)


def muon_block_axis(dims: MDN, ndim: int) -> int | None:
    """The axis Newton–Schulz batches over — a parameter's first heads/experts axis, the one that is split over
    the devices while each device orthogonalises whole blocks — or None for a single matrix."""
    red, out = matrix_axes(dims, ndim)
    batch = [i for i in range(ndim) if i not in red + out]
    return batch[0] if batch else None


def muon_column_axis(dims: MDN, shape: tuple[int, ...]) -> int:
    """The largest axis of the matrix's larger side (reduction or output axes; the Gram matrix is taken over the
    other): splitting it over devices leaves Newton–Schulz one ``psum`` of the Gram matrix per iteration."""
    red, out = matrix_axes(dims, len(shape))
    side = red if math.prod(shape[i] for i in red) > math.prod(shape[i] for i in out) else out
    return max(side, key=lambda i: shape[i])


def scale_by_blockwise_muon(dims: dict, plans: dict | None, *, beta: float = 0.95, ns_steps: int = 5,
                            eps: float = 1e-8, ns_dtype=None) -> optax.GradientTransformation:
    """Muon's momentum and Newton–Schulz (Nesterov, bias-corrected, as ``optax.contrib.scale_by_muon``) with each
    momentum moved into its whole-block layout before Newton–Schulz and back after it
    (:class:`~k3jax.parallel.blocks.BlockPlan` per parameter, None: Newton–Schulz in the parameter's own layout).
    ``dims``/``plans`` are nested like the updates this branch sees (masked leaves as ``optax.MaskedNode``). The
    state is a ``MuonState`` like optax's."""
    from k3jax.parallel.blocks import apply_in_blocks

    from optax.contrib import MuonState

    def init(params):
        return MuonState(count=jnp.zeros([], jnp.int32), mu=optax.tree.zeros_like(params),
                         ns_coeffs=jnp.asarray(NS_COEFFS))

    def update(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                              optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                              optax.tree.bias_correction(updates, beta, count))

        coeffs = tuple(state.ns_coeffs[i] for i in range(3))

        def one(x, d, plan):
            if plan is None:
                return newton_schulz(x, d, ns_steps, coeffs, eps, dtype=ns_dtype)
            return apply_in_blocks(lambda b: newton_schulz(b, d, ns_steps, coeffs, eps, shape=plan.shape,
                                                           gram_axes=plan.gram_axes, dtype=ns_dtype), x, plan)

        leaf = lambda x: isinstance(x, MDN)  # noqa: E731
        plans_ = plans if plans is not None else jax.tree.map(lambda d: None, dims, is_leaf=leaf)
        out = jax.tree.map(one, mu_hat, dims, plans_, is_leaf=lambda x: leaf(x) or x is None)
        return out, MuonState(count=count, mu=mu, ns_coeffs=state.ns_coeffs)

    return optax.GradientTransformation(init, update)


def make_blockwise_optimizer(dims, steps: int, c: OptimConfig, plans: dict | None = None
                             ) -> optax.GradientTransformation:
    """:func:`make_optimizer` with Muon's Newton–Schulz in whole-block layouts (``plans``: :func:`muon_plans`;
    see :func:`scale_by_blockwise_muon`); the same state tree as :func:`make_optimizer`'s, so checkpoints move
    between the two."""
    leaf = lambda x: x is None or isinstance(x, MDN)  # noqa: E731
    labels = jax.tree.map(lambda d: "adam" if d is None else "muon", dims, is_leaf=leaf)

    def masked(tree):
        return jax.tree.map(lambda d, t: optax.MaskedNode() if d is None else t, dims, tree, is_leaf=leaf)

    mdims = masked(dims)
    mplans = None if plans is None else masked(plans)

    def shape_scale(updates, state, params=None):
        def one(u, d):
            fan_in, fan_out = (math.prod(u.shape[i] for i in ax) for ax in matrix_axes(d, u.ndim))
            return u * (math.sqrt(max(fan_in, fan_out)) * c.consistent_rms)
        return jax.tree.map(one, updates, mdims, is_leaf=lambda x: isinstance(x, MDN)), state

    muon_branch = optax.chain(
        scale_by_blockwise_muon(mdims, mplans, ns_dtype=NS_DTYPES[c.ns_dtype]),
        optax.GradientTransformation(lambda p: optax.EmptyState(), shape_scale),
        optax.add_decayed_weights(c.weight_decay),
        optax.scale_by_learning_rate(schedule(c.lr, steps, c)))
    adam = optax.adamw(schedule(c.adam_lr, steps, c), eps=1e-8, weight_decay=c.weight_decay, nesterov=True)
    inner = optax.partition({"muon": muon_branch, "adam": adam}, labels)
    return optax.chain(optax.clip_by_global_norm(c.clip_norm), inner)


def muon_plans(state, mesh, naive: bool = False) -> dict:
    """Per parameter of an ``nnx.State`` on ``mesh``: the :class:`~k3jax.parallel.blocks.BlockPlan` from its
    logical-axes layout to whole heads/experts spread over the devices (mesh axes left over split the matrix's
    larger side, Newton–Schulz then reducing its Gram matrix over them), for :func:`make_blockwise_optimizer`;
    None for AdamW parameters. ``naive=True``: every Muon parameter gathered whole on every device (the baseline
    this avoids)."""
    from k3jax.parallel.blocks import block_plan
    from k3jax.parallel.rules import metadata_tree, spec_for, variable_axes

    def plan(var):
        d = muon_dims(var)
        if d is None:
            return None
        shape = tuple(var.shape)
        home = spec_for(variable_axes(var), shape, mesh)
        if naive:
            return block_plan(shape, home, None, mesh)
        return block_plan(shape, home, muon_block_axis(d, len(shape)), mesh, cols=muon_column_axis(d, shape))

    return metadata_tree(state, plan)


def muon_partition(state) -> dict[str, list[str]]:
    """Which parameters of an ``nnx.State`` get Muon and which AdamW (dotted paths) — for reports and tests."""
    from flax import nnx

    out: dict[str, list[str]] = {"muon": [], "adamw": []}
    for path, var in nnx.to_flat_state(state):
        out["muon" if muon_dims(var) else "adamw"].append(".".join(map(str, path)))
    return out
