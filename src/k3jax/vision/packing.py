"""NaViT packing into static patch buckets: the host side of the vision tower.

An image of grid (t, h, w) contributes t·h·w patch rows and h·w/4 merged tokens. One call of the tower takes a
*bucket*: a fixed row count L (one of :data:`DEFAULT_BUCKETS`) filled with the rows of one or several images in
order and padded with zero rows. Per-row metadata — the four bilinear taps of the position grid, the RoPE row and
column, the frame, the segment (the image's index; padding is segment −1) — and the merge gather indices are
computed here in NumPy, so the compiled program never depends on an image's size: the tower compiles once per
bucket. Attention is masked to the segment, so padding rows never touch real ones and images never see each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

# A √2 ladder from 256 patches (a 224² image is exactly 256) to 65 536 (the release's in_patch_limit, 16 384
# tokens): 256·2^(k/2) rounded to a multiple of 64, plus 69 632 = 17·4096 because the size rule's floor-then-pad
# can exceed the limit slightly (1861×7041 → 67 268 patches, spec §8.2). Measured on benchmarks.vision's size mix:
# 13 buckets compiled and 7.4% of the rows padding, vs 8 buckets and 20.6% for powers of two (a bucket compiles in
# 1-3 s on CPU; the tower at 4096 patches runs for about a minute there).
DEFAULT_BUCKETS: tuple[int, ...] = tuple(sorted({int(round(256 * 2 ** (k / 2) / 64)) * 64 for k in range(17)}
                                                | {69632}))
POWER_OF_TWO_BUCKETS: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 69632)


class PackedPatches(NamedTuple):
    """One bucket's inputs (L rows, M = L/4 merged slots, T₀ frames)."""

    pixels: np.ndarray        # [L, 3p²] float32, zero on padding rows
    taps: np.ndarray          # [L, 4] int32 flat indices into the H₀×W₀ position grid
    tap_weights: np.ndarray   # [L, 4] float64 (cast to the compute dtype on device)
    frame: np.ndarray         # [L] int32
    time_on: np.ndarray       # [L] bool: the image has t > 1 frames (its rows get the sincos time term)
    rows: np.ndarray          # [L] int32 RoPE row (y) within the frame
    cols: np.ndarray          # [L] int32 RoPE column (x)
    segment_ids: np.ndarray   # [L] int32 image index, −1 on padding
    merge_index: np.ndarray   # [M, T₀, 4] int32 source row of each merged token's slot per frame
    merge_weight: np.ndarray  # [M, T₀] float64 1/t on an image's frames, 0 elsewhere (and on padding slots)


@dataclass(frozen=True)
class Packing:
    """Where each image landed: its rows ``[row_start, row_start + t·h·w)`` and merged tokens
    ``[token_start, token_start + h·w/4)``, in the bucket of ``length`` rows."""

    length: int
    images: tuple[int, ...]                 # indices into the caller's list
    row_starts: tuple[int, ...]
    token_starts: tuple[int, ...]
    token_counts: tuple[int, ...]

    @property
    def real_rows(self) -> int:
        return sum(4 * n for n in self.token_counts)


