"""The small models of the checks beside the tests (imported by the subprocess scripts too, so no pytest here).

The ``test`` preset is already the smallest model with every layer kind the code paths touch: layer 1 KDA with the
dense MLP, layer 2 KDA with the routed MoE, layer 3 MLA with the routed MoE (Block AttnRes, blocks of 2, crosses a
block boundary and ends on a partial block). Compilation is most of the suite's time on CPU, and a layer repeated
only adds to it, so the tests run it; :func:`scannable` adds the repeats a scan needs."""

import dataclasses

from k3jax import K3Config

# the EP/CP training checks (ep_train_check, ep_distributed_check, cp_check): the test preset with fp32 Newton–Schulz
# (they compare meshes to one device at 1e-5 of the loss, and a bf16 iteration would turn the meshes' fp32
# reordering differences into bf16 roundings)
MODEL = ["model=test", "optim.ns_dtype=fp32"]


def scannable() -> K3Config:
    """The test preset's widths at 5 layers — KDA (dense FFN), KDA, KDA, MLA, MLA, the later four with the routed
    MoE — so that layers 1–2 repeat: :func:`k3jax.nn.scan.scan_plan` runs them as a scan of 2 (``(1, 1, 2)``), and
    AttnRes blocks of 2 seal at layer 2, inside the run, and at layer 4, after it."""
    cfg = K3Config.from_preset("test")
    lac = dataclasses.replace(cfg.linear_attn_config, kda_layers=[1, 2, 3], full_attn_layers=[4, 5])
    return cfg.replace(num_hidden_layers=5, linear_attn_config=lac)
