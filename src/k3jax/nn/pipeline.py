"""Pipeline parallelism over the ``stage`` mesh axis: the model's periodic run of layers (:mod:`k3jax.nn.scan`)
split into stages, micro-batches in a GPipe schedule, Block AttnRes blocks sent only to the stages that read them.

**Split.** The run's ``repeats`` periods (K3: 22 units of (KDA, KDA, KDA, MLA)) go to S stages in order, the first
``repeats mod S`` stages one period more (:func:`split_run`: uneven depth at unit boundaries). Every stage runs the
same program over ``width = ⌈repeats / S⌉`` periods; a stage with fewer masks its last one out (its parameters are
a copy of a real period's, its result is discarded: wasted work only where the split is uneven). The layers before
and after the run (K3: the dense layer 0; the last four) run outside the pipeline, on every stage's devices.

**Schedule.** GPipe: the batch's rows split into M micro-batches (micro-batch m: rows m, m + M, …, so that a
batch sharded over the data axes keeps each device's rows in every micro-batch); at tick ``t`` stage ``s`` runs
micro-batch ``t − s``, so ``M + S − 1`` ticks run ``M`` micro-batches on each stage and the bubble — the fraction
of stage-ticks without work — is ``(S − 1) / (M + S − 1)`` (:func:`bubble_fraction`). The backward is the forward's transpose
(``jax.grad`` through the loop: the ppermutes reverse), with the same bubble.

**AttnRes across stages.** A layer reads every block sealed before it. Stage ``s`` seals ``n_s`` blocks of a
micro-batch; the stages after it need them when that micro-batch reaches them, ``k`` ticks later for stage
``s + k``. Each stage keeps the blocks it sealed in a ring of S ticks and, at each tick, sends stage ``s + k`` (one
``ppermute`` per distance k) exactly the blocks of the micro-batch that stage runs now: every block crosses each
link to a stage that reads it once, and no stage forwards another's blocks. The receiver uses them for that
micro-batch's tick only. The running partial sum goes to the next stage after every tick. The last stage's final
partial sums and blocks are the run's output (``psum`` over the stage axis from the last stage: every stage's
devices continue with the layers after the run). ``sends="all"`` instead forwards every block sealed so far along
the chain (each stage sends the next one what it received plus its own): the layout the incremental sends replace,
kept to measure the bytes they save (:func:`permute_bytes` on the compiled step).

Composes with the other mesh axes: the pipeline is a ``shard_map`` manual over ``stage`` only, so data, fsdp,
expert and context sharding stay XLA's (automatic) inside each stage; the stage program pins the micro-batch's
rows to the data axes and its time to the context axis (:func:`_row_layout`), which the partitioner would
otherwise leave whole on every device of a stage. Bytes per stage boundary: :func:`stage_links`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.nn.scan import BlockBuffer, ScanPlan, period_function, run_states


class StageSplit(NamedTuple):
    """Periods of the run per stage, in order (stage s runs periods ``offsets[s] … offsets[s] + periods[s] − 1``)."""
    periods: tuple[int, ...]

    @property
    def stages(self) -> int:
        return len(self.periods)

    @property
    def width(self) -> int:
        return max(self.periods)

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(sum(self.periods[:s]) for s in range(self.stages))


class PipelineError(ValueError):
    pass


def split_run(repeats: int, stages: int) -> StageSplit:
    """``repeats`` periods over ``stages`` stages, the first ``repeats mod stages`` one period longer."""
    if stages < 1 or repeats < stages:
        raise PipelineError(f"stage={stages}: the model's periodic run has {repeats} periods, fewer than the stages "
                            f"(each stage runs at least one)")
    q, r = divmod(repeats, stages)
    return StageSplit(tuple(q + (s < r) for s in range(stages)))


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """GPipe's idle fraction of stage-ticks: ``(S − 1) / (M + S − 1)``."""
    return (stages - 1) / (micro_batches + stages - 1)


def stage_seals(plan: ScanPlan, split: StageSplit, block_size: int | None) -> tuple[int, ...]:
    """How many AttnRes blocks each stage seals (layers ``i`` of its periods with ``i % block_size == 0``)."""
    if block_size is None:
        return (0,) * split.stages
    out = []
    for off, n in zip(split.offsets, split.periods):
        first, stop = plan.start + off * plan.period, plan.start + (off + n) * plan.period
        out.append(sum(1 for i in range(first, stop) if i % block_size == 0))
    return tuple(out)


