"""Release-format checkpoints in and out: multi-shard MXFP4 fixtures (packed here from the spec), round trips,
Orbax conversion, bad input, and ``inspect`` against the spec's figures."""

import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import k3jax
from k3jax import K3Config
from k3jax.cli import main as cli_main
from k3jax.io.orbax import load_orbax, save_orbax
from k3jax.io.safetensors import CheckpointError, SafetensorsFile
from k3jax.ops.mx import mxfp4_dequantize_np, mxfp4_quantize
from make_k3_fixture import dequant_spec, pack_spec, write_release_pair

IDS = jnp.asarray(np.random.default_rng(5).integers(0, 512, size=(2, 24)), jnp.int32)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    return write_release_pair(root / "mx", root / "dense", K3Config.from_preset("test").to_dict(), seed=3, shards=4)


def tensors_of(d) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(glob.glob(str(Path(d) / "*.safetensors"))):
        sf = SafetensorsFile(f)
        out.update({k: sf.get(k) for k in sf.keys()})
    return out


def flat_params(model) -> dict:
    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.split(model)[1])}


def test_spec_nibble_order_and_scale():
    """Spec §9.3 example: bytes 0x21, 0xA7 → 0.5, 1.0, 6.0, −1.0 at scale byte 127; 2^(u8−127)."""
    packed = np.array([[0x21, 0xA7] + [0] * 14], np.uint8)
    np.testing.assert_array_equal(mxfp4_dequantize_np(packed, np.array([[127]], np.uint8))[0, :4], [0.5, 1, 6, -1])
    np.testing.assert_array_equal(mxfp4_dequantize_np(packed, np.array([[130]], np.uint8))[0, :2], [4.0, 8.0])


def test_multishard_mxfp4_equals_dequantized_twin(pair):
    mx_dir, dense_dir = pair
    assert (mx_dir / "model.safetensors.index.json").exists() and len(glob.glob(str(mx_dir / "*.safetensors"))) == 4
    dense = k3jax.load_pretrained(dense_dir)
    ref = np.asarray(dense(IDS).logits)
    packed = k3jax.load_pretrained(mx_dir)                                   # default: keep experts packed
    assert packed.config.expert_dtype == "mxfp4"
    deq = k3jax.load_pretrained(mx_dir, expert_dtype="float32")
    # dequantized expert values are exact
    e = deq.model.layers[1].block_sparse_moe.experts
    np.testing.assert_array_equal(np.asarray(e.w1[...]), np.asarray(dense.model.layers[1].block_sparse_moe.experts.w1[...]))
    np.testing.assert_array_equal(np.asarray(deq(IDS).logits), ref)
    np.testing.assert_allclose(np.asarray(packed(IDS).logits), ref, rtol=0, atol=1e-6)


def test_unquantized_round_trip_is_bit_identical(pair, tmp_path):
    _, dense_dir = pair
    a = k3jax.load_pretrained(dense_dir)
    k3jax.save_pretrained(a, tmp_path / "out", shard_size="60KB", expert_format="dense")
    assert len(glob.glob(str(tmp_path / "out" / "model-*.safetensors"))) > 3
    b = k3jax.load_pretrained(tmp_path / "out")
    pa, pb = flat_params(a), flat_params(b)
    assert pa.keys() == pb.keys()
    for p in pa:
        assert pa[p].dtype == pb[p].dtype and pa[p].tobytes() == pb[p].tobytes(), p
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3" and "quantization_config" not in cfg["text_config"]


def test_mxfp4_reexport_is_byte_identical(pair, tmp_path):
    mx_dir, _ = pair
    model = k3jax.load_pretrained(mx_dir)
    k3jax.save_pretrained(model, tmp_path / "re", shard_size="100KB")
    src, out = tensors_of(mx_dir), tensors_of(tmp_path / "re")
    mx_keys = [k for k in src if k.endswith(("weight_packed", "weight_scale"))]
    assert len(mx_keys) == len(model.config.moe_layers) * 8 * 3 * 2      # MoE layers × experts × w1/w2/w3 × 2
    for k in mx_keys:
        assert out[k].dtype == np.uint8 and out[k].tobytes() == src[k].tobytes(), k
    for k in src:                                   # everything else keeps its values (A_log re-padded)
        if "A_log" not in k and not k.startswith(("vision_tower", "mm_projector")):
            np.testing.assert_array_equal(out[k], src[k])


