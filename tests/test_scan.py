"""Scanned layers (k3jax.nn.scan): the plan found from the layer pattern, and the scanned model equal to the
unrolled one — logits, expert counts, router scores and gradients — with AttnRes blocks that do not line up with
the scan's period, a partial last block and a final MLA layer after the run."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import K3Config
from k3jax.nn.model import K3ForCausalLM
from k3jax.nn.scan import ScanPlan, scan_plan, seals_in

B, T = 2, 16


def k3_pattern(depth: int, block: int | None, final_mla: bool = True, mla: list[int] | None = None) -> K3Config:
    """The test preset's widths at ``depth`` layers in K3's pattern (spec: layer 0 KDA with a dense FFN, then
    (KDA, KDA, KDA, MLA) units with MoE FFNs, the last layer MLA), AttnRes blocks of ``block`` layers; ``mla``:
    other MLA layers instead (0-indexed)."""
    cfg = K3Config.from_preset("test")
    if mla is None:
        mla = [i for i in range(depth) if i % 4 == 3 or (final_mla and i == depth - 1)]
    lac = dataclasses.replace(cfg.linear_attn_config, kda_layers=[i + 1 for i in range(depth) if i not in mla],
                              full_attn_layers=[i + 1 for i in mla])
    return cfg.replace(num_hidden_layers=depth, linear_attn_config=lac, first_k_dense_replace=1,
                       attn_res_block_size=block)


def test_plan_of_k3_and_of_patterns_without_a_run():
    # K3 (spec: 93 layers, layer 0 dense, 23 (KDA, KDA, KDA, MLA) units, a final MLA layer): layers 1–88 are 22
    # repeats of the 4-layer unit starting at layer 1; 89–92 (KDA, KDA, MLA, MLA) break it. 1 + 4 + 4 = 9 layers
    # are compiled instead of 93; AttnRes blocks of 12 seal at 12, 24, …, 84 inside the run: 7.
    k3 = K3Config.from_preset("k3")
    plan = scan_plan(k3)
    assert plan == ScanPlan(1, 4, 22) and plan.stop == 89 and plan.compiled_layers(93) == 9
    assert seals_in(k3, plan) == 7
    cfg = k3_pattern(10, 3)                     # layers 1–8 as 2 repeats; 9 (the final MLA) unrolled
    assert scan_plan(cfg) == ScanPlan(1, 4, 2) and seals_in(cfg, scan_plan(cfg)) == 2       # seals at 3 and 6
    assert scan_plan(k3_pattern(3, 3)) is None  # KDA (dense), KDA, MLA: nothing repeats twice


def model(cfg: K3Config):
    """Graph, parameters (every weight jittered, so no AttnRes read is a uniform average) and other state."""
    graph, params, rest = nnx.split(K3ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda p: jnp.asarray(np.asarray(p) + 0.05 * rng.standard_normal(p.shape), p.dtype), params)
    return graph, params, rest


def compile_fast(f, *args):
    """Compiled without XLA's backend optimisations (the two layouts' arithmetic is what is compared), products
    in full fp32."""
    with jax.default_matmul_precision("highest"):
        return jax.jit(f).lower(*args).compile({"xla_backend_optimization_level": 0})


def test_scanned_equals_unrolled_gradients():
    """7 layers: 0 unrolled (KDA, dense FFN), 1–6 as three repeats of (KDA, MLA) — the last one the final MLA
    layer; AttnRes blocks of 3, so the run seals blocks at layers 3 and 6 — at different positions of the period —
    and layer 6 starts a partial last block. Loss, logits, expert counts, router scores and gradients, under
    ``remat=none`` (a plain scan) and ``full`` (the backward recomputed period by period from the final blocks).

    Tolerance: in float64 the two layouts agree to 1e-12 (the cached paths below; the release checkpoint against
    the float64 reference in test_model; the 10-layer AttnRes forward without a cache measured within 1e-12 too);
    in fp32 XLA fuses the loop body differently from the unrolled layers, which reorders fp32 sums. Measured here:
    logits 3.2e-6 (``none``) / 4.9e-6 (``full``), gradients 3.8e-6 / 7.8e-6, loss equal, against logits of ~1 and
    gradients up to ~0.1; on the 10-layer model of the float64 tests up to 5.8e-6 / 1.1e-5, and there the forward
    alone is bit-identical without XLA's backend optimisations (4.6e-6 with them)."""
    cfg = k3_pattern(7, 3, mla=[2, 4, 6])
    assert scan_plan(cfg) == ScanPlan(1, 2, 3)
    graph, params, rest = model(cfg)
    ids = jax.random.randint(jax.random.key(2), (B, T), 0, cfg.vocab_size)
    target = jax.random.randint(jax.random.key(3), (B, T), 0, cfg.vocab_size)

    def loss(params, scan, remat):
        out = nnx.merge(graph, params, rest)(ids, scan_layers=scan, remat=remat, router_scores=True)
        lp = jnp.take_along_axis(jax.nn.log_softmax(out.logits), target[..., None], axis=-1)
        return -jnp.mean(lp), (out.logits, out.expert_counts, out.router_scores)

    res = {}
    for scan, remat in ((False, "none"), (True, "none"), (True, "full")):
        f = jax.value_and_grad(lambda p, s=scan, r=remat: loss(p, s, r), has_aux=True)
        res[scan, remat] = compile_fast(f, params)(params)
    (v0, (lg0, cnt0, sc0)), g0 = res.pop((False, "none"))
    want = jax.tree.leaves(g0)
    assert max(float(jnp.max(jnp.abs(g))) for g in want) > 1e-3                       # gradients that can differ
    assert len(sc0) == 6 and cnt0.shape == (6, cfg.num_experts)                        # every MoE layer reported
    for key, ((v, (lg, cnt, sc)), g) in res.items():
        err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(g), want))
        print(key, "loss", abs(float(v) - float(v0)), "logits", float(jnp.max(jnp.abs(lg - lg0))), "grads", err)
        assert abs(float(v) - float(v0)) <= 2e-6, key
        assert float(jnp.max(jnp.abs(lg - lg0))) <= 2e-5, key
        assert bool(jnp.all(cnt == cnt0)), key                                         # same experts, layer order
        assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(sc, sc0)) <= 2e-5, key
        assert err <= 3e-5, (key, err)