def bilinear_taps(n_out: int, n_in: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Half-pixel (``align_corners=False``) bilinear weights of a 1-D resize n_in → n_out (spec §3.2):
    ``s = max(0, (a + ½)·n_in/n_out − ½)``, taps ``i₀ = ⌊s⌋``, ``i₁ = min(i₀ + 1, n_in − 1)``, ``λ = s − i₀``."""
    a = np.arange(n_out, dtype=np.float64)
    s = np.maximum(0.0, (a + 0.5) * n_in / n_out - 0.5)
    i0 = np.minimum(np.floor(s).astype(np.int64), n_in - 1)
    i1 = np.minimum(i0 + 1, n_in - 1)
    return i0, i1, s - i0


def bucket_for(n_rows: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    """The smallest bucket holding ``n_rows`` patch rows."""
    for b in buckets:
        if b >= n_rows:
            return b
    raise ValueError(f"{n_rows} patch rows exceed the largest vision bucket ({max(buckets)})")


def plan_packing(grids: Sequence[tuple[int, int, int]], buckets: Sequence[int] = DEFAULT_BUCKETS) -> list[Packing]:
    """Images in order into as few tower calls as possible: consecutive images share a bucket while their rows fit
    the largest one; each call takes the smallest bucket that holds its rows."""
    top = max(buckets)
    groups: list[list[int]] = []
    total = 0
    for i, (t, h, w) in enumerate(grids):
        n = t * h * w
        if n > top:
            raise ValueError(f"image {i}: {n} patch rows (grid {t}×{h}×{w}) exceed the largest vision bucket ({top})")
        if h % 2 or w % 2:
            raise ValueError(f"image {i}: grid {h}×{w} is not even (the processor pads to whole 2×2 merges)")
        if not groups or total + n > top:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    out = []
    for g in groups:
        rows = [grids[i][0] * grids[i][1] * grids[i][2] for i in g]
        toks = [grids[i][1] * grids[i][2] // 4 for i in g]
        out.append(Packing(bucket_for(sum(rows), buckets), tuple(g), tuple(np.cumsum([0] + rows[:-1]).tolist()),
                           tuple(np.cumsum([0] + toks[:-1]).tolist()), tuple(toks)))
    return out


def pack(pixel_values: Sequence[np.ndarray], grids: Sequence[tuple[int, int, int]], packing: Packing, *,
         pos_grid: tuple[int, int], frames: int) -> PackedPatches:
    """Fill ``packing``'s bucket: ``pixel_values[i]`` is image ``packing.images[i]``'s ``[t·h·w, 3, p, p]`` (or
    ``[t·h·w, 3p²]``) patches, ``grids`` indexed like the caller's list; ``pos_grid`` (H₀, W₀), ``frames`` T₀."""
    L = packing.length
    M = L // 4
    H0, W0 = pos_grid
    dim = pixel_values[0].reshape(pixel_values[0].shape[0], -1).shape[1]
    pix = np.zeros((L, dim), np.float32)
    taps = np.zeros((L, 4), np.int32)
    tw = np.zeros((L, 4), np.float64)
    frame = np.zeros(L, np.int32)
    time_on = np.zeros(L, bool)
    rows = np.zeros(L, np.int32)
    cols = np.zeros(L, np.int32)
    seg = np.full(L, -1, np.int32)
    midx = np.zeros((M, frames, 4), np.int32)
    mw = np.zeros((M, frames), np.float64)
    for k, (i, r0, m0) in enumerate(zip(packing.images, packing.row_starts, packing.token_starts)):
        t, h, w = grids[i]
        if t > frames:
            raise ValueError(f"image {i}: {t} frames exceed the position table's {frames} (init_pos_emb_time)")
        n = t * h * w
        pv = np.asarray(pixel_values[k], np.float32).reshape(n, -1)
        if pv.shape[1] != dim:
            raise ValueError(f"image {i}: patches of {pv.shape[1]} values, expected {dim}")
        pix[r0:r0 + n] = pv
        y0, y1, ly = bilinear_taps(h, H0)
        x0, x1, lx = bilinear_taps(w, W0)
        rr, cc = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        rr, cc = rr.reshape(-1), cc.reshape(-1)
        t4 = np.stack([y0[rr] * W0 + x0[cc], y0[rr] * W0 + x1[cc], y1[rr] * W0 + x0[cc], y1[rr] * W0 + x1[cc]], -1)
        w4 = np.stack([(1 - ly[rr]) * (1 - lx[cc]), (1 - ly[rr]) * lx[cc], ly[rr] * (1 - lx[cc]), ly[rr] * lx[cc]], -1)
        sl = slice(r0, r0 + n)
        taps[sl] = np.tile(t4, (t, 1))
        tw[sl] = np.tile(w4, (t, 1))
        frame[sl] = np.repeat(np.arange(t), h * w)
        time_on[sl] = t > 1
        rows[sl] = np.tile(rr, t)
        cols[sl] = np.tile(cc, t)
        seg[sl] = k
        a, b = np.meshgrid(np.arange(h // 2), np.arange(w // 2), indexing="ij")
        a, b = a.reshape(-1), b.reshape(-1)
        slots = np.stack([(2 * a) * w + 2 * b, (2 * a) * w + 2 * b + 1, (2 * a + 1) * w + 2 * b,
                          (2 * a + 1) * w + 2 * b + 1], -1)                           # [hw/4, 4] TL TR BL BR
        nm = h * w // 4
        for tau in range(t):
            midx[m0:m0 + nm, tau] = r0 + tau * h * w + slots
            mw[m0:m0 + nm, tau] = 1.0 / t
    return PackedPatches(pix, taps, tw, frame, time_on, rows, cols, seg, midx, mw)