def test_release_orbax_release_conversion(pair, tmp_path):
    mx_dir, _ = pair
    assert cli_main(["convert", str(mx_dir), str(tmp_path / "orbax")]) == 0
    model = load_orbax(tmp_path / "orbax")
    assert model.config.expert_dtype == "mxfp4"
    np.testing.assert_array_equal(np.asarray(model(IDS).logits), np.asarray(k3jax.load_pretrained(mx_dir)(IDS).logits))
    assert cli_main(["convert", str(tmp_path / "orbax"), str(tmp_path / "back"), "--shard-size", "200KB"]) == 0
    src, back = tensors_of(mx_dir), tensors_of(tmp_path / "back")
    for k in back:
        if "A_log" not in k:
            assert back[k].tobytes() == src[k].tobytes(), k
    save_orbax(k3jax.load_pretrained(mx_dir, expert_dtype="float32"), tmp_path / "dense_orbax")
    assert load_orbax(tmp_path / "dense_orbax").config.expert_dtype == "float32"


def test_release_scale_rule():
    """Shared exponent = amax/4 rounded to a power of two, up when the mantissa is ≥ 1.5 (spec §9.3)."""
    def exp_of(amax):
        w = np.zeros((1, 32), np.float32)
        w[0, 0] = amax
        return int(mxfp4_quantize(w)[1][0, 0]) - 127
    assert exp_of(4 * 1.2 * 8) == 3 and exp_of(4 * 1.49 * 8) == 3
    assert exp_of(4 * 1.5 * 8) == 4 and exp_of(4 * 1.9 * 8) == 4
    w = np.random.default_rng(0).normal(size=(16, 256)).astype(np.float32)
    p, s = mxfp4_quantize(w)
    deq = mxfp4_dequantize_np(p, s)
    scale = np.ldexp(1.0, s.astype(np.int32) - 127)
    ratio = np.abs(w).reshape(16, 8, 32).max(-1) / scale
    assert ratio.min() >= 3.0 and ratio.max() < 6.0                      # group max never clips
    # every element is within half a grid step of its E2M1 neighbours (step ≤ 2·scale at the top of the grid)
    assert np.all(np.abs(deq - w).reshape(16, 8, 32) <= scale[..., None] * 1.0 + 1e-7)
    # exporter packing agrees with the spec's own packing of the same codes
    codes = np.random.default_rng(1).integers(0, 16, size=(4, 64)).astype(np.uint8)
    sc = np.full((4, 2), 127, np.uint8)
    np.testing.assert_array_equal(mxfp4_dequantize_np(pack_spec(codes), sc), dequant_spec(codes, sc))


# ------------------------------------------------------------------------------------------------ bad input
def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def shard_with(d, key):
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    return d / idx["weight_map"][key]


def rewrite(path, fn):
    from safetensors.numpy import load_file, save_file
    t = load_file(str(path))
    fn(t)
    save_file(t, str(path))


P = "language_model.model.layers.2.block_sparse_moe.experts.3.w2."


def test_truncated_shard(pair, tmp_path):
    d = copy_ckpt(pair[0], tmp_path / "c")
    f = shard_with(d, P + "weight_packed")
    f.write_bytes(f.read_bytes()[:-64])
    with pytest.raises(CheckpointError, match=rf"{f.name}: tensor .* ends at byte .*truncated"):
        k3jax.load_pretrained(d)


def test_header_that_lies_about_sizes(pair, tmp_path):
    d = copy_ckpt(pair[0], tmp_path / "c")
    f = shard_with(d, P + "weight_packed")
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    key = next(k for k in header if k != "__metadata__")
    header[key]["shape"] = [header[key]["shape"][0] * 2] + header[key]["shape"][1:]
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    f.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])
    with pytest.raises(CheckpointError, match=rf"{f.name}: tensor '{key}': header says .* bytes"):
        k3jax.load_pretrained(d)


def test_index_naming_a_missing_file(pair, tmp_path):
    d = copy_ckpt(pair[0], tmp_path / "c")
    f = shard_with(d, P + "weight_packed")
    f.unlink()
    with pytest.raises(CheckpointError, match=rf"index.json: names \['{f.name}'\] which do not exist"):
        k3jax.load_pretrained(d)