def test_scanned_plain_residual_equals_unrolled_in_float64(x64):
    """Without AttnRes (no block buffer: the scan carries the residual stream alone), the 10-layer K3 pattern in
    float64: the scanned forward is the unrolled one."""
    cfg = k3_pattern(10, None).replace(dtype="float64")
    graph, params, rest = model(cfg)
    ids = jax.random.randint(jax.random.key(2), (B, T), 0, cfg.vocab_size)
    out = {s: compile_fast(lambda p, s=s: nnx.merge(graph, p, rest)(ids, scan_layers=s).logits, params)(params)
           for s in (False, True)}
    assert out[True].dtype == jnp.float64
    assert float(jnp.max(jnp.abs(out[True] - out[False]))) <= 1e-12 * float(jnp.max(jnp.abs(out[False])))


def test_scanned_prefill_decode_verify_and_groups_equal_unrolled(x64):
    """With caches, in float64 (exactness; fp32 only adds the fusion rounding measured above): a prefill of 8
    tokens with a ragged ``n_new``, two decode steps, and a grouped step — recorded verification rows (pending
    KDA caches) beside a fresh slot's prefill chunk — logits, hidden states and every new cache leaf (KDA states
    and conv tails, MLA latents, lengths) equal the unrolled model's."""
    from k3jax.nn.cache import init_cache

    cfg = k3_pattern(10, 3).replace(dtype="float64")
    graph, params, rest = model(cfg)

    def run(scan):
        def f(params, ids, cache, n_new):
            out = nnx.merge(graph, params, rest)(ids, cache=cache, n_new=n_new, scan_layers=scan)
            return out.logits, out.cache

        def groups(params, ids, caches, n_new):
            m = nnx.merge(graph, params, rest)
            return m.forward_groups(ids, caches, n_new, kda_record=(True, False), scan_layers=scan)

        f, g = jax.jit(f), jax.jit(groups)
        rng = np.random.default_rng(5)
        ids = lambda *shape: jnp.asarray(rng.integers(0, cfg.vocab_size, shape), jnp.int32)   # noqa: E731
        outs = []
        lg, c = f(params, ids(2, 8), init_cache(cfg, 2, 32), jnp.asarray([8, 5], jnp.int32))
        outs += [lg, c]
        for _ in range(2):
            lg, c = f(params, ids(2, 1), c, jnp.asarray([1, 1], jnp.int32))
            outs += [lg, c]
        # verification rows (3 tokens each, recorded: pending KDA caches) beside a fresh slot's prefill chunk
        outs += list(g(params, (ids(2, 3), ids(1, 4)), (c, init_cache(cfg, 1, 32)),
                       (jnp.asarray([3, 2], jnp.int32), jnp.asarray([4], jnp.int32))))
        return outs

    want, got = run(False), run(True)
    assert jax.tree.structure(want) == jax.tree.structure(got)
    leaves = list(zip(jax.tree.leaves(want), jax.tree.leaves(got)))
    assert len(leaves) > 100
    for a, b in leaves:
        assert a.dtype == b.dtype and a.shape == b.shape
        assert float(jnp.max(jnp.abs(a - b), initial=0)) <= 1e-12 * max(1.0, float(jnp.max(jnp.abs(a), initial=0)))


