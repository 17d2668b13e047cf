"""Per-request token bans, computed on the host before a step and applied on the device while sampling.

A step carries, per row, a bitmask of the token ids that row may not sample (``[rows, ⌈V/32⌉]`` uint32, bit
``v % 32`` of word ``v // 32``; all zero: no ban) — :func:`ban_mask` packs it, :func:`k3jax.infer.sampling.unpack_bans`
unpacks it on the device. :class:`NoRepeatNgram` is the first user (``SamplingParams.no_repeat_ngram``).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np


def mask_words(vocab_size: int) -> int:
    """uint32 words per row of a ban mask."""
    return -(-int(vocab_size) // 32)


def ban_mask(bans: Sequence[Iterable[int] | None], vocab_size: int) -> np.ndarray:
    """``[len(bans), ⌈V/32⌉]`` uint32: row b has the bits of ``bans[b]`` set (None or empty: no ban)."""
    out = np.zeros((len(bans), mask_words(vocab_size)), np.uint32)
    for b, ids in enumerate(bans):
        if ids:
            a = np.fromiter(ids, np.int64)
            np.bitwise_or.at(out[b], a // 32, (np.uint32(1) << (a % 32).astype(np.uint32)))
    return out


class NoRepeatNgram:
    """Bans every token that would complete an n-gram already in the sequence (prompt and output): a map
    (n−1)-gram → the tokens that followed it, grown as tokens are added (transformers' ``no_repeat_ngram_size``)."""

    def __init__(self, n: int, prompt: Sequence[int]):
        if n < 1:
            raise ValueError(f"no_repeat_ngram: expected n ≥ 1, got {n}")
        self.n = n
        self.tokens: list[int] = []
        self.follow: dict[tuple, set] = {}
        self.changed = 0
        for t in prompt:
            self.push(int(t))

    def push(self, token: int) -> None:
        self.tokens.append(int(token))
        if len(self.tokens) >= self.n:
            self.follow.setdefault(tuple(self.tokens[len(self.tokens) - self.n:-1]), set()).add(self.tokens[-1])

    def banned(self) -> set:
        """The tokens that may not come next."""
        if self.n == 1:
            return set(self.tokens)
        if len(self.tokens) < self.n - 1:
            return set()
        return self.follow.get(tuple(self.tokens[len(self.tokens) - self.n + 1:]), set())


__all__ = ["ban_mask", "mask_words", "NoRepeatNgram"]
