"""The K3 image processor (K3_VISION_SPEC §8): image → NaViT-resized, padded, normalised 14×14 patches.

Accepts a path, bytes, a ``PIL.Image`` or a ``uint8`` array (H×W, H×W×3 or H×W×4). Steps: the size rule (never
upscale; at most ``in_patch_limit`` patches and ``patch_limit_on_one_side`` patches a side), Pillow BICUBIC resize
in the image's own mode (Pillow resizes palette images nearest-neighbour), alpha composited over the chessboard
(``after_resize``, K3) in fp32 with uint8 truncation, black padding right and bottom to whole 28-pixel merges,
``(x/255 − mean)/std``, and patches ``[ch, i, j]`` in row-major patch order.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from k3jax.vision.config import MediaConfig


class ImageError(ValueError):
    """An image that cannot be used: undecodable, empty, or of an unsupported kind (the message says which)."""


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: np.ndarray            # [gh·gw, 3, p, p] float32
    grid: tuple[int, int, int]          # (1, gh, gw)
    size: tuple[int, int]               # original (W, H), as the prompt names it
    resized: tuple[int, int]            # (W', H') after the size rule, before padding
    digest: bytes                       # blake2b of the patches and grid (prefix-cache key of the image's content)

    @property
    def tokens(self) -> int:
        """Merged vision tokens this image becomes (gh·gw/4)."""
        return self.grid[1] * self.grid[2] // 4

    def prompt(self) -> str:
        """``<|media_begin|>image {W}x{H}<|media_content|><|media_pad|><|media_end|>`` (one pad; spec §7)."""
        W, H = self.size
        return f"<|media_begin|>image {W}x{H}<|media_content|><|media_pad|><|media_end|>"


def target_size(width: int, height: int, cfg: MediaConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """Spec §8.2: ``((W', H') after resize, (W'', H'') after padding)`` for an image of ``width × height``."""
    p, S, B = cfg.patch_size, cfg.patch_limit_on_one_side, cfg.in_patch_limit
    f = cfg.merge_kernel_size * p
    scale = min(1.0, math.sqrt(B / (max(1, width // p) * max(1, height // p))), S * p / width, S * p / height)
    w1 = min(max(1, math.floor(width * scale)), S * p)
    h1 = min(max(1, math.floor(height * scale)), S * p)
    return (w1, h1), (-(-w1 // f) * f, -(-h1 // f) * f)


def _open(image: Any, where: str, max_pixels: int | None = None):
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image
    try:
        if isinstance(image, (str, Path)):
            img = Image.open(image)
        elif isinstance(image, (bytes, bytearray, memoryview)):
            img = Image.open(io.BytesIO(bytes(image)))
        elif isinstance(image, np.ndarray):
            a = image
            if a.dtype != np.uint8:
                raise ImageError(f"{where}: expected a uint8 array, got {a.dtype}")
            if a.ndim == 2:
                return Image.fromarray(a, "L")
            if a.ndim == 3 and a.shape[2] in (3, 4):
                return Image.fromarray(np.ascontiguousarray(a), "RGB" if a.shape[2] == 3 else "RGBA")
            raise ImageError(f"{where}: expected an H×W, H×W×3 or H×W×4 array, got shape {a.shape}")
        else:
            raise ImageError(f"{where}: expected a path, bytes, a PIL image or a uint8 array, got "
                             f"{type(image).__name__}")
        if max_pixels is not None and img.size[0] * img.size[1] > max_pixels:
            raise ImageError(f"{where}: {img.size[0]}×{img.size[1]} pixels exceed the limit of {max_pixels}")
        img.load()
        return img
    except FileNotFoundError:
        raise ImageError(f"{where}: no such file {image}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        if isinstance(e, ImageError):
            raise
        raise ImageError(f"{where}: not a decodable image ({type(e).__name__}: {e})") from None


def _chessboard(w: int, h: int, bg: dict) -> np.ndarray:
    sq = int(bg.get("chessboard_square_size", 8))
    white, gray = float(bg.get("chessboard_white_value", 255)), float(bg.get("chessboard_gray_value", 180))
    y, x = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    odd = ((y // sq + x // sq) % 2).astype(bool)
    if not bg.get("chessboard_square_on_top_left", True):
        odd = ~odd
    return np.where(odd, gray, white).astype(np.float32)[..., None]


def _has_alpha(img) -> bool:
    return img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info


def _to_rgb(img, cfg: MediaConfig) -> np.ndarray:
    """``uint8 [H, W, 3]``: composited over the background when the image has alpha (and a background is set)."""
    if cfg.transparent_bg is None or not _has_alpha(img):
        return np.asarray(img.convert("RGB"), np.uint8)
    rgba = np.asarray(img.convert("RGBA"), np.float32)
    alpha = rgba[..., 3:4] / np.float32(255.0)
    bg = _chessboard(rgba.shape[1], rgba.shape[0], cfg.transparent_bg)
    out = alpha * rgba[..., :3] + (np.float32(1.0) - alpha) * bg
    return out.astype(np.uint8)


def process_image(image: Any, cfg: MediaConfig | None = None, *, where: str = "image",
                  max_pixels: int | None = None) -> ProcessedImage:
    """One image → :class:`ProcessedImage`. Raises :class:`ImageError` (naming ``where``) for an image that
    cannot be decoded, has no pixels, or (with ``max_pixels``) more than ``max_pixels`` before resizing."""
    from PIL import Image

    cfg = cfg or MediaConfig()
    img = _open(image, where, max_pixels)
    W, H = img.size
    if W <= 0 or H <= 0:
        raise ImageError(f"{where}: the image has no pixels ({W}×{H})")
    (w1, h1), (w2, h2) = target_size(W, H, cfg)
    try:
        if cfg.fill_stage == "before_resize":
            rgb = Image.fromarray(_to_rgb(img, cfg), "RGB")
            rgb = rgb.resize((w1, h1), Image.Resampling.BICUBIC) if (w1, h1) != (W, H) else rgb
            arr = np.asarray(rgb, np.uint8)
        else:
            small = img.resize((w1, h1), Image.Resampling.BICUBIC) if (w1, h1) != (W, H) else img
            arr = _to_rgb(small, cfg)
    except (OSError, ValueError) as e:
        raise ImageError(f"{where}: cannot convert a {img.mode} image to RGB ({e})") from None
    canvas = np.zeros((h2, w2, 3), np.uint8)
    canvas[:h1, :w1] = arr
    mean = np.asarray(cfg.image_mean, np.float32)
    std = np.asarray(cfg.image_std, np.float32)
    v = (canvas.astype(np.float32) / np.float32(255.0) - mean) / std
    p = cfg.patch_size
    gh, gw = h2 // p, w2 // p
    patches = v.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
    patches = np.ascontiguousarray(patches, np.float32)
    digest = hashlib.blake2b(patches.tobytes() + np.asarray([1, gh, gw], "<i8").tobytes(), digest_size=16).digest()
    return ProcessedImage(patches, (1, gh, gw), (W, H), (w1, h1), digest)