def test_engine_with_scanned_layers_decodes_like_unrolled():
    """``Engine(scan_layers=True)`` (the serving runner's programs — mixed step, scoring — scanned): the test
    preset's 5-layer variant, layers 1–2 as a scan; greedy tokens and their logits equal the unrolled engine's
    (fp32 rounding)."""
    from k3jax.infer.engine import Engine
    from small_models import scannable

    cfg = scannable()
    m = K3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    prompts = [[1, 5, 9, 14, 2, 7], [3, 3, 8]]
    res = {}
    for scan in (False, True):
        eng = Engine(m, chunk=16, scan_layers=scan)
        res[scan] = eng.generate(prompts, 5, record_logits=True)
        assert [s.runner.scan for s in eng._schedulers.values()] == [scan]        # the runner took the option
    assert res[True].tokens == res[False].tokens
    for a, b in zip(res[True].logits, res[False].logits):
        assert np.max(np.abs(a - b)) <= 2e-5


def test_training_and_engine_options_take_scan_layers():
    import argparse

    from k3jax.config import ConfigError
    from k3jax.infer.config import EngineConfig, EngineConfigError, add_options, options_from_args
    from k3jax.train.loop import TrainConfig

    ap = argparse.ArgumentParser()
    add_options(ap)
    assert options_from_args(ap.parse_args(["--scan-layers", "on"])).scan_layers is True
    assert options_from_args(ap.parse_args(["--scan-layers", "off"])).scan_layers is False
    assert options_from_args(ap.parse_args([])).scan_layers is None
    with pytest.raises(SystemExit):
        ap.parse_args(["--scan-layers", "sometimes"])
    with pytest.raises(EngineConfigError) as e:
        EngineConfig(scan_layers="yes")
    assert e.value.field == "scan_layers"

    from k3jax.nn.scan import scan_pays

    assert TrainConfig.load(None, ["scan_layers=true"]).scan_layers is True
    assert TrainConfig.load(None, []).scan_layers is None          # by default: where scan_pays
    assert scan_pays(K3Config.from_preset("k3"))                   # 9 of 93 layers compiled
    assert not any(scan_pays(K3Config.from_preset(p)) for p in ("test", "tiny", "100m"))
    with pytest.raises(ConfigError, match="scan_layers"):
        TrainConfig.load(None, ["scan_layers=3"])


# ------------------------------------------------------------------ stored stacked: layout, optimizer, checkpoints
def per_layer_variables(m: K3ForCausalLM) -> dict:
    """Every variable of ``m`` under its per-layer path (``model/layers/i/…``, as k3jax stored them before the
    run was stacked), read through the per-layer modules ``m.layer(i)`` (their own metadata)."""
    flat = {p: v for p, v in nnx.to_flat_state(nnx.state(m)) if p[:2] != ("model", "run")}
    for i in range(m.config.num_hidden_layers):
        if m.model.layers[i] is None:
            flat.update({("model", "layers", i) + p: v for p, v in nnx.to_flat_state(nnx.state(m.layer(i)))})
    return flat


