"""Generation with images: the chat form of a user turn with images (K3_VISION_SPEC §9), images through the
bucketed :class:`~k3jax.vision.model.VisionEncoder`, features spliced at ``<|media_pad|>``, then the ordinary
engine — the KV/KDA caches hold the image tokens like any others."""

from __future__ import annotations

import time
from typing import Any, Sequence

from k3jax.infer.engine import Engine, GenerateResult, GenerationError
from k3jax.text.chat import encode_chat
from k3jax.vision.config import MediaConfig
from k3jax.vision.model import K3ForConditionalGeneration, MultimodalPrompt, VisionEncoder
from k3jax.vision.processor import ProcessedImage, process_image


def image_chat_ids(tokenizer, text: str, images: Sequence[ProcessedImage], *, thinking: bool = True,
                   thinking_effort: str | None = None) -> list[int]:
    """Token ids of one user turn — the images (in order) then ``text`` — and the assistant generation prompt."""
    content: list[dict] = [{"type": "image"} for _ in images] + ([{"type": "text", "text": text}] if text else [])
    return encode_chat(tokenizer, [{"role": "user", "content": content}], thinking=thinking,
                       thinking_effort=thinking_effort, image_prompts=[im.prompt() for im in images])


def check_pad_token(model: K3ForConditionalGeneration, tokenizer) -> None:
    """The tokenizer's ``<|media_pad|>`` must be the config's ``media_placeholder_token_id``."""
    sid = tokenizer.special_id("<|media_pad|>") if callable(getattr(tokenizer, "special_id", None)) else None
    if sid is None:
        raise GenerationError(f"tokenizer {getattr(tokenizer, 'name', '?')} has no <|media_pad|> token; images need "
                              f"the release tokenizer (tiktoken.model + tokenizer_config.json)")
    if sid != model.pad_id:
        raise GenerationError(f"tokenizer's <|media_pad|> is id {sid} but the config's media_placeholder_token_id is "
                              f"{model.pad_id}")


class MultimodalGenerator:
    """``MultimodalGenerator(model, tokenizer).generate("What is this?", ["cat.png"], 64)``: one engine and one
    vision encoder, reused across calls (each compiles once per prefill/vision bucket)."""

    def __init__(self, model: K3ForConditionalGeneration, tokenizer, *, media: MediaConfig | None = None,
                 chunk: int | None = None, max_len: int | None = None, encoder: VisionEncoder | None = None):
        check_pad_token(model, tokenizer)
        self.model, self.tokenizer = model, tokenizer
        self.media = media or MediaConfig()
        self.engine = Engine(model.language_model, chunk=chunk, max_len=max_len)
        self.encoder = encoder or model.encoder()

    def prepare(self, text: str, images: Sequence[Any], *, thinking: bool = True) -> MultimodalPrompt:
        processed = [im if isinstance(im, ProcessedImage) else process_image(im, self.media, where=f"image {i}")
                     for i, im in enumerate(images)]
        ids = image_chat_ids(self.tokenizer, text, processed, thinking=thinking)
        return self.model.prepare(ids, processed, encoder=self.encoder)

    def generate(self, text: str, images: Sequence[Any], max_new_tokens: int, *, thinking: bool = True,
                 **kw) -> tuple[GenerateResult, MultimodalPrompt]:
        """Decode the answer to ``text`` about ``images`` (paths, bytes, PIL images, arrays or
        :class:`ProcessedImage`). ``kw``: :meth:`Engine.generate`'s sampling options; stops at ``<|end_of_msg|>``
        unless ``stop_tokens`` is given. ``result.stats`` adds the vision encoder's seconds and compiles."""
        t0 = time.perf_counter()
        mp = self.prepare(text, images, thinking=thinking)
        t_vision = time.perf_counter() - t0
        if "stop_tokens" not in kw:
            eos = self.model.config.eos_token_id
            kw["stop_tokens"] = [eos] if isinstance(eos, int) else list(eos or [])
        res = self.engine.generate([mp.ids], max_new_tokens, embeds=[mp], **kw)
        res.stats.update(vision_s=t_vision, image_tokens=int(len(mp.positions)),
                         vision_compiles=dict(self.encoder.compiles),
                         vision_padding_waste=self.encoder.stats.padding_waste)
        return res, mp


__all__ = ["MultimodalGenerator", "image_chat_ids", "check_pad_token"]