def describe(plan: ScanPlan, split: StageSplit, micro_batches: int, block_size: int | None, n_layers: int) -> str:
    """One line for a run's log: each stage's layers, the AttnRes blocks it seals, the micro-batches and bubble."""
    spans = []
    for off, n in zip(split.offsets, split.periods):
        first, last = plan.start + off * plan.period, plan.start + (off + n) * plan.period - 1
        spans.append(f"{first}–{last}" if last > first else f"{first}")
    seals = "/".join(map(str, stage_seals(plan, split, block_size)))
    outside = n_layers - (plan.stop - plan.start)
    return (f"pipeline: {split.stages} stages, layers {' | '.join(spans)} (AttnRes blocks sealed per stage "
            f"{seals}; the other {outside} layers on every stage), {micro_batches} micro-batches, GPipe bubble "
            f"{bubble_fraction(split.stages, micro_batches):.2f}")


class PipelineConfig(NamedTuple):
    """Run the model's periodic layers as a pipeline over ``mesh``'s ``axis`` with ``micro_batches`` micro-batches
    (micro-batch m: rows m, m + M, m + 2M, …); ``sends``: ``"new"`` (blocks to the stages that read them) or
    ``"all"``."""
    mesh: jax.sharding.Mesh
    micro_batches: int
    axis: str = "stage"
    sends: str = "new"


