"""Under 8 simulated CPU devices: Per-Head Muon with its Newton–Schulz in whole-block layouts
(k3jax.train.optim.make_blockwise_optimizer) on mesh fsdp=4,tensor=2 against optax's Muon on one device; the
compiled update's all-gathers and its temporary memory against the naive version (every momentum gathered whole
before Newton–Schulz). Prints JSON."""

import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from k3jax.nn.model import K3ForCausalLM  # noqa: E402
from k3jax.parallel.hlo import collectives  # noqa: E402
from k3jax.parallel.mesh import make_mesh  # noqa: E402
from k3jax.parallel.rules import axes_tree, shard_pure  # noqa: E402
from k3jax.train.optim import (OptimConfig, make_blockwise_optimizer, make_optimizer, muon_dims_tree,  # noqa: E402
                               muon_plans)

jax.config.update("jax_default_matmul_precision", "highest")


def main() -> dict:
    sys.path.insert(0, os.path.dirname(__file__))
    from ep_train_model import MODEL

    from k3jax.train.loop import TrainConfig, model_config

    cfg = model_config(TrainConfig.load(None, list(MODEL)))
    st = nnx.state(K3ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(st)
    dims = muon_dims_tree(st)
    mesh = make_mesh("fsdp=4,tensor=2")
    c = OptimConfig()
    ref = make_optimizer(dims, 100, c)
    opts = {"blocks": make_blockwise_optimizer(dims, 100, c, muon_plans(st, mesh)),
            "naive": make_blockwise_optimizer(dims, 100, c, muon_plans(st, mesh, naive=True))}
    sp = shard_pure(params, axes_tree(st), mesh)
    keys = iter(jax.random.split(jax.random.key(1), 10_000))
    grads = [jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape, p.dtype), params) for _ in range(3)]
    out = {}
    r_state = ref.init(params)
    ref_updates = []
    for g in grads:
        u, r_state = jax.jit(ref.update)(g, r_state, params)
        ref_updates.append(u)
    from k3jax.train.optim import muon_block_axis

    from optax.contrib import MuonDimensionNumbers

    pairs = [(tuple(x.shape), d) for x, d in zip(jax.tree.leaves(params), jax.tree.leaves(
        dims, is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))) if d is not None]
    # a gathered array with a whole parameter's elements, in any order of its axes
    batched = {tuple(sorted(s)) for s, d in pairs if muon_block_axis(d, len(s)) is not None}
    matrices = {tuple(sorted(s)) for s, d in pairs if muon_block_axis(d, len(s)) is None and s[0] != s[-1]}
    for name, opt in opts.items():
        state = jax.tree.map(lambda x: x, opt.init(sp))
        state = jax.tree.map(lambda x: x if isinstance(getattr(x, "sharding", None), NamedSharding) and
                             x.sharding.mesh == mesh else jax.device_put(x, NamedSharding(mesh, P())), state)
        upd = jax.jit(opt.update)
        diffs = []
        for g, ru in zip(grads, ref_updates):
            gs = shard_pure(g, axes_tree(st), mesh)
            u, state = upd(gs, state, sp)
            diffs.append(max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(u),
                                                                            jax.tree.leaves(ru))))
        compiled = upd.lower(shard_pure(grads[0], axes_tree(st), mesh), state, sp).compile()
        gathers = [x for x in collectives(compiled.as_text()) if x["op"] == "all-gather" and x["group_size"] != 1]
        def whole(kind):
            return sum(1 for x in gathers for r in x["result"] if tuple(sorted(d for d in r[1] if d > 1)) in
                       {tuple(d for d in k if d > 1) for k in kind})
        mem = compiled.memory_analysis()
        out[name] = {"max_update_diff": max(diffs), "all_gathers": len(gathers),
                     "largest_all_gather_bytes": max([x["result_bytes"] for x in gathers] or [0]),
                     "whole_batched_parameter_gathers": whole(batched),
                     "whole_matrix_gathers": whole(matrices),
                     "temp_bytes": int(mem.temp_size_in_bytes),
                     "argument_bytes": int(mem.argument_size_in_bytes)}
    out["update_scale"] = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(ref_updates[-1]))
    out["muon_params"] = len(pairs)
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
