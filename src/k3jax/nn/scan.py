"""Scanned layers: the model's repeated run of decoder layers compiled once, as a ``lax.scan`` over periods.

K3 repeats one unit (KDA, KDA, KDA, gated MLA) 23 times. Unrolled, XLA compiles every layer of the training step,
prefill and decode programs again, so compile time grows with depth (``benchmarks/depth.py``). :func:`scan_plan`
finds the longest run of layers that repeats with a period P in structure (mixer kind, dense/MoE FFN): layers
``start … start + P·repeats − 1``; the model runs the layers before it and after it unrolled and the run as a
``lax.scan`` of ``repeats`` iterations whose body is P layers. For K3 (93 layers) that is P = 4 from layer 1:
layers 1–88 become one body of four layers, and 9 layers are compiled instead of 93.

The run's parameters are **stored stacked**: ``K3Model.run[p]`` is one decoder layer whose variables hold layers
``start + j·P + p`` (j = 0 … repeats − 1) along a new leading axis, the logical axis ``layers`` (:func:`stack_layers`
builds them at construction; the layers outside the run stay in ``K3Model.layers``). So the scan reads its weights
where they live (no copy per call), the gradient and the optimizer state are stacked the same way, Muon treats
the ``layers`` axis as a batch axis (one matrix per layer, as unrolled) and the sharding rules can place it (on the
``stage`` mesh axis under pipeline parallelism). The unrolled forward (``scan_layers=False``) splits the stacks
into per-layer views once per call (:func:`unstack_run`; its gradient is a concatenation). Checkpoints keep the
release's per-layer names: :class:`RunLayout` maps a per-layer variable path ``model.layers.i.…`` to its stored
path and row and converts whole trees both ways (the loaders stack at load, the exports unstack at save). Calls
with a cache (prefill, decode, verification, the grouped serving step) stack the run's layer caches inside the
program and unstack the new ones (caches stay per layer).

Block AttnRes inside the run: a period need not line up with the AttnRes blocks (K3's blocks are 12 layers, its
period 4), so whether layer i seals a block is ``i % block_size == 0`` on the traced layer index, and the blocks
are a :class:`BlockBuffer` — those sealed before the run (a list), a static buffer for the ones sealed in it and
their count. A read masks the buffer's unused rows out of its softmax: their weight is exactly 0, so it equals the
unrolled read of the blocks so far (a read with every row masked is the identity on the partial sum, as at layer
0). The buffer is part of the scan's carry, which a plain scan's backward keeps once per iteration (repeats ×
the run's blocks, each [B, T, hidden]); under a remat policy the run's backward instead keeps each period's input
partial sum and the final blocks once, and recomputes each period (:func:`_periods_recomputed`). Measured in
``benchmarks/depth.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
import jax.numpy as jnp
from flax import nnx

from k3jax.config import K3Config


class ScanPlan(NamedTuple):
    """Layers ``start … start + period·repeats − 1`` run as ``repeats`` scan iterations of ``period`` layers."""
    start: int
    period: int
    repeats: int

    @property
    def stop(self) -> int:
        return self.start + self.period * self.repeats

    def compiled_layers(self, n_layers: int) -> int:
        """How many decoder layers the program contains: the unrolled ones and one period."""
        return n_layers - self.period * (self.repeats - 1)


def layer_signature(cfg: K3Config, i: int) -> tuple:
    """What must agree for two layers to share a scan body: the mixer kind and whether the FFN is MoE."""
    return cfg.layer_types[i], cfg.is_moe_layer(i)


def scan_plan(cfg: K3Config) -> ScanPlan | None:
    """The run of periodic layers that saves the most compiled layers (None when no run repeats): for each period
    P and start s, the longest run with ``signature(i) == signature(i + P)``; fewest compiled layers wins, then the
    longer period (fewer iterations: the carried AttnRes buffer is kept once per iteration)."""
    L = cfg.num_hidden_layers
    sig = [layer_signature(cfg, i) for i in range(L)]
    best: tuple | None = None
    for P in range(1, L // 2 + 1):
        for s in range(0, L - 2 * P + 1):
            m = 1
            while s + (m + 1) * P <= L and all(sig[s + m * P + p] == sig[s + p] for p in range(P)):
                m += 1
            if m < 2:
                continue
            plan = ScanPlan(s, P, m)
            key = (plan.compiled_layers(L), -P, s)
            if best is None or key < best[0]:
                best = (key, plan)
    return None if best is None else best[1]


def scan_pays(cfg: K3Config) -> bool:
    """Whether scanning is the default (``TrainConfig.scan_layers`` unset): a run that leaves at most half the
    layers to compile (K3: 9 of 93; none of the small presets)."""
    plan = scan_plan(cfg)
    return plan is not None and 2 * plan.compiled_layers(cfg.num_hidden_layers) <= cfg.num_hidden_layers


def use_scan(cfg: K3Config, option: bool | None) -> bool:
    """A ``scan_layers`` option resolved for a model: as given, or :func:`scan_pays` when None."""
    return scan_pays(cfg) if option is None else bool(option)


@jax.tree_util.register_pytree_node_class
class BlockBuffer:
    """AttnRes blocks inside a scanned run: ``pre`` (sealed before the run, a list), ``buf [n, ...]`` (rows for
    the blocks sealed in the run) and ``count`` (how many rows hold one). ``pre_valid [len(pre)]`` (bool, optional):
    which of ``pre`` are blocks — a pipeline stage (:mod:`k3jax.nn.pipeline`) receives a static number of
    rows from the stages before it, of which only those stages' sealed blocks count."""

    def __init__(self, pre: list[jax.Array], buf: jax.Array, count: jax.Array, pre_valid: jax.Array | None = None):
        self.pre, self.buf, self.count, self.pre_valid = list(pre), buf, count, pre_valid

    def tree_flatten(self):
        return (self.pre, self.buf, self.count, self.pre_valid), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    def __bool__(self) -> bool:      # a read always runs (masked rows make it the identity when there are none)
        return True

    def candidates(self) -> tuple[list[jax.Array], jax.Array]:
        """Every block row (the unused ones too) and which rows are blocks: ``[K]`` bool."""
        n = self.buf.shape[0]
        rows = list(self.pre) + [self.buf[r] for r in range(n)]
        pre = jnp.ones((len(self.pre),), bool) if self.pre_valid is None else self.pre_valid
        return rows, jnp.concatenate([pre, jnp.arange(n) < self.count])

    def seal(self, p: jax.Array, sealed: jax.Array) -> "BlockBuffer":
        """``p`` appended as the next block where ``sealed`` (a traced bool), else unchanged."""
        i = jnp.minimum(self.count, self.buf.shape[0] - 1)
        row = jnp.where(sealed, p.astype(self.buf.dtype), self.buf[i])
        return BlockBuffer(self.pre, jax.lax.dynamic_update_index_in_dim(self.buf, row, i, 0),
                           self.count + sealed.astype(self.count.dtype), self.pre_valid)

    def blocks(self) -> list[jax.Array]:
        """After the run: every block as a list (all rows are sealed by then)."""
        return list(self.pre) + [self.buf[r] for r in range(self.buf.shape[0])]


