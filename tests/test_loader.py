"""Strict loading of release-format safetensors: every failure names the tensor and the file."""

import json
import logging
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import k3jax
from conftest import jit_forward
from k3jax import K3Config
from k3jax.io.safetensors import CheckpointError
from make_k3_fixture import write_random_k3_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("release")
    write_random_k3_checkpoint(d, K3Config.from_preset("test").to_dict(), seed=1)
    return d


def mutated(ckpt, tmp_path, fn):
    shutil.copy(ckpt / "config.json", tmp_path / "config.json")
    t = load_file(str(ckpt / "model.safetensors"))
    fn(t)
    save_file(t, str(tmp_path / "model.safetensors"))
    return tmp_path


K = "language_model.model.layers.1.self_attn."


def test_loads_and_skips_vision_with_one_log_line(ckpt, caplog):
    with caplog.at_level(logging.INFO, logger="k3jax.io"):
        model = k3jax.load_pretrained(ckpt)
    assert jit_forward(model, jnp.zeros((1, 4), jnp.int32)).logits.shape == (1, 4, 512)
    lines = [r.message for r in caplog.records if "vision_tower/mm_projector" in r.message]
    assert len(lines) == 1 and "skipped 2" in lines[0]


def test_without_language_model_prefix(ckpt, tmp_path):
    d = mutated(ckpt, tmp_path, lambda t: [t.__setitem__(k[len("language_model."):], t.pop(k))
                                           for k in list(t) if k.startswith("language_model.")])
    a = jit_forward(k3jax.load_pretrained(ckpt), jnp.ones((1, 4), jnp.int32)).logits
    b = jit_forward(k3jax.load_pretrained(d), jnp.ones((1, 4), jnp.int32)).logits
    np.testing.assert_array_equal(a, b)


def test_missing_tensor_is_named(ckpt, tmp_path):
    d = mutated(ckpt, tmp_path, lambda t: t.pop(K + "q_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing.*layers\.1\.self_attn\.q_proj\.weight"):
        k3jax.load_pretrained(d)


def test_wrong_shape_names_tensor_and_file(ckpt, tmp_path):
    d = mutated(ckpt, tmp_path, lambda t: t.__setitem__(K + "b_proj.weight", np.zeros((3, 64), np.float32)))
    with pytest.raises(CheckpointError, match=r"b_proj\.weight.*model\.safetensors.*shape \[3, 64\], expected \[2, 64\]"):
        k3jax.load_pretrained(d)


def test_nonzero_A_log_padding(ckpt, tmp_path):
    def bad(t):
        a = t[K + "A_log"].copy()
        a[-1] = 0.5
        t[K + "A_log"] = a
    d = mutated(ckpt, tmp_path, bad)
    with pytest.raises(CheckpointError, match=r"A_log.*padding entries A_log\[2:\] must be zero"):
        k3jax.load_pretrained(d)


def test_unknown_tensor(ckpt, tmp_path):
    d = mutated(ckpt, tmp_path, lambda t: t.__setitem__("language_model.model.mtp.0.weight", np.zeros(2, np.float32)))
    with pytest.raises(CheckpointError, match=r"not expect.*mtp\.0\.weight"):
        k3jax.load_pretrained(d)


def test_duplicate_across_files(ckpt, tmp_path):
    shutil.copy(ckpt / "config.json", tmp_path / "config.json")
    shutil.copy(ckpt / "model.safetensors", tmp_path / "a.safetensors")
    save_file({K + "o_norm.weight": np.ones(32, np.float32)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(CheckpointError, match=r"o_norm\.weight' appears twice.*a\.safetensors.*b\.safetensors"):
        k3jax.load_pretrained(tmp_path)


def test_truncated_file(ckpt, tmp_path):
    shutil.copy(ckpt / "config.json", tmp_path / "config.json")
    raw = (ckpt / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(raw[: len(raw) - 1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor .* ends at byte .* \(truncated\?\)"):
        k3jax.load_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(raw[:5])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated"):
        k3jax.load_pretrained(tmp_path)


def test_wrong_text_model_type(ckpt, tmp_path):
    shutil.copy(ckpt / "model.safetensors", tmp_path / "model.safetensors")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["text_config"]["model_type"] = "deepseek_v3"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(k3jax.ConfigError, match="config.json.*model_type is 'deepseek_v3'"):
        k3jax.load_pretrained(tmp_path)


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        k3jax.load_pretrained(tmp_path / "nope")