def test_duplicated_tensor_across_shards(pair, tmp_path):
    d = copy_ckpt(pair[0], tmp_path / "c")
    key = P + "weight_scale"
    src = shard_with(d, key)
    other = next(p for p in d.glob("model-*.safetensors") if p != src)
    rewrite(other, lambda t: t.__setitem__(key, SafetensorsFile(src).get(key)))
    with pytest.raises(CheckpointError, match=r"w2\.weight_scale' appears twice"):
        k3jax.load_pretrained(d)


def test_wrong_dtype(pair, tmp_path):
    d = copy_ckpt(pair[0], tmp_path / "c")
    key = "language_model.model.layers.1.self_attn.q_proj.weight"
    rewrite(shard_with(d, key), lambda t: t.__setitem__(key, t[key].astype(np.int32)))
    with pytest.raises(CheckpointError, match=r"q_proj\.weight.*dtype int32, expected a floating-point"):
        k3jax.load_pretrained(d)


def test_weight_packed_shape_mismatch(pair, tmp_path):
    d = copy_ckpt(pair[0], tmp_path / "c")
    key = P + "weight_packed"
    rewrite(shard_with(d, key), lambda t: t.__setitem__(key, t[key][:, :8].copy()))
    with pytest.raises(CheckpointError, match=r"experts\.3\.w2\.weight': weight_packed \[32, 8\].*expected \[32, 16\]"):
        k3jax.load_pretrained(d)


def test_scale_byte_255(pair, tmp_path):
    d = copy_ckpt(pair[0], tmp_path / "c")
    key = P + "weight_scale"

    def poison(t):
        s = t[key].copy()
        s[5, 0] = 255
        t[key] = s
    rewrite(shard_with(d, key), poison)
    with pytest.raises(CheckpointError, match=r"w2\.weight': weight_scale byte 255 .* at \[5, 0\]"):
        k3jax.load_pretrained(d)


def test_nonzero_A_log_tail_in_shards(pair, tmp_path):
    d = copy_ckpt(pair[0], tmp_path / "c")
    key = "language_model.model.layers.0.self_attn.A_log"

    def poison(t):
        a = t[key].copy()
        a[-1] = 1.0
        t[key] = a
    rewrite(shard_with(d, key), poison)
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.A_log.*must be zero"):
        k3jax.load_pretrained(d)


def test_unknown_text_model_type(pair, tmp_path):
    d = copy_ckpt(pair[0], tmp_path / "c")
    c = json.loads((d / "config.json").read_text())
    c["text_config"]["model_type"] = "qwen3_moe"
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(k3jax.ConfigError, match=r"config\.json \(text_config\): model_type is 'qwen3_moe'"):
        k3jax.load_pretrained(d)