def seals_in(cfg: K3Config, plan: ScanPlan) -> int:
    """How many AttnRes blocks the run's layers seal."""
    bs = cfg.attn_res_block_size
    return sum(1 for i in range(plan.start, plan.stop) if i % bs == 0)


RUN_AXIS = "layers"          # the logical axis of the run's stacked variables


def stack_layers(layers: list, plan: ScanPlan) -> list:
    """The run's layers as ``plan.period`` stacked modules (construction): module p is layer ``start + p``'s with
    every variable holding layers ``start + j·P + p`` stacked ``[repeats, ...]``, its logical axes prefixed by
    ``layers`` and a Muon matrix's ``fan_in`` shifted past it."""
    out = []
    for p in range(plan.period):
        parts = [nnx.split(layers[plan.start + j * plan.period + p]) for j in range(plan.repeats)]
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *[s for _, s in parts])
        for _, var in nnx.to_flat_state(stacked):
            meta = {}
            if getattr(var, "axes", None) is not None:
                meta["axes"] = (RUN_AXIS,) + tuple(var.axes)
            if getattr(var, "muon", None) is not None:
                meta["fan_in"] = int(var.fan_in) + 1
            if meta:
                var.set_metadata(**meta)
        out.append(nnx.merge(parts[0][0], stacked))
    return out


