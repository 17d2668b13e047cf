"""Context parallelism (k3jax.parallel.context) on 8 host CPU devices against one device: KDA by affine state
summaries, the short conv's halo, MLA over the gathered latent, the whole model, and the compiled program's
collective bytes at two sequence lengths; and Per-Head Muon under FSDP/TP without whole-parameter gathers. One
subprocess (tests/cp_check.py) computes everything; the training run on a context mesh is in test_ep (it shares
that file's 8-device training subprocess)."""

from pathlib import Path

import pytest

from conftest import run_device_check
from k3jax.config import K3Config
from k3jax.costs import context_parallel

CHECK = Path(__file__).with_name("cp_check.py")


@pytest.fixture(scope="module")
def cp():
    return run_device_check(CHECK)


def close(diff: float, scale: float, tol: float = 1e-5) -> bool:
    return diff <= tol * max(1.0, scale)


@pytest.mark.slow
@pytest.mark.xdist_group("context_parallel")
def test_kda_context_parallel_equals_recurrence_and_chunked_kernel(cp):
    """Mesh context=4,data=2, T = 100 (25 tokens per rank: not a multiple of the 32-token chunk), an initial
    state, packed documents starting on a rank boundary and inside ranks: outputs, final state and the gradients
    of q, k, v, g, β and the initial state against ``kda_recurrent`` and ``kda_chunked`` (fp32)."""
    k = cp["kernels"]["kda"]
    for name in ("out_vs_recurrent", "state_vs_recurrent", "out_vs_chunked", "state_vs_chunked"):
        assert k[name] <= 1e-5, (name, k[name])
    for ref in ("grads_vs_recurrent", "grads_vs_chunked"):
        for i, (d, s) in enumerate(zip(k[ref], k["grad_scale"])):
            assert close(d, s), (ref, "qkvgβS0"[i] if i < 5 else "S0", d, s)
    assert min(k["grad_scale"]) > 1e-3                                         # every gradient is exercised
    assert cp["kernels"]["kda_plain"]["out"] <= 1e-5 and cp["kernels"]["kda_plain"]["state"] <= 1e-5


@pytest.mark.slow
@pytest.mark.xdist_group("context_parallel")
def test_conv_halo_and_mla_context_parallel_equal_one_device(cp):
    """The short conv with its W−1 halo from the previous rank (documents starting inside the halo) and MLA over
    the all-gathered latent (documents crossing ranks): values and gradients against the unsplit functions."""
    c, m = cp["kernels"]["conv"], cp["kernels"]["mla"]
    assert c["out"] <= 1e-5 and c["out_no_reset"] <= 1e-5
    assert all(d <= 1e-4 for d in c["grads"]), c["grads"]
    assert m["out"] <= 1e-5 and m["out_no_segments"] <= 1e-5
    assert all(d <= 1e-4 for d in m["grads"]), m["grads"]


@pytest.mark.slow
@pytest.mark.xdist_group("context_parallel")
def test_model_on_a_context_mesh_equals_one_device(cp):
    """The 3-layer test model (KDA + dense MLP, KDA + MoE, MLA + MoE; Block AttnRes) on mesh context=4,data=2 with
    packed documents (routed experts per device on its own tokens: no expert axis): logits and every parameter's
    gradient == one device (≤ 1e-5, fp32)."""
    for key in ("model", "scanned"):     # and the 5-layer preset scanned on the mesh vs unrolled on one device
        d = cp[key]
        assert close(d["logits"], d["logit_scale"]), (key, d)
        assert close(d["grads"], d["grad_scale"]), (key, d)
        assert d["grad_scale"] > 1e-3


@pytest.mark.slow
@pytest.mark.xdist_group("context_parallel")
def test_kda_collective_bytes_do_not_grow_with_sequence_length(cp):
    """Read from the compiled forward + backward program on context=4: the collectives' operand bytes are the
    same at T = 4096 and T = 32768, and the all-gather carries exactly the summaries (M, S̃) = B·H·K·(K+V) fp32."""
    short, long_ = cp["hlo"]["4096"], cp["hlo"]["32768"]
    assert short == long_, (short, long_)
    assert short["all-gather"] == 1 * 2 * 16 * (16 + 16) * 4
    assert short["reduce-scatter"] == 4 * short["all-gather"]                   # its transpose, over 4 ranks
    cfg = K3Config.from_preset("test")
    lac = cfg.linear_attn_config
    rep = context_parallel(cfg, 4, 4096, batch=1)
    assert rep["kda_summary_send_per_layer"] == lac.num_heads * lac.head_dim * 2 * lac.head_dim * 4
    assert rep["mla_latent_send_per_layer"] == 1024 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert context_parallel(cfg, 4, 32768)["kda_summary_send_per_layer"] == rep["kda_summary_send_per_layer"]


@pytest.mark.slow
@pytest.mark.xdist_group("context_parallel")
def test_sharded_per_head_muon_equals_optax_without_whole_parameter_gathers(cp):
    """Mesh fsdp=4,tensor=2, the 3-layer model's 43 Muon parameters (attention projections per head, routed experts
    per expert, single matrices along their columns with the Gram matrix reduced over devices): three updates equal
    optax's Muon on one device (≤ 1e-6 of an update scale ~1e-3), and the compiled update has no all-gather at all,
    where the naive plan gathers every sharded momentum whole; its temporary memory is below the naive plan's."""
    m = cp["muon"]
    assert m["muon_params"] >= 40 and m["update_scale"] > 1e-4
    assert m["blocks"]["max_update_diff"] <= 1e-6 and m["naive"]["max_update_diff"] <= 1e-6, m
    assert m["blocks"]["all_gathers"] == 0, m["blocks"]
    # the naive plan (same code, every momentum gathered whole) shows what the check would catch
    assert m["naive"]["largest_all_gather_elements"] >= m["smallest_muon_param_elements"], m["naive"]
    assert m["blocks"]["temp_bytes"] < m["naive"]["temp_bytes"], m
