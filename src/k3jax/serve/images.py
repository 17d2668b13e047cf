"""Images in ``/v1/chat/completions``: OpenAI ``image_url`` content parts → :class:`ProcessedImage`.

Accepted: ``data:image/...;base64,...`` URLs always; local paths (``file://`` or plain) only under the directory
the server was started with (``--image-dir``); ``http(s)://`` only with ``--allow-remote-images`` (fetched with a
timeout and a size limit). Everything else, and an image that does not decode, is empty, or is larger than the
limits, is a 400 naming the content part (``messages[0].content[1].image_url``).
"""

from __future__ import annotations

import base64
import binascii
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from k3jax.vision.config import MediaConfig
from k3jax.vision.processor import ImageError, ProcessedImage, process_image

IMAGE_TYPES = ("image_url", "image", "input_image")


@dataclass
class ImagePolicy:
    image_dir: Path | None = None          # local files allowed under here (None: no local files)
    allow_remote: bool = False             # fetch http(s) URLs
    remote_timeout: float = 10.0
    max_bytes: int = 20 * 2 ** 20          # encoded size limit (data URLs, files, downloads)
    max_pixels: int = 64 * 2 ** 20         # decoded W·H limit (before the size rule shrinks it)


class VisionService:
    """The server's side of images: which ones it accepts (``policy``) and how they are processed (``media``; the
    ``<|media_pad|>`` id ``pad_id`` their prompts hold). Host only: the engine's vision encoder computes the rows,
    on the scheduler thread."""

    def __init__(self, media: MediaConfig, pad_id: int, policy: ImagePolicy | None = None):
        self.media, self.pad_id = media, pad_id
        self.policy = policy or ImagePolicy()


def image_parts(messages) -> list[tuple[str, dict]]:
    """``(where, part)`` of every image content part, in rendering order (user and system messages)."""
    out = []
    if not isinstance(messages, list):
        return out
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") in IMAGE_TYPES:
                    out.append((f"messages[{i}].content[{j}]", part))
    return out


def _url_of(part: dict, where: str) -> tuple[str, str]:
    kind = part.get("type")
    val = part.get(kind) if kind != "input_image" else part.get("image_url", part.get("image"))
    if kind == "input_image" and isinstance(val, str):
        return val, f"{where}.image_url"
    if isinstance(val, str):
        return val, f"{where}.{kind}"
    if isinstance(val, dict) and isinstance(val.get("url"), str):
        return val["url"], f"{where}.{kind}.url"
    raise ImageError(f"{where}.{kind}: expected {{\"url\": \"data:image/...;base64,...\"}}, got {str(val)[:60]!r}")


def fetch_image_bytes(part: dict, where: str, policy: ImagePolicy) -> bytes:
    """The encoded bytes an image part names, under ``policy``; :class:`ImageError` (naming the field) otherwise."""
    url, field = _url_of(part, where)
    low = url[:16].lower()
    if low.startswith("data:"):
        head, sep, data = url.partition(",")
        if not sep or ";base64" not in head:
            raise ImageError(f"{field}: a data URL must be data:image/...;base64,<data>")
        if len(data) > policy.max_bytes * 4 // 3 + 4:
            raise ImageError(f"{field}: image larger than the server's limit of {policy.max_bytes} bytes")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageError(f"{field}: invalid base64 ({e})") from None
    elif low.startswith(("http://", "https://")):
        if not policy.allow_remote:
            raise ImageError(f"{field}: remote image URLs are not fetched by this server (start it with "
                             f"--allow-remote-images), send a data: URL instead")
        try:
            with urllib.request.urlopen(url, timeout=policy.remote_timeout) as r:
                raw = r.read(policy.max_bytes + 1)
        except Exception as e:                                    # noqa: BLE001  (any fetch failure is the client's)
            raise ImageError(f"{field}: could not fetch {url[:80]} ({type(e).__name__}: {e})") from None
    else:
        path = Path(urllib.parse.unquote(urllib.parse.urlparse(url).path) if low.startswith("file:") else url)
        if policy.image_dir is None:
            raise ImageError(f"{field}: local image paths are not allowed on this server (start it with "
                             f"--image-dir DIR), send a data: URL instead")
        root = policy.image_dir.resolve()
        full = (root / path).resolve() if not path.is_absolute() else path.resolve()
        if root != full and root not in full.parents:
            raise ImageError(f"{field}: {url[:80]} is outside the server's image directory")
        if not full.is_file():
            raise ImageError(f"{field}: no such image file {url[:80]}")
        if full.stat().st_size > policy.max_bytes:
            raise ImageError(f"{field}: image larger than the server's limit of {policy.max_bytes} bytes")
        raw = full.read_bytes()
    if len(raw) > policy.max_bytes:
        raise ImageError(f"{field}: image larger than the server's limit of {policy.max_bytes} bytes")
    if not raw:
        raise ImageError(f"{field}: empty image")
    return raw


def load_request_images(messages, service: VisionService) -> list[ProcessedImage]:
    """Every image part of ``messages`` fetched and processed (in order); :class:`ImageError` naming the part."""
    out = []
    for where, part in image_parts(messages):
        raw = fetch_image_bytes(part, where, service.policy)
        out.append(process_image(raw, service.media, where=where, max_pixels=service.policy.max_pixels))
    return out
