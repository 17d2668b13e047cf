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
