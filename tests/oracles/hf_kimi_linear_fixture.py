"""Write a tiny random transformers ``KimiLinearForCausalLM`` checkpoint plus its fp32 logits (run as a script).

    python hf_kimi_linear_fixture.py OUT_DIR [--q-lora-rank N] [--n-group G] [--hf-names] [--and OUT_DIR2 …]

(``--and`` starts another checkpoint, written by the same process: torch and transformers are imported once.)

Every parameter is randomised (nothing left at ones/zeros, the router bias large enough to change routing), so the
comparison is sensitive to each piece. ``fla`` is blocked before transformers is imported so that the pure-torch
KDA fallbacks run (fla's triton kernels do not run on CPU). ``--hf-names`` saves transformers' in-memory naming
(fused conv1d, forget_gate.*, experts.gate_up_proj) instead of the original Moonshot naming.
"""

import argparse
import json
import math
import sys
from pathlib import Path

for _blocked in ("fla", "causal_conv1d", "kernels"):
    sys.modules[_blocked] = None

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402


def build(q_lora_rank: int | None, n_group: int) -> KimiLinearForCausalLM:
    cfg = KimiLinearConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, num_local_experts=8, num_experts_per_tok=2,
        n_group=n_group, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.446, kv_lora_rank=32,
        q_lora_rank=q_lora_rank, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, hidden_act="silu",
        max_position_embeddings=4096, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, first_k_dense_replace=1, mla_use_nope=True,
        linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [4], "head_dim": 16, "num_heads": 4,
                            "short_conv_kernel_size": 4},
    )
    model = KimiLinearForCausalLM._from_config(cfg, torch_dtype=torch.float32, attn_implementation="eager",
                                               experts_implementation="eager")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            rn = lambda std, mean=0.0: torch.randn(p.shape, generator=gen) * std + mean  # noqa: E731
            if name.endswith("A_log"):
                new = torch.rand(p.shape, generator=gen) * 2.5 - 1.5
            elif name.endswith("dt_bias"):
                new = rn(1.0)
            elif name.endswith("e_score_correction_bias"):
                new = rn(0.3)
            elif "norm" in name:
                new = rn(0.2, 1.0)
            elif name.endswith("conv1d.weight"):
                new = rn(0.5)
            elif name.endswith("embed_tokens.weight"):
                new = rn(1.0)
            else:
                new = rn(1.0 / math.sqrt(p.shape[-1]))
            p.copy_(new.to(p.dtype))
    return model.eval()


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--q-lora-rank", type=int, default=0)
    ap.add_argument("--n-group", type=int, default=1)
    ap.add_argument("--hf-names", action="store_true")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    model = build(a.q_lora_rank or None, a.n_group)
    out = Path(a.out)
    model.save_pretrained(out, save_original_format=not a.hf_names)
    ids = torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.float()
        # HF's own prefill + one-token decode, as a check of the oracle itself
        pre = model(input_ids=ids[:, :-1], use_cache=True)
        step = model(input_ids=ids[:, -1:], past_key_values=pre.past_key_values, use_cache=True).logits[:, -1]
        # HF's prefill of the first PREFIX tokens, then its cached decode of the rest, token by token
        PREFIX = 60
        state = model(input_ids=ids[:, :PREFIX], use_cache=True)
        cache, dec = state.past_key_values, [state.logits[:, -1].float()]
        for t in range(PREFIX, ids.shape[1] - 1):
            r = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = r.past_key_values
            dec.append(r.logits[:, -1].float())
        # and HF's own greedy generate from the prefix, with the logits of each step (its cached decode)
        gen = model.generate(ids[:, :PREFIX], max_new_tokens=12, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    np.save(out / "decode_logits.npy", torch.stack(dec, 1).numpy())      # logits for positions PREFIX−1 … T−2
    np.save(out / "generated.npy", gen.sequences[:, PREFIX:].numpy())
    np.save(out / "generated_logits.npy", torch.stack(gen.logits, 1).float().numpy())   # [2, 12, V]
    np.save(out / "input_ids.npy", ids.numpy())
    np.save(out / "logits.npy", logits.numpy())
    print(json.dumps({"decode_vs_full": float((step - logits[:, -1]).abs().max()),
                      "tensors": len(model.state_dict())}))


if __name__ == "__main__":
    args = sys.argv[1:]
    while "--and" in args:
        i = args.index("--and")
        main(args[:i])
        args = args[i + 1:]
    main(args)
