"""Native vision (K3_VISION_SPEC): the MoonViT-V2 tower, patchmergerv2 projector, processor, static patch
buckets, splicing, loading and ``k3jax generate --image`` — checked against
the independent float64 NumPy reference (``reference_vision_numpy``, written from the spec) and torch.

One tiny multimodal checkpoint in the release naming (the ``test`` text preset cut to 2 layers + the spec §11 vision config:
2 blocks, D 64, 4 heads of 24, pos grid 8×8×4) with a release-layout tokenizer is shared by the module."""

import copy
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

import reference_vision_numpy as ref
from k3jax.config import ConfigError
from k3jax.infer.multimodal import MultimodalGenerator, image_chat_ids
from k3jax.io.hf import load_pretrained
from k3jax.io.safetensors import CheckpointError
from k3jax.ops.vision import gelu_erf, gelu_tanh, position_embedding
from k3jax.vision import MediaConfig, ProcessedImage, PromptError, VisionConfig, process_image, splice_prompt
from k3jax.vision.packing import DEFAULT_BUCKETS, bilinear_taps, plan_packing
from k3jax.vision.processor import ImageError, target_size
from make_vision_fixture import K3_MEDIA_CFG, TINY_VISION_CONFIG, write_random_multimodal_checkpoint
from reference_k3_numpy import load_release_checkpoint
from tokenizer_fixture import CHAT_IDS, write_release_tokenizer

PAD = CHAT_IDS["<|media_pad|>"]          # 277 in the 512-id test layout (163605 in the release)
EOM = CHAT_IDS["<|end_of_msg|>"]
TOL = 1e-4


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(1.0, np.max(np.abs(b))))


