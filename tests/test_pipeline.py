"""Pipeline parallelism (k3jax.nn.pipeline): the stage split, the GPipe bubble, the blocks each stage seals,
and — on 8 host CPU devices (tests/pp_check.py) — the pipelined model equal to the unpipelined one in float64,
with MoonEP inside the stages, and the bytes its incremental AttnRes sends save per stage boundary."""

import types
from pathlib import Path

import numpy as np
import pytest

from conftest import run_device_check
from k3jax import K3Config
from k3jax.nn.pipeline import (PipelineError, StageSplit, bubble_fraction, describe, permute_links, split_run, stage_links,
                               stage_seals)
from k3jax.parallel.mesh import AXES, MeshError, parse_mesh
from k3jax.nn.scan import scan_plan

CHECK = Path(__file__).with_name("pp_check.py")


def test_split_bubble_and_seals():
    # K3 (spec: 93 layers; the run is layers 1–88, 22 units of (KDA, KDA, KDA, MLA)) over 4 stages: 6, 6, 5, 5 units
    k3 = K3Config.from_preset("k3")
    plan = scan_plan(k3)
    split = split_run(plan.repeats, 4)
    assert split == StageSplit((6, 6, 5, 5)) and split.width == 6 and split.offsets == (0, 6, 12, 17)
    # AttnRes blocks of 12 seal at layers 12, 24, …, 84 inside the run: stage 0 holds layers 1–24 (seals 12, 24),
    # stage 1 layers 25–48 (36, 48), stage 2 layers 49–68 (60), stage 3 layers 69–88 (72, 84)
    assert stage_seals(plan, split, 12) == (2, 2, 1, 2)
    assert stage_seals(plan, split, None) == (0, 0, 0, 0)
    assert describe(plan, split, 8, 12, 93) == (
        "pipeline: 4 stages, layers 1–24 | 25–48 | 49–68 | 69–88 (AttnRes blocks sealed per stage 2/2/1/2; the other "
        "5 layers on every stage), 8 micro-batches, GPipe bubble 0.27")
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11) and bubble_fraction(1, 5) == 0.0
    with pytest.raises(PipelineError, match="stage=30: the model's periodic run has 22 periods"):
        split_run(22, 30)
    assert parse_mesh("stage=4,data=2")["stage"] == 4
    with pytest.raises(MeshError, match="axes are stage, data, context, fsdp, expert, tensor"):
        parse_mesh("pipe=2")


def test_permute_bytes_per_link_and_stage_boundary():
    # two collective-permutes as XLA prints them (one operand by shape, one by name) on a stage=2,data=2 mesh:
    # partitions 0, 1 are stage 0 and 2, 3 stage 1 (row-major); f32[2,8] = 64 bytes, f32[3,2,8] = 192
    hlo = """
  %p.1 = f32[2,8]{1,0} parameter(0)
  %cp.1 = f32[2,8]{1,0} collective-permute(f32[2,8]{1,0} %p.1), channel_id=1, source_target_pairs={{0,2},{1,3}}
  %f.2 = f32[3,2,8]{2,1,0} fusion(%p.1), kind=kLoop, calls=%fused
  %cp.2 = f32[3,2,8]{2,1,0} collective-permute(%f.2), channel_id=2, source_target_pairs={{2,0},{0,2}}
"""
    assert permute_links(hlo) == {(0, 2): 64 + 192, (1, 3): 64, (2, 0): 192}
    mesh = types.SimpleNamespace(devices=np.zeros((2, 2, 1, 1, 1, 1)), axis_names=AXES)
    assert stage_links(hlo, mesh) == {"0→1": 64 + 64 + 192, "1→0": 192}


@pytest.fixture(scope="module")
def pp():
    return run_device_check(CHECK)


@pytest.mark.slow
@pytest.mark.xdist_group("pipeline")
def test_pipelined_model_equals_unpipelined(pp):
    """13 layers (layer 0 KDA + dense FFN, six (KDA, MLA) periods with MoE, AttnRes blocks of 3 not aligned with
    the period), float64, two packed documents per row, 2 micro-batches, the parameters placed by the sharding
    rules: on stage=4,data=2 the six periods split 2, 2, 1, 1 (uneven: the run's stacks [6, …] stay whole on every
    device); on stage=2,context=2,data=2 they split 3, 3 and each device holds its stage's 3 rows of every stack —
    and receives its gradient in the same 3 rows — while each stage's layers run context parallel (the second
    document starts on rank 0 and crosses into rank 1). Loss, logits, expert counts, router scores and every
    gradient equal the unpipelined model's on one device to float64 rounding (MoonEP inside the stages is
    pp_train_check's stage=2,expert=2,data=2 run)."""
    assert pp["plan"] == [1, 2, 6] and pp["grad_scale"] > 1e-2
    for name in ("stage4", "stage2_context2"):
        r = pp[name]
        assert r["counts_equal"], name
        for key in ("loss", "logits", "scores", "grads"):
            assert r[key] <= 1e-12, (name, key, r[key])
    assert (pp["stage4"]["run_rows_per_device"], pp["stage4"]["grad_rows_per_device"]) == (6, 6)
    assert (pp["stage2_context2"]["run_rows_per_device"], pp["stage2_context2"]["grad_rows_per_device"]) == (3, 3)


