"""The vision tower + projector: images/s and ms/image by size against the FLOP roofline, the patch-bucket policy
(compiles and padding waste on a size mix), and time-to-first-token of an image+text request vs the text alone.

    .venv/bin/python -m benchmarks.vision [--sizes 448 896 1792] [--reps 2] [--layers 27] [--text-preset 100m]
                                         [--max-patches] [--json out.json]

The tower is the release's MoonViT-V2 (27 blocks, D 1024, 12 heads × 128, MLP 4096, random weights, fp32) and
the patchmergerv2 projector into a text width (7168, K3's, for the throughput rows; the text preset's for TTFT).
One image per call, in its bucket (a square N² image is (N/14)² patches: 448² → 1024 = its bucket exactly).
FLOPs per call are counted on the bucket's rows: per block 2L(3QD + QD + 2DI) for the projections and MLP and
4L²Q for attention (q·kᵀ and p·v, dense over the bucket: the block-diagonal mask does not skip work), plus the
patch embedding 2L·3p²·D and the projector 2(L/4)(16D² + 4D·T); MFU = FLOPs / time / the run's fp32 GEMM FLOP/s.
``--max-patches`` adds the release's largest image (65 536 patches, 16 384 tokens; about 25× the 1792² FLOPs).

Bucket policy: the image sizes of a realistic mix (phone photos, screenshots, scans, thumbnails; listed in
``SIZE_MIX``) through the processor's size rule, alone and packed four at a time, under the default √2 ladder of
buckets and plain powers of two: buckets compiled and the fraction of computed rows that are padding (row waste)
and of attention FLOPs (L² waste).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.roofline import machine
from k3jax.nn.layers import KeyGen
from k3jax.vision import MediaConfig, VisionConfig, VisionEncoder, process_image, target_size
from k3jax.vision.packing import DEFAULT_BUCKETS, POWER_OF_TWO_BUCKETS, plan_packing
from k3jax.vision.tower import Projector, VisionTower

K3_VISION = dict(patch_size=14, vt_hidden_size=1024, qkv_hidden_size=1536, vt_num_attention_heads=12,
                 vt_intermediate_size=4096, vt_num_hidden_layers=27, init_pos_emb_height=64, init_pos_emb_width=64,
                 init_pos_emb_time=4, merge_kernel_size=[2, 2], mm_hidden_size=1024, pos_emb_type="divided_fixed",
                 pos_emb_interpolation_mode="bilinear", norm_type="rmsnorm", activation_func="gelu_pytorch_tanh",
                 mlp_type="mlp2", attn_bias=False, linear_bias=False, patch_embed_proj_bias=False,
                 merge_type="sd2_tpool", mm_projector_type="patchmergerv2", projector_hidden_act="gelu",
                 projector_ln_eps=1e-5, text_hidden_size=7168)

# (width, height, count): a mix of what people send a chat model
SIZE_MIX = [(4032, 3024, 6), (3024, 4032, 6), (1920, 1080, 8), (1280, 720, 6), (2560, 1440, 4), (1170, 2532, 6),
            (1080, 1920, 4), (800, 600, 4), (1024, 768, 4), (640, 480, 6), (512, 512, 4), (224, 224, 2),
            (2480, 3508, 3), (1700, 2200, 3), (300, 200, 4), (1600, 900, 4), (3840, 2160, 2), (750, 1334, 4),
            (96, 96, 2), (1200, 628, 4)]


def tower_flops(cfg: VisionConfig, L: int) -> float:
    D, Q, I, p, T = cfg.vt_hidden_size, cfg.qkv_hidden_size, cfg.vt_intermediate_size, cfg.patch_size, \
        cfg.text_hidden_size
    block = 2 * L * (3 * Q * D + Q * D + 2 * D * I) + 4 * L * L * Q
    return cfg.vt_num_hidden_layers * block + 2 * L * 3 * p * p * D + 2 * (L // 4) * (16 * D * D + 4 * D * T)


def throughput(cfg: VisionConfig, sizes: list[int], reps: int, peak: float) -> list[dict]:
    keys = KeyGen(jax.random.key(0))
    enc = VisionEncoder(VisionTower(cfg, keys=keys), Projector(cfg, keys=keys))
    rows = []
    for n in sizes:
        img = process_image(np.random.default_rng(n).integers(0, 256, (n, n, 3), dtype=np.uint8)) \
            if n > 0 else None
        if img is None:                                     # the release maximum: 256×256 patches
            from k3jax.vision.processor import ProcessedImage

            pv = np.zeros((65536, 3, 14, 14), np.float32)
            img = ProcessedImage(pv, (1, 256, 256), (7168, 7168), (3584, 3584), b"max")
        pk = plan_packing([img.grid], enc.buckets)[0]
        packed = enc.pack([img], pk)
        t0 = time.perf_counter()
        run = enc._run.lower(enc.state, packed).compile()
        first = time.perf_counter() - t0
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(run(enc.state, packed))
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        fl = tower_flops(cfg, pk.length)
        r = {"size": f"{img.size[0]}x{img.size[1]}", "patches": pk.real_rows, "bucket": pk.length,
             "tokens": img.tokens, "seconds_median": med, "ms_per_image": 1e3 * med, "images_per_s": 1 / med,
             "compile_seconds": first, "flops": fl, "mfu": fl / med / peak, "roofline_seconds": fl / peak,
             "reps": reps}
        rows.append(r)
        print(f"{r['size']:>9}: {r['patches']} patches (bucket {r['bucket']}), {r['ms_per_image']:,.0f} ms/image, "
              f"{r['images_per_s']:.3f} images/s, {fl / 1e12:.2f} TFLOP, MFU {r['mfu']:.1%} (compile "
              f"{first:.1f} s)", flush=True)
    return rows


def bucket_policy() -> dict:
    media = MediaConfig()
    grids = []
    for w, h, c in SIZE_MIX:
        _, (w2, h2) = target_size(w, h, media)
        grids += [(1, h2 // 14, w2 // 14)] * c
    rng = np.random.default_rng(0)
    order = rng.permutation(len(grids))
    grids = [grids[i] for i in order]
    out = {"images": len(grids), "mean_patches": float(np.mean([g[1] * g[2] for g in grids])), "policies": {}}
    for name, buckets in [("powers_of_two", POWER_OF_TWO_BUCKETS), ("sqrt2", DEFAULT_BUCKETS)]:
        for mode, group in [("alone", 1), ("packed_4", 4)]:
            real = comp = real_sq = comp_sq = 0
            used = set()
            for i in range(0, len(grids), group):
                for pk in plan_packing(grids[i:i + group], buckets):
                    used.add(pk.length)
                    real += pk.real_rows
                    comp += pk.length
                    real_sq += sum((4 * n) ** 2 for n in pk.token_counts)
                    comp_sq += pk.length ** 2
            out["policies"][f"{name}/{mode}"] = {
                "buckets": list(buckets), "compiled": sorted(used), "compiles": len(used),
                "row_waste": 1 - real / comp, "attention_flop_waste": 1 - real_sq / comp_sq}
            p = out["policies"][f"{name}/{mode}"]
            print(f"{name:>13} {mode:>8}: {p['compiles']} buckets compiled, padding {p['row_waste']:.1%} of rows, "
                  f"{p['attention_flop_waste']:.1%} of attention FLOPs", flush=True)
    return out


def ttft(text_preset: str, layers: int, image_size: int, reps: int) -> dict:
    """Prefill to the first token: the same chat-like text with and without one image (warm, median)."""
    from k3jax.config import K3Config
    from k3jax.infer.engine import Engine
    from k3jax.vision.model import K3ForConditionalGeneration

    cfg = K3Config.from_preset(text_preset)
    pad = cfg.vocab_size - 1
    vc = VisionConfig.from_dict(dict(K3_VISION, vt_num_hidden_layers=layers, text_hidden_size=cfg.hidden_size),
                                media_placeholder_token_id=pad)
    model = K3ForConditionalGeneration(cfg, vc, rngs=nnx.Rngs(0))
    enc = model.encoder()
    eng = Engine(model.language_model, chunk=256)
    text = list(np.random.default_rng(1).integers(0, pad, 200))
    img = process_image(np.random.default_rng(2).integers(0, 256, (image_size, image_size, 3), dtype=np.uint8))
    ids = text[:20] + [pad] + text[20:]

    def with_image():
        mp = model.prepare(ids, [img], encoder=enc)
        return eng.generate([mp.ids], 1, embeds=[mp]).tokens

    def text_only():
        return eng.generate([text], 1).tokens

    res = {}
    for name, fn in [("image_plus_text", with_image), ("text_only", text_only)]:
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        res[name + "_seconds"] = statistics.median(ts)
    t0 = time.perf_counter()
    enc.encode([img])
    res.update(vision_seconds=time.perf_counter() - t0, text_tokens=len(text), image_tokens=img.tokens,
               image=f"{image_size}x{image_size}", text_preset=text_preset, vision_layers=layers,
               ratio=res["image_plus_text_seconds"] / res["text_only_seconds"], reps=reps)
    print(f"TTFT ({text_preset}, {len(text)} text tokens): text alone {res['text_only_seconds']:.2f} s, with one "
          f"{res['image']} image (+{img.tokens} tokens) {res['image_plus_text_seconds']:.2f} s "
          f"({res['ratio']:.1f}×; the tower alone {res['vision_seconds']:.2f} s)", flush=True)
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[448, 896, 1792])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--layers", type=int, default=27, help="tower blocks (27 = the release)")
    ap.add_argument("--max-patches", action="store_true", help="also the 65 536-patch maximum (slow on CPU)")
    ap.add_argument("--text-preset", default="100m")
    ap.add_argument("--ttft-image", type=int, default=448)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    m = machine()
    peak = m["gemm_flops_fp32"]
    cfg = VisionConfig.from_dict(dict(K3_VISION, vt_num_hidden_layers=a.layers))
    res = {"benchmark": "vision", **m, "vision_layers": a.layers,
           "rows": throughput(cfg, a.sizes + ([0] if a.max_patches else []), a.reps, peak),
           "bucket_policy": bucket_policy(), "ttft": ttft(a.text_preset, a.layers, a.ttft_image, a.reps)}
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