def run_pipelined(run, plan: ScanPlan, block_size: int | None, x: jax.Array, blocks: list[jax.Array], make_call,
                  pp: PipelineConfig, rows: dict | None = None) -> tuple[jax.Array, list[jax.Array], list]:
    """The run's layers (``run``: the stored stacks; as :func:`k3jax.nn.scan.run_scanned`, without caches) pipelined over ``pp``: returns
    ``(x, blocks, the MoE layers' stats in layer order)`` with the stats of the micro-batches combined (expert
    counts summed, router scores in row order). ``rows``: per-row inputs of the layers (e.g. ``segment_ids
    [B, T]``), split into micro-batches like ``x``; ``make_call(rows of one micro-batch)`` returns the ``call`` of
    :func:`~k3jax.nn.scan.run_scanned` for them."""
    S, M = pp.mesh.shape[pp.axis], pp.micro_batches
    split = split_run(plan.repeats, S)
    W, Pp = split.width, plan.period
    attn_res = block_size is not None
    seals = stage_seals(plan, split, block_size)
    n = max(max(seals), 1)
    B = x.shape[0]
    if B % M:
        raise PipelineError(f"micro_batches={M}: the batch's {B} rows do not split evenly")
    graphs, stacked = run_states(run)
    # stage-major [S, W, ...]: stage s's local period l is global period offsets[s] + l (a real period's copy where
    # the stage has fewer: masked out). An even split is a reshape of the stored stacks, which the sharding rules
    # place on the stage axis (each stage's weights on its devices); an uneven one gathers the rows (the stacks are
    # then replicated: the stage axis does not divide them)
    if len(set(split.periods)) == 1:
        staged = [jax.tree.map(lambda a: a.reshape((S, W) + a.shape[1:]), st) for st in stacked]
    else:
        idx = jnp.asarray([min(off + l, plan.repeats - 1) for off in split.offsets for l in range(W)])
        staged = [jax.tree.map(lambda a: a[idx].reshape((S, W) + a.shape[1:]), st) for st in stacked]
    rows = dict(rows or {})
    # micro-batch m holds rows m, m + M, m + 2M, …: a batch sharded over the data axes keeps each device's rows
    # on it in every micro-batch (contiguous micro-batches would put the data sharding on the micro-batch axis,
    # which the partitioner can only undo by gathering whole micro-batches)
    mb = lambda a: jnp.swapaxes(a.reshape((B // M, M) + a.shape[1:]), 0, 1)  # noqa: E731
    body = _stage_program(lambda r: period_function(graphs, plan, make_call(r)), split, seals, n, M, attn_res, pp)
    spec_states = jax.tree.map(lambda _: P(pp.axis), staged)
    out_x, out_rows, stats = jax.shard_map(
        body, mesh=pp.mesh, in_specs=(spec_states, P(), [P()] * len(blocks), {k: P() for k in rows}),
        out_specs=(P(), P(), P(None, pp.axis)), axis_names={pp.axis}, check_vma=False,
    )(staged, mb(x), [mb(b) for b in blocks], {k: mb(v) for k, v in rows.items()})
    whole = lambda a: jnp.swapaxes(a, 0, 1).reshape((B,) + a.shape[2:])  # noqa: E731
    # the last stage's rows: from stage S−1−k at k−1 (k = 1 … S−1), then its own; in layer order: stages 0 … S−1
    rows = [(S - 1 - src - 1) * n + r for src in range(S - 1) for r in range(seals[src])]
    rows += [(S - 1) * n + r for r in range(seals[S - 1])]
    new_blocks = [whole(out_rows[:, r]) for r in rows] if attn_res else []
    out_stats = []
    for s in range(S):
        for l in range(split.periods[s]):
            for st in stats:
                a = jax.tree.map(lambda v: v[:, s * W + l], st)     # [M, ...]
                out_stats.append(type(st)(jnp.sum(a.counts, 0), None if a.scores is None else   # tokens in row order
                                          whole(a.scores.reshape((M, B // M, -1) + a.scores.shape[2:]))
                                          .reshape((-1,) + a.scores.shape[2:])))
    return whole(out_x), list(blocks) + new_blocks, out_stats


def _row_layout(mesh: jax.sharding.Mesh, lead: int = 0):
    """``a [lead dims…, b, T, …] -> a`` laid out with its rows over the data-like axes that divide them and time
    over the context axis, inside the stage program (whose ``shard_map`` leaves every axis but ``stage`` to the
    partitioner: unconstrained, it may keep a stage's micro-batch whole on every device of the stage)."""
    from k3jax.parallel.mesh import inner_mesh
    from k3jax.parallel.rules import LOGICAL_TO_MESH

    def lay(a: jax.Array) -> jax.Array:
        b = a.shape[lead]
        axes = tuple(ax for ax in LOGICAL_TO_MESH["batch"] if mesh.shape.get(ax, 1) > 1)
        n = 1
        for ax in axes:
            n *= mesh.shape[ax]
        rows = axes if axes and b % n == 0 else None
        time = "context" if mesh.shape.get("context", 1) > 1 else None
        spec = P(*([None] * lead), rows, time, *([None] * (a.ndim - lead - 2)))
        return jax.lax.with_sharding_constraint(a, jax.NamedSharding(inner_mesh(mesh), spec))

    return lay


def _stage_program(period_for, split: StageSplit, seals: tuple[int, ...], n: int, M: int, attn_res: bool,
                   pp: PipelineConfig):
    """The per-stage program of :func:`run_pipelined` (inside ``shard_map`` over the stage axis); ``period_for(rows
    of a micro-batch)`` is the period function for that micro-batch."""
    S, W, ax = split.stages, split.width, pp.axis
    to = lambda k: [(i, i + k) for i in range(S - k)]  # noqa: E731

    lay, lay_rows = _row_layout(pp.mesh), _row_layout(pp.mesh, 1)

    def body(staged, xm, pre, rows):
        s = jax.lax.axis_index(ax)
        xm, pre = lay_rows(xm), [lay_rows(p) for p in pre]
        states = jax.tree.map(lambda a: a[0], staged)                 # [W, ...] this stage's periods
        off = jnp.asarray(split.offsets, jnp.int32)[s]
        count = jnp.asarray(split.periods, jnp.int32)[s]
        seal_of = jnp.asarray(seals, jnp.int32)
        shape = xm.shape[1:]
        zeros_rows = jnp.zeros((n,) + shape, xm.dtype)

        def stage(x, pre_rows, pre_valid, mc):
            run_period = period_for({k: v[mc] for k, v in rows.items()})
            bb = BlockBuffer(pre_rows, zeros_rows, jnp.zeros((), jnp.int32), pre_valid) if attn_res else pre_rows

            def one(carry, xs):
                x, bb = carry
                st, l = xs
                x2, bb2, stats, _ = run_period(st, None, x, bb, off + l)
                ok = l < count
                x = jnp.where(ok, x2, x)
                if attn_res:
                    bb = BlockBuffer(bb.pre, jnp.where(ok, bb2.buf, bb.buf), jnp.where(ok, bb2.count, bb.count),
                                     bb.pre_valid)
                stats = jax.tree.map(lambda v: jnp.where(ok, v, jnp.zeros_like(v)), stats)
                return (x, bb), stats

            (x, bb), stats = jax.lax.scan(one, (x, bb), (states, jnp.arange(W, dtype=jnp.int32)))
            return x, (bb.buf if attn_res else zeros_rows), stats

        def tick(carry, t):
            x_recv, ring, out_x, out_rows, out_stats = carry
            m = t - s
            active = (m >= 0) & (m < M)
            mc = jnp.clip(m, 0, M - 1)
            recv, valid = [], []
            if pp.sends == "new":        # stage s − k's blocks of this micro-batch, sealed k ticks ago
                for k in range(1, S):
                    rows = jax.lax.ppermute(ring[(t - k) % S], ax, to(k))
                    src = s - k
                    recv.append(rows)
                    valid.append((src >= 0) & (jnp.arange(n) < seal_of[jnp.maximum(src, 0)]))
                recv = jnp.concatenate(recv) if recv else jnp.zeros((0,) + shape, xm.dtype)
            else:                        # everything sealed so far, forwarded along the chain (x_recv carries it)
                x_recv, recv = x_recv
                valid = [(s - k >= 0) & (jnp.arange(n) < seal_of[jnp.maximum(s - k, 0)]) for k in range(1, S)]
            valid = jnp.concatenate(valid) if valid else jnp.zeros((0,), bool)
            x_in = lay(jnp.where(s == 0, xm[mc], x_recv))
            pre_rows = [p[mc] for p in pre] + [recv[r] for r in range(recv.shape[0])]
            pre_valid = jnp.concatenate([jnp.ones((len(pre),), bool), valid])
            x_out, own, stats = stage(x_in, [lay(r) for r in pre_rows], pre_valid, mc)
            x_out, own = lay(x_out), lay_rows(own)
            ring = jax.lax.dynamic_update_index_in_dim(ring, own, t % S, 0)
            last = active & (s == S - 1)
            out_x = out_x.at[mc].set(jnp.where(last, x_out, out_x[mc]))
            out_rows = out_rows.at[mc].set(jnp.where(last, jnp.concatenate([recv, own]), out_rows[mc]))
            out_stats = jax.tree.map(lambda acc, v: acc.at[mc].set(jnp.where(active, v, acc[mc])), out_stats, stats)
            x_next = jax.lax.ppermute(x_out, ax, to(1))
            if pp.sends != "new":
                # what the next stage must hold: the blocks this stage received (from every stage before it) and
                # its own, shifted one stage along: row block k−1 holds stage s+1−k's
                chain = jnp.concatenate([own, recv[: (S - 2) * n]]) if S > 1 else recv
                x_next = (x_next, jax.lax.ppermute(chain, ax, to(1)))
            return (x_next, ring, out_x, out_rows, out_stats), None

        rows_out = S * n
        stats0 = jax.eval_shape(lambda: stage(xm[0], [p[0] for p in pre] + [zeros_rows[0]] * ((S - 1) * n),
                                              jnp.ones((len(pre) + (S - 1) * n,), bool), 0)[2])
        out_stats = jax.tree.map(lambda a: jnp.zeros((M,) + a.shape, a.dtype), stats0)
        x0 = jnp.zeros(shape, xm.dtype)
        if pp.sends != "new":
            x0 = (x0, jnp.zeros(((S - 1) * n,) + shape, xm.dtype))
        carry = (x0, jnp.zeros((S, n) + shape, xm.dtype), jnp.zeros((M,) + shape, xm.dtype),
                 jnp.zeros((M, rows_out) + shape, xm.dtype), out_stats)
        (_, _, out_x, out_rows, out_stats), _ = jax.lax.scan(tick, carry, jnp.arange(M + S - 1, dtype=jnp.int32))
        # from the last stage to every stage (the others hold zeros)
        out_x, out_rows = jax.lax.psum((out_x, out_rows), ax)
        return out_x, out_rows, out_stats

    return body


def permute_links(hlo_text: str) -> dict[tuple[int, int], int]:
    """Bytes a compiled program's collective-permutes move per device link ``(source, target)`` (as the HLO's
    ``source_target_pairs`` name them: partition ids in an SPMD program), per execution of each instruction (a permute inside a loop body counts
    once). Under SPMD every device runs a permute with the same operand shape; the pairs say which devices send."""
    import re

    from k3jax.parallel.hlo import collectives

    pairs = [[tuple(map(int, p)) for p in re.findall(r"(\d+),(\d+)", m.group(1))]
             for m in re.finditer(r"collective-permute(?:-start)?\(.*?source_target_pairs=(\{\{.*?\}\})", hlo_text)]
    ops = [c for c in collectives(hlo_text) if c["op"].startswith("collective-permute")]
    if len(pairs) != len(ops):
        raise ValueError(f"permute_links: {len(ops)} collective-permutes but {len(pairs)} pair lists")
    links: dict[tuple[int, int], int] = {}
    for c, ps in zip(ops, pairs):
        for link in ps:
            links[link] = links.get(link, 0) + c["operand_bytes"]
    return links


def permute_bytes(hlo_text: str) -> int:
    """Bytes a compiled program's collective-permutes move over all device links (:func:`permute_links` summed)."""
    return sum(permute_links(hlo_text).values())


def stage_links(hlo_text: str, mesh, axis: str = "stage") -> dict[str, int]:
    """:func:`permute_links` summed per pair of pipeline stages, ``"s→t"``: the bytes crossing each stage boundary.
    The pairs of an SPMD program name partitions: partition i is the mesh's i-th device in row-major order, whose
    ``axis`` coordinate is its stage."""
    import numpy as np

    shape = np.asarray(mesh.devices).shape
    ax = mesh.axis_names.index(axis)
    out: dict[str, int] = {}
    for (a, b), n in sorted(permute_links(hlo_text).items()):
        key = f"{np.unravel_index(a, shape)[ax]}→{np.unravel_index(b, shape)[ax]}"
        out[key] = out.get(key, 0) + n
    return dict(sorted(out.items()))


__all__ = ["PipelineConfig", "PipelineError", "StageSplit", "bubble_fraction", "describe", "permute_bytes", "permute_links",
           "run_pipelined", "split_run", "stage_links", "stage_seals"]