@pytest.mark.slow
@pytest.mark.xdist_group("pipeline")
def test_incremental_sends_move_fewer_bytes_than_forwarding_every_block(pp):
    """The compiled forward on stage=4,data=2, bytes per stage boundary against the schedule's closed form. A
    micro-batch is 2 rows, one per data rank: a row's partial sum or block is r = 16 tokens × hidden × 8 bytes per
    device, and each stage link carries one per data rank (2). Each tick a stage sends the next one its partial
    sum; with incremental sends it also sends every later stage s + k its ring slot of n = max seals = 1 block (the
    six periods split 2, 2, 1, 1; blocks of 3 seal at layers 3, 6, 9, 12: one on each stage). Forwarding
    instead sends the next stage the (S − 1)·n blocks a stage can hold. So: new s→s+1 = 2·(1 + n)·r, s→s+k
    (k ≥ 2) = 2·n·r; all s→s+1 = 2·(1 + 3n)·r and nothing else (measured in total: 147,456 against 196,608 bytes,
    −25%)."""
    from test_scan import k3_pattern

    cfg = k3_pattern(13, 3, mla=[2, 4, 6, 8, 10, 12])
    plan = scan_plan(cfg)
    n = max(stage_seals(plan, split_run(plan.repeats, 4), 3))
    r = 16 * cfg.hidden_size * 8
    assert n == 1
    assert pp["boundary_bytes_new"] == {f"{s}→{t}": 2 * ((t == s + 1) + n) * r
                                        for s in range(4) for t in range(s + 1, 4)}
    assert pp["boundary_bytes_all"] == {f"{s}→{s + 1}": 2 * (1 + 3 * n) * r for s in range(3)}
    assert pp["permute_bytes_new"] < 0.8 * pp["permute_bytes_all"]


@pytest.mark.slow
@pytest.mark.xdist_group("pipeline")
def test_pipeline_training_follows_data_parallel():
    """``train`` (pp_check's model at 11 layers — five (KDA, MLA) periods — in fp32, Quantile Balancing and Per-Head
    Muon on, 4 micro-batches) on stage=4,data=2 and on stage=2,expert=2,data=2 (MoonEP inside the stages) against
    data=8, 6 steps: the losses agree to fp32 reordering, up to what Quantile Balancing makes of it.

    Tolerance 2e-4 relative. QB solves each layer's bias from a histogram of router scores (1000 bins): the meshes'
    fp32 reorderings (~1e-7) can move a score across a bin edge, which moves a bias by a bin and reroutes tokens —
    a discrete step in the loss, not a drift. Measured (6 steps): with ``balance=none`` stage=4,data=2 follows
    data=8 to ≤ 2.4e-7 relative at every step; with QB the first three steps agree to 1e-7, then step 3 differs by
    1.1e-5 and step 5 by 5.5e-5 (a bin moved). Before the run of layers was stored stacked the reorderings happened
    to move no bin (≤ 3.4e-7 over 10 steps). A wrong pipeline (a stage's layers, blocks or micro-batch rows mixed
    up) moves the loss by > 1e-2 from the first step; the exact check is pp_check's float64 model (≤ 1e-12)."""
    res = run_device_check(CHECK.with_name("pp_train_check.py"), "6", timeout=1500)
    ref = res["data=8"]
    assert len(ref) == 6 and ref[-1] < ref[0]                          # it learns
    for mesh in ("stage=4,data=2", "stage=2,expert=2,data=2"):
        for i, (a, b) in enumerate(zip(ref, res[mesh])):
            assert abs(a - b) <= 2e-4 * abs(a), (mesh, i, a, b)
        assert abs(ref[0] - res[mesh][0]) <= 1e-6 * abs(ref[0]), mesh    # the first step: one forward, no QB yet
