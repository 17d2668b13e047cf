"""The multimodal K3: the text model reading image features spliced in at ``<|media_pad|>`` (spec §7), and the
bucketed image encoder that produces them.

``K3ForConditionalGeneration`` holds ``language_model`` (:class:`~k3jax.nn.model.K3ForCausalLM`), ``vision_tower``
and ``mm_projector``. Images go through :class:`VisionEncoder` — packed into static patch buckets, one compiled
program per bucket — and :func:`splice_prompt` turns a prompt with one pad per image (release form) or Σ Nᵢ pads
(pre-expanded form) into the expanded ids plus the feature rows that replace the pads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.config import K3Config
from k3jax.nn.layers import KeyGen
from k3jax.nn.model import CausalLMOutput, K3ForCausalLM
from k3jax.vision.config import VisionConfig
from k3jax.vision.packing import DEFAULT_BUCKETS, Packing, pack, plan_packing
from k3jax.vision.processor import ProcessedImage
from k3jax.vision.tower import Projector, VisionTower


class PromptError(ValueError):
    """Image placeholders in a prompt that disagree with the images given."""


@dataclass
class MultimodalPrompt:
    """A prompt ready for the text model: ``ids`` with Nᵢ pads per image, the ``positions`` of those pads (in
    order) and the feature ``rows [ΣNᵢ, hidden]`` that replace them; ``content_keys`` ``(first pad, digest)`` per
    image for the prefix cache."""

    ids: list[int]
    positions: np.ndarray
    rows: np.ndarray
    content_keys: tuple[tuple[int, bytes], ...] = ()

    def overlay(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray] | None:
        """``(rows [length, hidden], mask [length])`` for the chunk ``[start, start + length)``, None when it holds
        no image rows."""
        sel = (self.positions >= start) & (self.positions < start + length)
        if not sel.any():
            return None
        rows = np.zeros((length, self.rows.shape[1]), self.rows.dtype)
        mask = np.zeros(length, bool)
        rows[self.positions[sel] - start] = self.rows[sel]
        mask[self.positions[sel] - start] = True
        return rows, mask


def expand_pads(ids: Sequence[int], counts: Sequence[int], pad_id: int) -> tuple[list[int], list[int]]:
    """Spec §7 on the ids alone: ``ids`` holding one ``pad_id`` per image (expanded here to ``counts[i]``) or exactly
    Σ counts pads (pre-expanded, kept). Returns ``(ids, first pad position per image)``; any other pad count raises
    :class:`PromptError`. Host only: what a prompt will be before its image rows are computed."""
    ids = [int(t) for t in ids]
    counts = [int(c) for c in counts]
    n_pad = sum(1 for t in ids if t == pad_id)
    if n_pad == len(counts) and (n_pad != sum(counts) or n_pad == 0):
        out: list[int] = []
        firsts = []
        k = 0
        for t in ids:
            if t == pad_id:
                firsts.append(len(out))
                out += [pad_id] * counts[k]
                k += 1
            else:
                out.append(t)
        return out, firsts
    if n_pad == sum(counts):
        firsts, k, run = [], 0, 0
        for pos, t in enumerate(ids):
            if t == pad_id:
                if run == 0:
                    firsts.append(pos)
                run += 1
                if run == counts[k]:
                    k, run = k + 1, 0
        return ids, firsts
    raise PromptError(f"the prompt has {n_pad} <|media_pad|> (id {pad_id}) tokens for {len(counts)} images of "
                      f"{counts} feature rows: expected {len(counts)} (one per image) or {sum(counts)} "
                      f"(pre-expanded)")


def splice_prompt(ids: Sequence[int], features: Sequence[np.ndarray], pad_id: int,
                  digests: Sequence[bytes] = ()) -> MultimodalPrompt:
    """Spec §7: ``ids`` holding one ``pad_id`` per image (expanded here to Nᵢ) or exactly ΣNᵢ pads (pre-expanded,
    replaced 1:1, in order), the image features spliced at the pads. Any other count raises :class:`PromptError`."""
    out, firsts = expand_pads(ids, [int(f.shape[0]) for f in features], pad_id)
    positions = np.flatnonzero(np.asarray(out) == pad_id) if out else np.zeros(0, np.int64)
    rows = np.concatenate([np.asarray(f) for f in features]) if features else np.zeros((0, 0), np.float32)
    keys = tuple((int(p), bytes(d)) for p, d in zip(firsts, digests)) if digests else ()
    return MultimodalPrompt(out, positions.astype(np.int64), rows, keys)


@dataclass
class EncoderStats:
    calls: int = 0
    images: int = 0
    real_rows: int = 0
    bucket_rows: int = 0
    seconds: float = 0.0
    buckets_used: dict[int, int] = field(default_factory=dict)

    @property
    def padding_waste(self) -> float:
        """Fraction of the rows computed that were padding."""
        return 1.0 - self.real_rows / self.bucket_rows if self.bucket_rows else 0.0


class _VisionStack(nnx.Module):
    def __init__(self, tower: VisionTower, projector: Projector):
        self.vision_tower = tower
        self.mm_projector = projector


class VisionEncoder:
    """Processed images → feature rows ``[Nᵢ, text_hidden]``. Images are packed in order into the static patch
    ``buckets`` (:func:`~k3jax.vision.packing.plan_packing`); one jitted program per bucket (``compiles``)."""

    def __init__(self, tower: VisionTower, projector: Projector, *, buckets: Sequence[int] = DEFAULT_BUCKETS,
                 attn_block: int = 512):
        self.cfg = tower.config
        self.buckets = tuple(sorted(int(b) for b in buckets))
        if any(b % 4 for b in self.buckets):
            raise ValueError(f"buckets: every vision bucket must be a multiple of 4 rows, got {self.buckets}")
        self.attn_block = int(attn_block)
        self.graphdef, self.state = nnx.split(_VisionStack(tower, projector))
        self.compiles: dict[int, int] = {}
        self.stats = EncoderStats()
        self._run = jax.jit(self._run_impl)

    def _run_impl(self, state, packed):
        L = packed.pixels.shape[0]
        self.compiles[L] = self.compiles.get(L, 0) + 1        # trace time only
        stack = nnx.merge(self.graphdef, state)
        merged = stack.vision_tower(packed, attn_block=self.attn_block)
        return merged, stack.mm_projector(merged)

    def pack(self, images: Sequence[ProcessedImage], packing: Packing):
        """The device inputs of one tower call (:class:`~k3jax.vision.packing.PackedPatches` of arrays)."""
        grids = {i: im.grid for i, im in zip(packing.images, images)}       # indexed like packing.images
        packed = pack([im.pixel_values for im in images], grids, packing,
                      pos_grid=(self.cfg.init_pos_emb_height, self.cfg.init_pos_emb_width),
                      frames=self.cfg.init_pos_emb_time)
        return jax.tree.map(jnp.asarray, packed)

    def run_bucket(self, images: Sequence[ProcessedImage], packing: Packing):
        """One tower call: ``(merged [L/4, 4, D], features [L/4, T])`` device arrays (padding slots included)."""
        return self._run(self.state, self.pack(images, packing))

    def encode(self, images: Sequence[ProcessedImage], *, merged: bool = False) -> list[np.ndarray]:
        """Feature rows per image (``merged=True``: the tower's merged ``[Nᵢ, 4, D]`` instead)."""
        out: list[np.ndarray | None] = [None] * len(images)
        if not images:
            return []
        t0 = time.perf_counter()
        for pk in plan_packing([im.grid for im in images], self.buckets):
            m, f = self.run_bucket([images[i] for i in pk.images], pk)
            src = np.asarray(m if merged else f)
            for i, s, n in zip(pk.images, pk.token_starts, pk.token_counts):
                out[i] = src[s:s + n]
            st = self.stats
            st.calls += 1
            st.images += len(pk.images)
            st.real_rows += pk.real_rows
            st.bucket_rows += pk.length
            st.buckets_used[pk.length] = st.buckets_used.get(pk.length, 0) + 1
        self.stats.seconds += time.perf_counter() - t0
        return out  # type: ignore[return-value]


class K3ForConditionalGeneration(nnx.Module):
    """Text model + MoonViT-V2 tower + patchmergerv2 projector (release names ``language_model.*``,
    ``vision_tower.*``, ``mm_projector.*``)."""

    def __init__(self, cfg: K3Config, vision: VisionConfig, *, rngs: nnx.Rngs | None = None):
        if vision.text_hidden_size != cfg.hidden_size:
            raise ValueError(f"vision_config.text_hidden_size {vision.text_hidden_size} != text hidden_size "
                             f"{cfg.hidden_size}")
        self.config = cfg
        self.vision_config = vision
        self.language_model = K3ForCausalLM(cfg, rngs=rngs)
        keys = KeyGen(rngs.params() if rngs is not None else jax.random.key(0))
        self.vision_tower = VisionTower(vision, dtype=cfg.dtype, keys=keys)
        self.mm_projector = Projector(vision, dtype=cfg.dtype, keys=keys)

    def encoder(self, **kw) -> VisionEncoder:
        """A :class:`VisionEncoder` over this model's current vision weights."""
        return VisionEncoder(self.vision_tower, self.mm_projector, **kw)

    @property
    def pad_id(self) -> int:
        return self.vision_config.media_placeholder_token_id

    def prepare(self, ids: Sequence[int], images: Sequence[ProcessedImage], *,
                encoder: VisionEncoder | None = None) -> MultimodalPrompt:
        """Encode ``images`` and splice them into ``ids`` (one pad per image, or pre-expanded)."""
        enc = encoder or self.encoder()
        return splice_prompt(ids, enc.encode(images), self.pad_id, [im.digest for im in images])

    def __call__(self, input_ids: jax.Array, images: Sequence[ProcessedImage] = (), *,
                 encoder: VisionEncoder | None = None, **kw) -> CausalLMOutput:
        """Logits of one prompt ``input_ids [1, T]`` (or ``[T]``) with its images spliced in (whole sequence)."""
        ids = np.asarray(input_ids).reshape(-1)
        mp = self.prepare(ids.tolist(), images, encoder=encoder)
        T = len(mp.ids)
        x = jnp.asarray(np.asarray(mp.ids, np.int32)[None])
        if not images:
            return self.language_model(x, **kw) if kw else _spliced_forward(self.language_model, x, None)
        rows, mask = mp.overlay(0, T)
        embeds = (jnp.asarray(rows, self.config.dtype)[None], jnp.asarray(mask)[None])
        if kw:
            return self.language_model(x, embeds=embeds, **kw)
        return _spliced_forward(self.language_model, x, embeds)


@nnx.jit
def _spliced_forward(lm: K3ForCausalLM, ids: jax.Array, embeds) -> CausalLMOutput:
    return lm(ids, embeds=embeds)