def run_states(run) -> tuple[list, list]:
    """Per period position p: the graph of ``run[p]`` and its stacked state ``[repeats, ...]``."""
    parts = [nnx.split(m) for m in run]
    return [g for g, _ in parts], [s for _, s in parts]


def unstack_run(run, plan: ScanPlan, only: int | None = None) -> dict[int, nnx.Module]:
    """The run's layers as per-layer modules (layer number → module; the unrolled forward): each stack split once
    (``jnp.split``, whose transpose concatenates the gradients), each view's ``idx`` its layer number. ``only``: just
    that layer (one row sliced). The views are copies: write to the stored stacks (e.g.
    :meth:`K3ForCausalLM.set_router_biases`), not to them."""
    out = {}
    for p, module in enumerate(run):
        rows = [j for j in range(plan.repeats) if only is None or only == plan.start + j * plan.period + p]
        if not rows:
            continue
        graph, state = nnx.split(module)
        leaves, treedef = jax.tree.flatten(state)
        if only is None:
            pieces = [[jnp.squeeze(a, 0) for a in jnp.split(x, plan.repeats, axis=0)] for x in leaves]
        else:
            pieces = [{rows[0]: x[rows[0]]} for x in leaves]
        for j in rows:
            layer = nnx.merge(graph, _own_metadata(jax.tree.unflatten(treedef, [ps[j] for ps in pieces])))
            layer.idx = plan.start + j * plan.period + p
            out[layer.idx] = layer
    return out


def _own_metadata(row):
    """A row of a stacked state with each variable's own metadata (the stacked axis dropped)."""
    for _, var in nnx.to_flat_state(row):
        if getattr(var, "axes", None) is not None and tuple(var.axes[:1]) == (RUN_AXIS,):
            meta = {"axes": tuple(var.axes[1:])}
            if getattr(var, "muon", None) is not None:
                meta["fan_in"] = int(var.fan_in) - 1
            var.set_metadata(**meta)
    return row


