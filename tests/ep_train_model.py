"""The model of the EP training checks (ep_train_check, ep_distributed_check): the test preset cut to 3 layers.

Layer 1 is KDA with the dense MLP, layer 2 KDA with the routed MoE, layer 3 MLA with the routed MoE, so every
layer kind the sharding rules and the expert exchange touch is still there (and Block AttnRes, blocks of 2, still
crosses a block boundary); the two KDA+MoE and MLA+MoE layers the 5-layer preset repeats only added compile time
(the 8-device step compiles are most of these checks' time on CPU)."""

import json

from k3jax import K3Config

_lac = {**K3Config.from_preset("test").linear_attn_config.to_dict(), "kda_layers": [1, 2], "full_attn_layers": [3]}
# fp32 Newton–Schulz: the checks compare meshes to one device at 1e-5 of the loss, and a bf16 iteration would turn
# the meshes' fp32 reordering differences into bf16 roundings
MODEL = ["model=test", "model.num_hidden_layers=3", f"model.linear_attn_config={json.dumps(_lac)}",
         "optim.ns_dtype=fp32"]