def rgb(w, h, seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


def rgba(w, h, seed):
    a = np.random.default_rng(seed).integers(0, 256, (h, w, 4), dtype=np.uint8)
    return Image.fromarray(a, "RGBA")


def palette(w, h, seed):
    img = rgb(w, h, seed).quantize(16)
    img.info["transparency"] = 3
    return img


@pytest.fixture(scope="module")
def mm(tmp_path_factory):
    d = tmp_path_factory.mktemp("k3mm")
    top = json.loads((__import__("importlib.resources").resources.files("k3jax") / "presets" / "test.json")
                     .read_text())
    # the test preset cut to one KDA and one MLA layer (dense then MoE, AttnRes across them): what splicing needs,
    # at 2/5 of the compile time
    la = dict(top["text_config"]["linear_attn_config"], kda_layers=[1], full_attn_layers=[2])
    text = dict(top["text_config"], bos_token_id=CHAT_IDS["[BOS]"], eos_token_id=EOM, pad_token_id=CHAT_IDS["[PAD]"],
                num_hidden_layers=2, linear_attn_config=la)
    write_random_multimodal_checkpoint(str(d), text, TINY_VISION_CONFIG, seed=3)
    cfg = json.loads((d / "config.json").read_text())
    cfg["media_placeholder_token_id"] = PAD
    (d / "config.json").write_text(json.dumps(cfg))
    write_release_tokenizer(d)
    model = load_pretrained(d, vision=True)
    tc, tt = load_release_checkpoint(str(d))
    vc, media, vt = ref.load_vision_checkpoint(str(d))
    from k3jax.text.tokenizer import TiktokenTokenizer

    images = {"A": rgb(56, 84, 1), "B": rgb(112, 70, 2), "C": rgb(168, 140, 3), "RGBA": rgba(42, 30, 4)}
    return type("MM", (), dict(dir=d, model=model, tc=tc, tt=tt, vc=vc, media=media, vt=vt, images=images,
                               tok=TiktokenTokenizer(d), encoder=model.encoder(), eps=2.0 ** -23))


def ref_features(mm, pils, media=None, eps=None):
    pvs, grids = [], []
    for im in pils:
        pv, g, _ = ref.process_image(im, media or mm.media)
        pvs.append(pv)
        grids.append(g)
    merged = ref.vision_tower(mm.vc, mm.vt, np.concatenate(pvs), grids, mm.eps if eps is None else eps)
    feats = ref.project(mm.vc, mm.vt, merged)
    counts = [g[1] * g[2] // 4 for g in grids]
    cuts = np.cumsum([0] + counts)
    return [merged[a:b] for a, b in zip(cuts[:-1], cuts[1:])], [feats[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


# ------------------------------------------------------------------------------------------------ processor
def test_processor_matches_the_reference_and_the_size_rule():
    small = dict(K3_MEDIA_CFG, in_patch_limit=96)            # 300×200 is downscaled by the patch budget
    side = dict(K3_MEDIA_CFG, patch_limit_on_one_side=8)      # 400×30 by the side limit
    before = dict(K3_MEDIA_CFG, transparent_bg_fill_stage="before_resize")
    cases = [(rgb(56, 84, 1), K3_MEDIA_CFG), (rgba(42, 30, 4), K3_MEDIA_CFG), (rgb(300, 200, 5), small),
             (rgb(400, 30, 6), side), (palette(50, 40, 7), K3_MEDIA_CFG), (rgba(90, 60, 8), before),
             (Image.fromarray(np.full((33, 20), 77, np.uint8), "L"), K3_MEDIA_CFG)]
    for img, mc in cases:
        mine = process_image(img, MediaConfig.from_dict(mc))
        pv, grid, size = ref.process_image(img, mc)
        assert mine.grid == grid and mine.size == size
        assert np.max(np.abs(mine.pixel_values - pv)) < 1e-6
    assert process_image(rgb(300, 200, 5), MediaConfig.from_dict(small)).resized == (171, 114)  # ⌊300·√(96/294)⌋
    # spec §8.2 figures (target_size only: no pixels needed)
    for (w, h), tokens in [((640, 480), 414), ((7168, 7168), 16384), ((1861, 7041), 16817)]:
        _, (w2, h2) = target_size(w, h, MediaConfig())
        assert (w2 // 14) * (h2 // 14) // 4 == tokens
    assert process_image(rgb(640, 480, 0)).grid == (1, 36, 46)
    # the largest bucket holds every image the size rule can produce (scan of extreme shapes)
    worst = max((target_size(w, h, MediaConfig())[1][0] // 14) * (target_size(w, h, MediaConfig())[1][1] // 14)
                for w in range(3000, 9000, 37) for h in (w // 4, w // 2 + 13, w, 2 * w + 5))
    assert worst <= DEFAULT_BUCKETS[-1]


def test_bad_images_raise_naming_the_image(tmp_path):
    (tmp_path / "x.png").write_bytes(b"not an image")
    for bad, fragment in [(tmp_path / "x.png", "not a decodable image"), (b"", "not a decodable image"),
                          (tmp_path / "missing.png", "no such file"), (np.zeros((4, 4, 2), np.uint8), "shape"),
                          (3.5, "expected a path")]:
        with pytest.raises(ImageError, match=fragment) as e:
            process_image(bad, where="image 2")
        assert str(e.value).startswith("image 2:")
    with pytest.raises(ImageError, match="exceed the limit"):
        import io
        buf = io.BytesIO()
        rgb(64, 64, 0).save(buf, "PNG")
        process_image(buf.getvalue(), max_pixels=1000)


def test_interpolation_and_gelus_against_torch():
    from k3jax.ops.vision import bilinear_resize_reference, packed_attention, packed_attention_reference

    G = np.random.default_rng(0).standard_normal((8, 8, 16)).astype(np.float32)
    for h, w in [(6, 4), (10, 12), (8, 8), (3, 17)]:
        want = torch.nn.functional.interpolate(torch.from_numpy(G).permute(2, 0, 1)[None], size=(h, w),
                                               mode="bilinear").numpy()[0].transpose(1, 2, 0)
        y0, y1, ly = bilinear_taps(h, 8)
        x0, x1, lx = bilinear_taps(w, 8)
        r, c = [a.reshape(-1) for a in np.meshgrid(np.arange(h), np.arange(w), indexing="ij")]
        taps = np.stack([y0[r] * 8 + x0[c], y0[r] * 8 + x1[c], y1[r] * 8 + x0[c], y1[r] * 8 + x1[c]], -1)
        wts = np.stack([(1 - ly[r]) * (1 - lx[c]), (1 - ly[r]) * lx[c], ly[r] * (1 - lx[c]), ly[r] * lx[c]], -1)
        got = np.asarray(position_embedding(G, taps, wts.astype(np.float32))).reshape(h, w, 16)
        assert np.max(np.abs(got - want)) < 1e-5
        assert np.max(np.abs(np.asarray(bilinear_resize_reference(G, h, w)) - want)) < 1e-5
        assert np.max(np.abs(ref.bilinear_matrix(h, 8) @ G[..., 0] @ ref.bilinear_matrix(w, 8).T
                             - want[..., 0])) < 1e-5
    # blocked packed attention against its dense reference

    q, k, v = (np.random.default_rng(i).standard_normal((64, 2, 8)).astype(np.float32) for i in range(3))
    seg = np.repeat(np.array([0, 1, 1, -1]), 16).astype(np.int32)
    blocked = np.asarray(packed_attention(q, k, v, seg, block=24))          # 3 blocks, the last padded
    assert np.max(np.abs(blocked - np.asarray(packed_attention_reference(q, k, v, seg)))) < 1e-5
    z = np.linspace(-8, 8, 1001, dtype=np.float32)
    tz = torch.from_numpy(z)
    assert np.max(np.abs(np.asarray(gelu_tanh(z)) - torch.nn.functional.gelu(tz, approximate="tanh").numpy())) < 1e-6
    assert np.max(np.abs(np.asarray(gelu_erf(z)) - torch.nn.functional.gelu(tz).numpy())) < 1e-6


# --------------------------------------------------------------------------------------------- tower oracle
def test_tower_and_projector_match_the_float64_reference(mm):
    """Three sizes, an RGBA image and one the size rule downscales, packed in one bucket."""
    small = MediaConfig.from_dict(dict(K3_MEDIA_CFG, in_patch_limit=96))
    big = rgb(300, 200, 5)
    pils = [mm.images["A"], mm.images["B"], mm.images["C"], mm.images["RGBA"]]
    procs = [process_image(p) for p in pils] + [process_image(big, small)]
    merged = mm.encoder.encode(procs, merged=True)
    feats = mm.encoder.encode(procs)
    rm, rf = ref_features(mm, pils)
    rm2, rf2 = ref_features(mm, [big], media=dict(K3_MEDIA_CFG, in_patch_limit=96))
    errs_m = [rel_err(a, b) for a, b in zip(merged, rm + rm2)]
    errs_f = [rel_err(a, b) for a, b in zip(feats, rf + rf2)]
    print("tower rel err", max(errs_m), "features rel err", max(errs_f))
    assert max(errs_m) < TOL and max(errs_f) < TOL
    # the ViT epsilon is a config field: 2^-7 (mlx-vlm 0.7.10) is a different model
    m7 = load_pretrained(mm.dir, vision=True, vt_norm_eps=2.0 ** -7)
    f7 = m7.encoder().encode(procs[:1])[0]
    assert rel_err(f7, ref_features(mm, pils[:1], eps=2.0 ** -7)[1][0]) < TOL
    assert rel_err(f7, rf[0]) > 1e-3


def test_two_frame_chunk_matches_the_reference(mm):
    """t > 1 (video chunks): the sincos time term and the temporal mean of sd2_tpool."""
    pv = np.random.default_rng(9).standard_normal((2 * 4 * 6, 3, 14, 14)).astype(np.float32)
    chunk = ProcessedImage(pv, (2, 4, 6), (84, 56), (84, 56), b"t2")
    got = mm.encoder.encode([chunk], merged=True)[0]
    want = ref.vision_tower(mm.vc, mm.vt, pv.astype(np.float64), [(2, 4, 6)], mm.eps)
    assert rel_err(got, want) < TOL


def test_packing_alone_or_with_others_gives_the_same_features(mm):
    procs = [process_image(mm.images[k]) for k in ("A", "B", "C")]
    alone = mm.encoder.encode(procs[1:2])[0]
    packed = mm.encoder.encode(procs)[1]
    other = mm.model.encoder(buckets=(64, 1024)).encode([procs[2], procs[0], procs[1]])[2]
    assert np.max(np.abs(alone - packed)) < 1e-5 and np.max(np.abs(alone - other)) < 1e-5
    plan = plan_packing([p.grid for p in procs])
    assert len(plan) == 1 and plan[0].length == 256 and plan[0].real_rows == sum(p.tokens * 4 for p in procs)
    assert set(mm.encoder.compiles.values()) == {1}                 # one compile per bucket, however many calls


# ------------------------------------------------------------------------------------------------ splicing
def padded_logits(mm, ids, procs, length=128):
    """Logits of the spliced prompt through one compiled forward of ``length`` tokens (the model is causal, so the
    tokens after the prompt change nothing before them)."""
    from k3jax.vision.model import _spliced_forward

    mp = mm.model.prepare(ids, procs, encoder=mm.encoder)
    n = len(mp.ids)
    x = np.zeros((1, length), np.int32)
    x[0, :n] = mp.ids
    rows, mask = mp.overlay(0, length) if procs else (np.zeros((length, 64), np.float32), np.zeros(length, bool))
    return np.asarray(_spliced_forward(mm.model.language_model, x, (rows[None], mask[None])).logits[0, :n])


def test_spliced_prompt_logits_match_the_reference(mm):
    """1 and 2 images in a chat prompt, ≤ 1e-4 of the logit scale in fp32 (printed beside what the fp32 text model
    alone shows on a text prompt of the same length); the one-pad (release) and pre-expanded forms agree."""
    for keys in (["A"], ["B", "RGBA"]):
        procs = [process_image(mm.images[k]) for k in keys]
        ids = image_chat_ids(mm.tok, "What is this?", procs, thinking=False)
        assert ids.count(PAD) == len(procs)
        got = padded_logits(mm, ids, procs)
        _, rf = ref_features(mm, [mm.images[k] for k in keys])
        want = ref.multimodal_logits(mm.tc, mm.tt, ids, rf, pad_id=PAD)
        text = np.random.default_rng(len(got)).integers(0, 256, len(got))
        noise = rel_err(padded_logits(mm, text, []), ref.multimodal_logits(mm.tc, mm.tt, text, [], pad_id=PAD))
        print(keys, f"{len(got)} tokens: logits rel err {rel_err(got, want):.2e} (text alone {noise:.2e})")
        assert got.shape == want.shape and rel_err(got, want) < TOL and noise < TOL
        expanded = splice_prompt(ids, [np.zeros((p.tokens, 1)) for p in procs], PAD).ids
        assert len(expanded) == len(ids) + sum(p.tokens for p in procs) - len(procs)
        assert np.max(np.abs(padded_logits(mm, expanded, procs) - got)) < 1e-5
    # the Python API (whole sequence, its own compile: fp32 rounding of another program)
    procs = [process_image(mm.images["A"])]
    ids = image_chat_ids(mm.tok, "What is this?", procs, thinking=False)
    assert rel_err(np.asarray(mm.model(ids, procs, encoder=mm.encoder).logits[0]), padded_logits(mm, ids, procs)) < TOL
    with pytest.raises(PromptError, match="2 <.media_pad.>"):
        splice_prompt([5, PAD, PAD, 6], [np.zeros((6, 64))], PAD)


def test_float64_tower_and_spliced_logits_equal_the_reference(mm, x64):
    """The same path in float64 (two images, a 144-token prompt): agreement to rounding. The reference reads the
    processor's fp32 pixels here (its own normalises in float64)."""
    m64 = load_pretrained(mm.dir, vision=True, dtype="float64")
    procs = [process_image(mm.images[k]) for k in ("C", "RGBA")]
    ids = image_chat_ids(mm.tok, "What is this?", procs, thinking=False)
    enc = m64.encoder()
    got = np.asarray(m64(ids, procs, encoder=enc).logits[0])
    assert got.dtype == np.float64
    merged = ref.vision_tower(mm.vc, mm.vt, np.concatenate([p.pixel_values for p in procs]).astype(np.float64),
                              [p.grid for p in procs], mm.eps)
    feats = ref.project(mm.vc, mm.vt, merged)
    assert rel_err(np.concatenate(enc.encode(procs, merged=True)), merged) < 1e-9
    want = ref.multimodal_logits(mm.tc, mm.tt, ids, [feats[:procs[0].tokens], feats[procs[0].tokens:]], pad_id=PAD)
    print("float64 logits rel err", rel_err(got, want))
    assert rel_err(got, want) < 1e-9


def test_text_only_load_of_the_multimodal_checkpoint_matches_exactly(mm, caplog):
    import logging

    ids = np.asarray([[CHAT_IDS["[BOS]"], 5, 17, 99, 4, 200]], np.int32)
    with caplog.at_level(logging.INFO, logger="k3jax.io"):
        text = load_pretrained(mm.dir)
    assert "skipped 168" not in caplog.text and "vision_tower/mm_projector" in caplog.text
    from conftest import jit_forward

    a = np.asarray(jit_forward(text, ids).logits)
    b = np.asarray(jit_forward(mm.model.language_model, ids).logits)
    assert np.array_equal(a, b)


def _mutate(mm, tmp_path, fn):
    from safetensors.numpy import load_file, save_file

    d = tmp_path / "ck"
    d.mkdir()
    for f in os.listdir(mm.dir):
        if not f.endswith(".safetensors"):
            (d / f).write_bytes((mm.dir / f).read_bytes())
    t = load_file(mm.dir / "model.safetensors")
    fn(t)
    save_file(t, d / "model.safetensors")
    return d


@pytest.mark.parametrize("what,fn,fragment", [
    ("missing", lambda t: t.pop("vision_tower.encoder.blocks.1.wo.weight"),
     "vision tensors missing.*vision_tower.encoder.blocks.1.wo.weight"),
    ("misshapen", lambda t: t.update({"mm_projector.post_norm.weight": np.ones(63, np.float32)}),
     "'mm_projector.post_norm.weight'.*shape \\[63\\], expected \\[64\\]"),
    ("unknown", lambda t: t.update({"vision_tower.encoder.blocks.2.wo.weight": np.ones((64, 96), np.float32)}),
     "does not expect.*vision_tower.encoder.blocks.2.wo.weight"),
])
def test_loader_rejects_bad_vision_tensors_by_name(mm, tmp_path, what, fn, fragment):
    d = _mutate(mm, tmp_path, fn)
    with pytest.raises(CheckpointError, match=fragment):
        load_pretrained(d, vision=True)


def test_vision_config_must_spell_out_the_k3_tower():
    base = dict(TINY_VISION_CONFIG, text_hidden_size=64)
    assert VisionConfig.from_dict(base).vt_norm_eps == 2.0 ** -23
    for key, value, fragment in [("norm_type", None, "missing \\(the release code then uses 'layernorm'\\)"),
                                 ("attn_bias", True, "attn_bias"), ("pos_emb_interpolation_mode", "bicubic", "bicubic"),
                                 ("qkv_hidden_size", 90, "not divisible")]:
        d = copy.deepcopy(base)
        if value is None:
            d.pop(key)
        else:
            d[key] = value
        with pytest.raises(ConfigError, match=fragment):
            VisionConfig.from_dict(d)


# -------------------------------------------------------------------------------------------------- generate
def test_generate_cli_with_an_image_matches_the_python_api(mm, tmp_path):
    from k3jax.cli import main

    path = tmp_path / "cat.png"
    mm.images["B"].save(path)
    out = tmp_path / "out.json"
    assert main(["generate", "--model", str(mm.dir), "--image", str(path), "--prompt", "What is this?", "--chunk", "64",
                 "--max-new-tokens", "6", "--no-stream", "--no-thinking", "--ignore-eos", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    gen = MultimodalGenerator(mm.model, mm.tok, encoder=mm.encoder, chunk=64)
    res, mp = gen.generate("What is this?", [path], 6, thinking=False, stop_tokens=[])
    assert got["tokens"] == res.tokens[0] and got["prompt_ids"] == mp.ids
    assert got["stats"]["image_tokens"] == process_image(path).tokens == 12
    # the same continuation from the cache: the last prompt logits predict the first generated token
    _, logits, _ = gen.engine.prefill([mp.ids], embeds=[mp])
    assert int(np.argmax(np.asarray(logits)[0])) == res.tokens[0][0]