# ------------------------------------------------------------------------------------------------ inspect
def test_inspect_json_k3_matches_spec(capsys):
    assert cli_main(["inspect", "k3", "--json", "--S", "4096", "--R", "64"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["total_params"] == 2_779_484_476_000
    assert round(rep["activated_params"] / 1e9, 2) == 104.19
    st = rep["decode_state_bytes_per_sequence"]["131072"]
    assert st["kda_recurrent_state"] == 69 * 96 * 128 * 128 * 4                         # ≈ 414 MiB (spec §4.4)
    assert st["kda_conv_state"] == 69 * 3 * 3 * 12288 * 2                              # 14.6 MiB
    assert st["mla_latent_cache"] == 27_648 * 131072                                   # 27,648 B/token (§5.3)
    assert st["all_mla_model"] == 93 * 576 * 2 * 131072
    assert st["plain_mha_cache"] == 93 * 96 * (192 + 128) * 2 * 131072
    routed = 92 * 896 * 17_547_264                                                     # bytes per expert (§9.3)
    assert abs(rep["weight_bytes"]["mxfp4_experts"] - routed - 113.5e9) < 0.5e9        # rest ≈ 113.5 GB bf16
    a = rep["all_to_all_receive_per_rank"]
    assert a["moonep_tokens"] == 4096 * 16 and a["dropless_worst_tokens"] == 4096 * 16 * 64
    assert a["dispatch_width"] == 3584
    assert rep["flops_per_token"]["training"] > 3 * 2 * rep["activated_params"]


def test_inspect_checkpoint_dir_and_table(pair, capsys):
    assert cli_main(["inspect", str(pair[0])]) == 0
    out = capsys.readouterr().out
    assert "decode state per sequence" in out and "MoonEP" in out
    assert cli_main(["inspect", "nope-not-here"]) == 2


@pytest.mark.slow
def test_load_onto_an_expert_mesh(pair, tmp_path):
    """Each tensor goes straight to its NamedSharding: experts split over 4 of 8 simulated devices."""
    code = textwrap.dedent(f"""
        import os
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        import jax, numpy as np, jax.numpy as jnp, k3jax
        mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        m = k3jax.load_pretrained({str(pair[0])!r}, mesh=mesh)
        w = m.model.layers[1].block_sparse_moe.experts.w1_packed[...]
        assert w.sharding.spec[0] == "expert", w.sharding
        assert len(w.addressable_shards) == 8 and w.addressable_shards[0].data.shape[0] == 2
        ref = k3jax.load_pretrained({str(pair[0])!r})
        ids = jnp.asarray(np.arange(12).reshape(1, 12), jnp.int32)
        # both forwards jitted (one compile each; op by op over 8 devices most of this check's time went to
        # compiling every primitive for its shardings)
        from flax import nnx
        fwd = nnx.jit(lambda model, ids: model(ids).logits)
        print("maxdiff", float(np.max(np.abs(np.asarray(fwd(m, ids)) - np.asarray(fwd(ref, ids))))))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert float(res.stdout.split("maxdiff")[-1]) <= 1e-6


# ------------------------------------------------------------------------------ legacy Orbax checkpoints
def _legacy(tree: dict) -> dict:
    """A copy of a (full or non-Param) pure state dict as older k3jax versions saved it: every MoE layer's
    ``block_sparse_moe`` holds ``qb_bounds`` (added where the model no longer has it) and ``legacy_stat`` (a
    stand-in legacy key, so that dropping is exercised whether or not the model still has ``qb_bounds``)."""
    out = jax.tree.map(np.asarray, tree)
    n = 0
    for layer in out["model"]["layers"].values():
        moe = layer.get("block_sparse_moe")
        if moe is not None and "e_score_correction_bias" in moe:
            moe.setdefault("qb_bounds", np.asarray([-1.0, 1.0], np.float32))
            moe["legacy_stat"] = np.zeros(3, np.float32)
            n += 1
    assert n > 0
    return out


def _without_legacy(tree: dict) -> dict:
    out = jax.tree.map(lambda x: x, tree)
    for layer in out["model"]["layers"].values():
        for k in ("qb_bounds", "legacy_stat"):
            layer.get("block_sparse_moe", {}).pop(k, None)
    return out


def _flat(tree: dict) -> dict[str, np.ndarray]:
    return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
            for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _assert_same_state(a: dict, b: dict):
    fa, fb = _flat(a), _flat(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        assert fa[k].dtype == fb[k].dtype and fa[k].tobytes() == fb[k].tobytes(), k


@pytest.fixture(scope="module")
def small_model():
    return k3jax.K3ForCausalLM(K3Config.from_preset("test"), rngs=nnx.Rngs(7))


@pytest.fixture
def legacy_keys(monkeypatch):
    import k3jax.io.orbax as orbax_io

    monkeypatch.setattr(orbax_io, "LEGACY_KEYS", orbax_io.LEGACY_KEYS | {"legacy_stat"})
    assert "qb_bounds" in orbax_io.LEGACY_KEYS


def _export_with(model, d, fn):
    import orbax.checkpoint as ocp

    save_orbax(model, d)
    state = fn(nnx.to_pure_dict(nnx.state(model)))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(d / "params", state, force=True)
    return d


def _run_with(model, run, rest_fn=lambda r: r, step=3):
    """A ``k3jax train`` run directory whose checkpoint ``step`` holds (params, rest_fn(rest), Adam state)."""
    import optax

    from k3jax.train.checkpoint import Checkpointer

    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(model.config.to_release_dict()))
    (run / "train_config.json").write_text(json.dumps({"tokenizer": "bytes"}))
    _, p, r = nnx.split(model, nnx.Param, ...)
    params, rest = nnx.to_pure_dict(p), nnx.to_pure_dict(r)
    opt_state = optax.adam(1e-3).init(params)
    ck = Checkpointer(run / "checkpoints", async_save=False)
    ck.save(step, (params, rest_fn(rest), opt_state), {"step": step, "data_step": step, "loss": 1.5}, force=True)
    ck.close()
    return params, rest, opt_state


def test_legacy_orbax_export_loads(small_model, legacy_keys, tmp_path):
    d = _export_with(small_model, tmp_path / "export", _legacy)
    loaded = load_orbax(d)
    _assert_same_state(nnx.to_pure_dict(nnx.state(loaded)), nnx.to_pure_dict(nnx.state(small_model)))
    assert "legacy_stat" not in nnx.to_pure_dict(nnx.state(loaded))["model"]["layers"][1]["block_sparse_moe"]
    from k3jax.infer.load import load_model

    model, tok, what = load_model(str(d))
    assert what == f"Orbax export {d}" and tok.name == "bytes"


def test_legacy_training_run_loads_and_resumes(small_model, legacy_keys, tmp_path):
    from k3jax.infer.load import load_model, load_training_run
    from k3jax.train.checkpoint import Checkpointer

    run = tmp_path / "run"
    params, rest, opt_state = _run_with(small_model, run, _legacy)
    want = nnx.to_pure_dict(nnx.state(small_model))
    _assert_same_state(nnx.to_pure_dict(nnx.state(load_training_run(run))), want)
    model, _, what = load_model(str(run))
    assert what == f"training run {run}"
    _assert_same_state(nnx.to_pure_dict(nnx.state(model)), want)
    # training resume: into the live (params, rest, opt_state), here with a rest that has no qb_bounds at all
    target = (params, _without_legacy(rest), opt_state)
    (p2, r2, o2), meta = Checkpointer(run / "checkpoints").restore(3, target)
    assert meta == {"step": 3, "data_step": 3, "loss": 1.5}
    _assert_same_state(p2, params)
    _assert_same_state(r2, _without_legacy(rest))
    assert jax.tree.structure(o2) == jax.tree.structure(opt_state)
    for a, b in zip(jax.tree.leaves(o2), jax.tree.leaves(opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_orbax_mismatches_are_named(small_model, tmp_path):
    from k3jax.infer.load import load_training_run
    from k3jax.train.checkpoint import Checkpointer

    def unknown(t):
        t = jax.tree.map(np.asarray, t)
        t["model"]["layers"][1]["block_sparse_moe"]["mystery"] = np.zeros(2, np.float32)
        return t

    def missing(t):
        t = jax.tree.map(np.asarray, t)
        del t["model"]["norm"]["weight"]
        return t

    def misshapen(t):
        t = jax.tree.map(np.asarray, t)
        t["model"]["layers"][2]["block_sparse_moe"]["e_score_correction_bias"] = np.zeros(5, np.float32)
        return t

    bias = "model/layers/2/block_sparse_moe/e_score_correction_bias"
    for name, fn, pattern in [("unknown", unknown, r"unknown model/layers/1/block_sparse_moe/mystery \(shape \[2\]\)"),
                              ("missing", missing, r"missing model/norm/weight"),
                              ("misshapen", misshapen, rf"{bias}: saved shape \[5\], expected \[8\]")]:
        d = _export_with(small_model, tmp_path / name, fn)
        with pytest.raises(CheckpointError, match=rf"{d / 'params'}: does not match the model of "
                                                  rf"{d / 'config.json'}: {pattern}"):
            load_orbax(d)
    run = tmp_path / "run"
    params, rest, opt_state = _run_with(small_model, run, unknown)
    state_dir = run / "checkpoints" / "3" / "state"
    with pytest.raises(CheckpointError, match=rf"{state_dir}: .*unknown 1/model/layers/1/block_sparse_moe/mystery"):
        load_training_run(run)
    with pytest.raises(CheckpointError, match=rf"{state_dir}: .*unknown 1/model/layers/1/block_sparse_moe/mystery"):
        Checkpointer(run / "checkpoints").restore(3, (params, rest, opt_state))