def test_run_is_stored_stacked_and_optimised_per_layer():
    """The scannable model (layers 1–2 the run): stored as ``model/run/0/…`` ``[2, …]`` with the logical axis
    ``layers`` first; ``layer(i)`` reads row i − 1; router biases read and written per MoE layer. One optimizer
    step (Per-Head Muon + AdamW, fp32 Newton–Schulz) on the stacked parameters equals the step on the same
    parameters held per layer with each layer's own Muon dimension numbers (Muon orthogonalises each layer's
    matrix on its own: the stacked axis is a batch axis)."""
    from k3jax.nn.scan import RunLayout, flat_dict, nested_dict
    from k3jax.train.optim import OptimConfig, make_optimizer, muon_dims, muon_dims_tree
    from small_models import scannable

    cfg = scannable()
    m = K3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    state = dict(nnx.to_flat_state(nnx.state(m)))
    assert not any(p[:3] in (("model", "layers", 1), ("model", "layers", 2)) for p in state)
    q = state["model", "run", 0, "self_attn", "q_proj", "kernel"]
    assert q.shape == (2, 64, 2, 32) and q.axes == ("layers", "embed", "heads", None)
    d = muon_dims(q)
    assert (d.reduction_axis, d.output_axis) == (1, 3)            # layers (0) and heads (2) are batch axes
    np.testing.assert_array_equal(np.asarray(m.layer(2).self_attn.q_proj.kernel[...]), np.asarray(q[...][1]))
    assert m.layer(2).idx == 2 and m.layer(2).self_attn.q_proj.kernel.axes == ("embed", "heads", None)

    biases = m.get_router_biases()
    assert len(biases) == len(cfg.moe_layers) == 4
    m.set_router_biases([b + 0.25 * (j + 1) for j, b in enumerate(biases)])
    for j, i in enumerate(cfg.moe_layers):                          # layer i's own bias, stacked or not
        np.testing.assert_array_equal(np.asarray(m.layer(i).block_sparse_moe.e_score_correction_bias[...]),
                                      np.asarray(biases[j]) + 0.25 * (j + 1))

    layout = RunLayout(m.model.scan_plan)
    pl = {p: v for p, v in per_layer_variables(m).items() if isinstance(v, nnx.Param)}
    params_pl = nested_dict({p: v[...] for p, v in pl.items()})
    dims_pl = nested_dict({p: muon_dims(v) for p, v in pl.items()})
    _, p_st, _ = nnx.split(m, nnx.Param, ...)
    params = nnx.to_pure_dict(p_st)
    assert flat_dict(params).keys() == layout.stack(flat_dict(params_pl)).keys()
    rng = np.random.default_rng(0)
    grads_pl = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), params_pl)
    grads = nested_dict(layout.stack(flat_dict(grads_pl)))
    oc = OptimConfig(warmup_steps=0, schedule="constant", ns_dtype="fp32")
    outs = []
    for dims, p, g in ((muon_dims_tree(p_st), params, grads), (dims_pl, params_pl, grads_pl)):
        opt = make_optimizer(dims, 10, oc)
        outs.append(jax.jit(opt.update)(g, opt.init(p), p)[0])
    stacked_again = layout.stack(flat_dict(outs[1]))
    for path, u in flat_dict(outs[0]).items():
        np.testing.assert_allclose(np.asarray(u), np.asarray(stacked_again[path]), rtol=1e-5, atol=1e-7,
                                   err_msg="/".join(map(str, path)))