class RunLayout:
    """Where a layer's variables are stored. A per-layer path ``(…, "model", "layers", i, *rest)`` (the release's
    order; an optional ``language_model`` prefix) is stored at ``(…, "model", "run", p, *rest)`` row ``j`` when layer
    i is the run's (``i = start + j·P + p``), else where it says. :meth:`stack` / :meth:`unstack` convert flat
    dicts (path → array) between the two."""

    def __init__(self, plan: ScanPlan | None):
        self.plan = plan

    @staticmethod
    def _split(path: tuple) -> tuple[tuple, str, int, tuple] | None:
        for k in (0, 1):
            if len(path) > k + 2 and path[k] == "model" and path[k + 1] in ("layers", "run") \
                    and (k == 0 or path[0] == "language_model"):
                return path[:k + 1], path[k + 1], int(path[k + 2]), tuple(path[k + 3:])
        return None

    def locate(self, i: int) -> tuple[int, int] | None:
        """``(p, j)`` for a layer of the run, None for one outside it."""
        plan = self.plan
        if plan is None or not plan.start <= i < plan.stop:
            return None
        j, p = divmod(i - plan.start, plan.period)
        return p, j

    def stored(self, path: tuple) -> tuple[tuple, int | None]:
        """The stored path of a per-layer ``path`` and its row in the stack (None: not stacked)."""
        parts = self._split(path)
        if parts is None or parts[1] != "layers":
            return tuple(path), None
        head, _, i, rest = parts
        at = self.locate(i)
        if at is None:
            return tuple(path), None
        return head + ("run", at[0]) + rest, at[1]

    def per_layer(self, path: tuple, j: int) -> tuple:
        """The per-layer path of row ``j`` of a stored run path."""
        head, _, p, rest = self._split(path)
        return head + ("layers", self.plan.start + j * self.plan.period + p) + rest

    def is_stacked(self, path: tuple) -> bool:
        parts = self._split(path)
        return parts is not None and parts[1] == "run"

    def unstack(self, flat: dict, row=None) -> dict:
        """Stored flat dict → per-layer flat dict: row j of a stack ``a`` is ``row(a, j)`` (default ``a[j]``; a
        ``jax.ShapeDtypeStruct`` becomes the row's; a leaf without a shape is every row's)."""
        out = {}
        for path, a in flat.items():
            if not self.is_stacked(path):
                out[path] = a
                continue
            for j in range(self.plan.repeats):
                out[self.per_layer(path, j)] = (
                    jax.ShapeDtypeStruct(a.shape[1:], a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else
                    a if not hasattr(a, "shape") else        # a placeholder (e.g. optax's MaskedNode): every row's
                    a[j] if row is None else row(a, j))
        return dict(sorted(out.items(), key=lambda kv: _order(kv[0])))

    def stack(self, flat: dict) -> dict:
        """Per-layer flat dict → stored flat dict (the run's rows stacked, NumPy or JAX as given; leaves without a
        shape: the first row's)."""
        out, rows = {}, {}
        for path, a in flat.items():
            to, j = self.stored(path)
            if j is None:
                out[to] = a
            else:
                rows.setdefault(to, {})[j] = a
        for to, r in rows.items():
            if sorted(r) != list(range(self.plan.repeats)):
                raise ValueError(f"{'/'.join(map(str, to))}: rows {sorted(r)} of {self.plan.repeats}")
            parts = [r[j] for j in range(self.plan.repeats)]
            if not hasattr(parts[0], "shape"):
                out[to] = parts[0]
            else:
                out[to] = (np.stack if all(isinstance(a, np.ndarray) for a in parts) else jnp.stack)(parts)
        return out


def _order(path: tuple) -> tuple:
    return tuple((0, k, "") if isinstance(k, int) else (1, 0, str(k)) for k in path)


def flat_dict(tree: dict, prefix: tuple = ()) -> dict:
    """A nested dict (``nnx.to_pure_dict``) as ``{path: leaf}``."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat_dict(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def nested_dict(flat: dict) -> dict:
    """:func:`flat_dict`'s inverse."""
    out: dict = {}
    for path, v in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out


def period_function(graphs: list, plan: ScanPlan, call):
    """``period(states, caches, x, blocks, j) -> (x, blocks, stats, new caches)``: period ``j`` (traced) of the run
    — its P layers from their graphs and the period's ``states`` (one per position), through ``call`` (see
    :func:`run_scanned`); ``blocks`` a :class:`BlockBuffer` (AttnRes) or the plain-residual list; ``caches`` the
    period's layer caches or None."""
    P = plan.period

    def period(states, cs, x, blocks, j):
        stats, new = [], []
        for p in range(P):
            x, blocks, c, st = call(nnx.merge(graphs[p], states[p]), x, blocks, plan.start + j * P + p,
                                    None if cs is None else cs[p])
            new.append(c)
            if st is not None:
                stats.append(st)
        return x, blocks, tuple(stats), None if cs is None else tuple(new)

    return period


def run_scanned(run, plan: ScanPlan, block_size: int | None, x: jax.Array, blocks: list[jax.Array], call,
                recompute: bool = False, caches: list | None = None) -> tuple[jax.Array, list[jax.Array], list, list]:
    """The run's layers (``run``: the stored stacks, :func:`stack_layers`) over ``x`` (the partial sum entering
    layer ``start``) and ``blocks`` (sealed so far): ``call(layer, x, blocks, index, cache)`` runs one layer (``index``: its traced layer number; ``cache``: its
    layer cache or None) and returns ``(x, blocks, new cache or None, stats or None)``. ``block_size``: AttnRes's
    (None: plain residuals). ``caches``: the run's layer caches in layer order (prefill, decode, verification),
    stacked per period position inside the program. ``recompute`` (with AttnRes, without caches): the backward
    keeps only each period's input partial sum and the run's final blocks and recomputes each period's forward
    (:func:`_periods_recomputed`) instead of keeping the carried block buffer once per period. Returns ``(x,
    blocks, the MoE layers' stats in layer order, the new layer caches in layer order or [])``."""
    graphs, stacked = run_states(run)
    P, m = plan.period, plan.repeats
    attn_res = block_size is not None
    seal_at = [i for i in range(plan.start, plan.stop) if attn_res and i % block_size == 0]
    stacked_caches = None if caches is None else [
        jax.tree.map(lambda *a: jnp.stack(a), *[caches[j * P + p] for j in range(m)]) for p in range(P)]

    run_period = period_function(graphs, plan, call)

    def period(states, cs, x, pre, buf, count, j):
        """Period j's P layers (``cs``: their caches or None): ``-> (x, buf, count, stats, new caches)``."""
        bb = BlockBuffer(pre, buf, count) if attn_res else pre
        x, bb, stats, new = run_period(states, cs, x, bb, j)
        return (x, bb.buf, bb.count, stats, new) if attn_res else (x, buf, count, stats, new)

    buf = jnp.zeros((max(len(seal_at), 1),) + x.shape, x.dtype)
    js = jnp.arange(m, dtype=jnp.int32)
    new_caches = []
    if recompute and seal_at and caches is None:
        counts = [sum(1 for i in seal_at if i < plan.start + j * P) for j in range(m)]
        x, buf, stats = _periods_recomputed(period, stacked, x, list(blocks), buf, js, jnp.asarray(counts, jnp.int32))
    else:
        def body(carry, xs):
            x, buf, count = carry
            x, buf, count, stats, new = period(xs[0], xs[2], x, blocks, buf, count, xs[1])
            return (x, buf, count), (stats, new)

        (x, buf, _), (stats, new) = jax.lax.scan(body, (x, buf, jnp.zeros((), jnp.int32)),
                                                 (stacked, js, stacked_caches))
        if caches is not None:
            new_caches = [jax.tree.map(lambda a, j=j: a[j], new[p]) for j in range(m) for p in range(P)]
    out = [jax.tree.map(lambda a, j=j: a[j], st) for j in range(m) for st in stats]   # layer order
    return x, list(blocks) + [buf[r] for r in range(len(seal_at))], out, new_caches


def _periods_recomputed(period, stacked, x, pre: list, buf, js, counts):
    """The scan of ``period`` (from ``x``, ``pre`` blocks and an empty run buffer ``buf``) whose backward keeps,
    per period, only the period's input partial sum ``[B, T, H]``; returns ``(x, final buffer, stats)``.

    A sealed block never changes, so the buffer entering period j is the run's final buffer with the rows from
    ``counts[j]`` (blocks sealed before period j) on zeroed. The backward walks the periods in reverse and takes
    each period's VJP at (its partial sum, that buffer): one recomputed forward of the run, and the blocks kept
    once instead of once per period."""
    zero = jnp.zeros((), jnp.int32)

    def forward(stacked, x, pre, buf):
        def body(carry, xs):
            x, buf, count = carry
            x2, buf2, count2, stats, _ = period(xs[0], None, x, pre, buf, count, xs[1])
            return (x2, buf2, count2), (x, stats)

        (x, buf, _), (xs_in, stats) = jax.lax.scan(body, (x, buf, zero), (stacked, js))
        return x, buf, stats, xs_in

    @jax.custom_vjp
    def run(stacked, x, pre, buf):
        x, buf, stats, _ = forward(stacked, x, pre, buf)
        return x, buf, stats

    def fwd(stacked, x, pre, buf):
        x, final, stats, xs_in = forward(stacked, x, pre, buf)
        return (x, final, stats), (stacked, xs_in, pre, final)

    def bwd(res, ct):
        stacked, xs_in, pre, final = res
        dx, dbuf, _ = ct
        row = jnp.arange(final.shape[0]).reshape((-1,) + (1,) * (final.ndim - 1))

        def step(carry, xs):
            dx, dbuf, dpre = carry
            states, x_j, j = xs
            count = counts[j]

            def f(states, x, pre, buf):
                x, buf, _, _, _ = period(states, None, x, pre, buf, count, j)
                return x, buf

            _, vjp = jax.vjp(f, states, x_j, pre, jnp.where(row < count, final, jnp.zeros_like(final)))
            dst, dxj, dprej, dbufj = vjp((dx, dbuf))
            return (dxj, dbufj, [a + b for a, b in zip(dpre, dprej)]), dst

        carry0 = (dx, dbuf, [jnp.zeros_like(b) for b in pre])
        (dx0, dbuf0, dpre), dstacked = jax.lax.scan(step, carry0, (stacked, xs_in, js), reverse=True)
        return dstacked, dx0, dpre, dbuf0

    run.defvjp(fwd, bwd)
    return run(stacked, x, pre, buf)
