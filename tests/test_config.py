import json

import pytest

from k3jax import ConfigError, K3Config, preset_names


def k3_text():
    return K3Config.from_preset("k3").to_dict()


@pytest.mark.parametrize("name", preset_names())
def test_presets_load_and_validate(name):
    cfg = K3Config.from_preset(name)
    cfg.validate()
    assert len(cfg.layer_types) == cfg.num_hidden_layers


def test_k3_schedule_from_the_lists():
    cfg = K3Config.from_preset("k3")
    mla = [i for i, t in enumerate(cfg.layer_types) if t == "mla"]
    assert mla == list(range(3, 92, 4)) + [92]          # 0-based 3, 7, …, 91 and the last layer 92
    assert cfg.layer_types.count("kda") == 69
    assert cfg.moe_layers == list(range(1, 93))
    assert cfg.kda_gate == "lower_bound" and cfg.latent_moe and cfg.attn_res


def test_every_k3_feature_is_on_in_tiny():
    cfg = K3Config.from_preset("tiny")
    assert cfg.kda_gate == "lower_bound" and cfg.linear_attn_config.use_full_rank_gate
    assert cfg.mla_use_output_gate and cfg.attn_res and cfg.hidden_act == "situ"
    assert cfg.latent_moe and cfg.latent_moe_use_norm and cfg.first_k_dense_replace == 1
    assert cfg.layer_types[-1] == "mla"


def test_kimi_linear_preset_uses_kimi_linear_switches():
    cfg = K3Config.from_preset("kimi-linear-48b")
    assert cfg.kda_gate == "softplus" and not cfg.linear_attn_config.use_full_rank_gate
    assert not cfg.attn_res and not cfg.latent_moe and cfg.hidden_act == "silu" and cfg.q_lora_rank is None


def test_release_config_json_round_trip(tmp_path):
    src = K3Config.from_preset("test")
    top = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": src.to_dict(),
           "vision_config": {"vt_hidden_size": 1024}}
    (tmp_path / "config.json").write_text(json.dumps(top))
    cfg = K3Config.from_json(tmp_path)
    assert cfg.to_dict() == src.to_dict()


def test_transformers_attribute_names_are_accepted():
    d = K3Config.from_preset("kimi-linear-48b").to_dict()
    for a, b in [("num_experts", "num_local_experts"), ("num_experts_per_token", "num_experts_per_tok"),
                 ("num_shared_experts", "n_shared_experts"), ("moe_renormalize", "norm_topk_prob")]:
        d[b] = d.pop(a)
    cfg = K3Config.from_dict(d)
    assert cfg.num_experts == 256 and cfg.num_experts_per_token == 8 and cfg.num_shared_experts == 1


def test_layer_types_without_linear_attn_config():
    d = K3Config.from_preset("kimi-linear-48b").to_dict()
    lac = d.pop("linear_attn_config")
    d["layer_types"] = ["linear_attention" if (i + 1) in lac["kda_layers"] else "full_attention" for i in range(27)]
    d.update(linear_num_heads=32, linear_head_dim=128, linear_conv_kernel_dim=4)
    cfg = K3Config.from_dict(d)
    assert cfg.layer_types == K3Config.from_preset("kimi-linear-48b").layer_types


def _bad(mutate, match):
    d = k3_text()
    mutate(d)
    with pytest.raises(ConfigError, match=match):
        K3Config.from_dict(d)


def test_overlapping_layer_lists():
    _bad(lambda d: d["linear_attn_config"]["full_attn_layers"].append(1), r"linear_attn_config: layers \[1\]")


def test_missing_layers():
    _bad(lambda d: d["linear_attn_config"]["kda_layers"].remove(5), r"layers \[5\].*neither")


def test_zero_indexed_lists_are_rejected():
    _bad(lambda d: d["linear_attn_config"]["kda_layers"].insert(0, 0), r"kda_layers: entries \[0\] outside 1..93")


@pytest.mark.parametrize("lb", [-5.5, 0.0, 1.0, "x"])
def test_gate_lower_bound_range(lb):
    _bad(lambda d: d["linear_attn_config"].__setitem__("gate_lower_bound", lb), r"gate_lower_bound: expected .*\[-5, 0\)")


def test_unknown_hidden_act():
    _bad(lambda d: d.__setitem__("hidden_act", "gelu"), r"hidden_act: expected one of")


def test_heads_that_do_not_divide():
    _bad(lambda d: d.__setitem__("num_key_value_heads", 7), r"num_key_value_heads: must divide num_attention_heads=96")


def test_topk_larger_than_experts():
    _bad(lambda d: d.__setitem__("num_experts_per_token", 1000), r"num_experts_per_token: must be <= num_experts=896")


def test_rope_mla_rejected():
    _bad(lambda d: d.__setitem__("mla_use_nope", False), r"mla_use_nope")


def test_wrong_model_type():
    with pytest.raises(ConfigError, match="model_type is 'llama'"):
        K3Config.from_dict({"model_type": "llama"})
    with pytest.raises(ConfigError, match="model_type 'qwen' with a text_config"):
        K3Config.from_dict({"model_type": "qwen", "text_config": {}})


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset 'k4'"):
        K3Config.from_preset("k4")


def test_config_file_errors(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        K3Config.from_json(tmp_path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        K3Config.from_json(tmp_path / "missing")