def test_checkpoints_written_per_layer_load_and_resume_stacked(tmp_path):
    """Orbax directories of the layout before the run was stacked (``model/layers/<i>`` for every layer): an export
    loads, and a training checkpoint (parameters, router biases and an optimizer state after one step, all per
    layer) resumes into today's stacked (params, rest, optimizer state) with every leaf equal to the stacked
    conversion. A release checkpoint written from the stacked model names every layer per layer and loads back."""
    import json

    import orbax.checkpoint as ocp

    import k3jax
    from k3jax.io.orbax import load_orbax, save_orbax
    from k3jax.nn.scan import RunLayout, flat_dict, nested_dict
    from k3jax.train.checkpoint import Checkpointer
    from k3jax.train.optim import OptimConfig, make_optimizer, muon_dims, muon_dims_tree
    from small_models import scannable

    m = K3ForCausalLM(scannable(), rngs=nnx.Rngs(3))
    layout = RunLayout(m.model.scan_plan)
    pl = per_layer_variables(m)
    old = nested_dict({p: np.asarray(v[...]) for p, v in pl.items()})
    assert sorted(old["model"]["layers"]) == [0, 1, 2, 3, 4]
    d = save_orbax(m, tmp_path / "export")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(d / "params", old, force=True)
    loaded = load_orbax(d)
    for (p, a), (q, b) in zip(nnx.to_flat_state(nnx.state(loaded)), nnx.to_flat_state(nnx.state(m))):
        assert p == q
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]))

    params_pl = nested_dict({p: v[...] for p, v in pl.items() if isinstance(v, nnx.Param)})
    rest_pl = nested_dict({p: v[...] for p, v in pl.items() if not isinstance(v, nnx.Param)})
    dims_pl = nested_dict({p: muon_dims(v) for p, v in pl.items() if isinstance(v, nnx.Param)})
    oc = OptimConfig(warmup_steps=0, schedule="constant", ns_dtype="fp32")
    opt_pl = make_optimizer(dims_pl, 10, oc)
    grads_pl = jax.tree.map(lambda a: jnp.full(a.shape, 0.01, a.dtype), params_pl)
    _, ost_pl = opt_pl.update(grads_pl, opt_pl.init(params_pl), params_pl)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(m.config.to_release_dict()))
    ck = Checkpointer(run / "checkpoints", async_save=False)
    ck.save(1, (params_pl, rest_pl, ost_pl), {"step": 1, "data_step": 1}, force=True)
    ck.close()

    _, p_st, r_st = nnx.split(m, nnx.Param, ...)
    params, rest = nnx.to_pure_dict(p_st), nnx.to_pure_dict(r_st)
    opt = make_optimizer(muon_dims_tree(p_st), 10, oc)
    target = (params, rest, opt.init(params))
    (p2, r2, o2), meta = Checkpointer(run / "checkpoints").restore(1, target, layout)
    assert meta["step"] == 1 and jax.tree.structure(o2) == jax.tree.structure(target[2])
    for got, per_layer in ((p2, params_pl), (r2, rest_pl)):
        want = layout.stack(flat_dict(per_layer))
        for path, a in flat_dict(got).items():
            np.testing.assert_array_equal(np.asarray(a), np.asarray(want[path]))
    # the optimizer state: equal to the state of the same step taken on the stacked parameters (the moments are
    # elementwise, so stacking commutes with the step)
    _, ost = opt.update(jax.tree.map(lambda a: jnp.full(a.shape, 0.01, a.dtype), params), target[2], params)
    moments = [(a, b) for a, b in zip(jax.tree.leaves(o2), jax.tree.leaves(ost)) if getattr(b, "ndim", 0) > 0]
    assert len(moments) >= len(flat_dict(params)) and any(float(jnp.max(jnp.abs(b))) > 0 for _, b in moments)
    for a, b in zip(jax.tree.leaves(o2), jax.tree.leaves(ost)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)
    with pytest.raises(Exception, match="missing 0/model/run"):   # without the layout the mismatch is named
        Checkpointer(run / "checkpoints").restore(1, target)

    out = k3jax.save_pretrained(m, tmp_path / "release")
    from k3jax.io.safetensors import SafetensorsFile

    keys = set(SafetensorsFile(out / "model.safetensors").keys())
    assert "language_model.model.layers.2.self_attn.q_proj.weight" in keys and not any(".run." in k for k in keys)
    back = k3jax.load_pretrained(out)
    for (p, a), (q, b) in zip(nnx.to_flat_state(nnx.state(back)), nnx.to_flat_state(nnx.state(m))):
        assert p == q
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]))
