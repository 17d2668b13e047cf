"""Tokenizers, shared by training and inference: bytes, a Hugging Face ``tokenizer.json``, and the release's own
tiktoken BPE (``tiktoken.model`` + special tokens from ``tokenizer_config.json``), all offline.

Every tokenizer has ``name``, ``vocab_size``, ``bos_id``, ``eos_id``, ``pad_id``, ``encode(text) -> list[int]``
(special tokens typed in the text are recognised), ``encode_ordinary(text) -> list[int]`` (they are not: a typed
``<|open|>`` becomes ordinary ids — what a chat renderer needs for message text, see :mod:`k3jax.text.chat`),
``special_id(name) -> int | None`` and ``decode(ids) -> str``. :func:`load_tokenizer` turns a spec (``"bytes"``, a
file or a directory) into one.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path


class DataError(ValueError):
    """Unusable input data — a corpus file or a tokenizer file; the message names the file and what was expected."""


class ByteTokenizer:
    """UTF-8 bytes as ids 0–255; BOS=256, EOS=257, PAD=258 (the ``tiny`` preset's vocabulary of 264)."""

    name = "bytes"
    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_ordinary(self, text: str) -> list[int]:
        """The same as :meth:`encode`: bytes have no special tokens to recognise."""
        return self.encode(text)

    def special_id(self, name: str) -> int | None:
        """Always ``None``: the byte vocabulary names no special tokens (BOS/EOS/PAD are ids, not texts)."""
        return None

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library."""

    def __init__(self, path: str | Path, bos: str | None = None, eos: str | None = None):
        from tokenizers import Tokenizer

        self.path = Path(path)
        try:
            self.tok = Tokenizer.from_file(str(self.path))
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exceptions
            raise DataError(f"{self.path}: not a Hugging Face tokenizer.json ({e})") from None
        self.name = f"hf:{self.path.name}"
        self.vocab_size = self.tok.get_vocab_size()
        vocab = self.tok.get_vocab()
        pick = lambda names: next((vocab[n] for n in names if n in vocab), None)  # noqa: E731
        self.bos_id = vocab[bos] if bos else pick(["<s>", "<|begin_of_text|>", "[BOS]", "<bos>", "<|bos|>"])
        self.eos_id = vocab[eos] if eos else pick(["</s>", "<|end_of_text|>", "<|endoftext|>", "[EOS]", "<eos>"])
        if self.eos_id is None:
            self.eos_id = self.vocab_size - 1
        if self.bos_id is None:
            self.bos_id = self.eos_id
        self.pad_id = self.eos_id

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_ordinary(self, text: str) -> list[int]:
        """Best effort: no BOS/EOS template tokens are added, but the ``tokenizers`` library still matches the
        file's *added tokens* inside the text, so a typed added token can become its id here."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def special_id(self, name: str) -> int | None:
        """The id of the vocabulary entry (added token or not) spelled ``name``, else ``None``."""
        return self.tok.token_to_id(name)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


# Moonshot's pre-tokenisation pattern (``TikTokenTokenizer.pat_str`` in the release's ``tokenization_kimi.py``,
# shared by Moonlight, Kimi K2 and K3): Han runs split from Latin-script words, numbers in groups of ≤ 3.
KIMI_PAT_STR = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
NUM_RESERVED_SPECIAL = 256        # the release reserves 256 ids after the BPE ranks for special tokens


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """``tiktoken.model``: one ``<base64 token> <rank>`` per line."""
    ranks: dict[bytes, int] = {}
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
        except ValueError:
            raise DataError(f"{path}: line {n}: expected '<base64 token> <rank>', got {line[:60]!r}") from None
    if not ranks:
        raise DataError(f"{path}: no BPE ranks")
    return ranks


class TiktokenTokenizer:
    """The release tokenizer: ``tiktoken.model`` ranks + ``tokenizer_config.json`` specials, through ``tiktoken``."""

    def __init__(self, directory: str | Path):
        import tiktoken

        d = Path(directory)
        ranks = read_tiktoken_ranks(d / "tiktoken.model")
        base = len(ranks)
        specials: dict[str, int] = {}
        cfg_path = d / "tokenizer_config.json"
        cfg = {}
        if cfg_path.exists():
            try:
                cfg = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as e:
                raise DataError(f"{cfg_path}: not valid JSON ({e.msg} at line {e.lineno})") from None
            for i, tok in (cfg.get("added_tokens_decoder") or {}).items():
                specials[tok["content"] if isinstance(tok, dict) else str(tok)] = int(i)
        taken = set(specials.values())
        for i in range(base, base + NUM_RESERVED_SPECIAL):
            if i not in taken:
                specials[f"<|reserved_token_{i}|>"] = i
        self.enc = tiktoken.Encoding(name=f"k3jax:{d.name}", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                     special_tokens=specials)
        self.name = f"tiktoken:{d.name}"
        self.vocab_size = self.enc.n_vocab

        def special(key: str, fallback: str) -> int | None:
            v = cfg.get(key)
            v = v.get("content") if isinstance(v, dict) else v
            return specials.get(v or fallback)

        self.bos_id = special("bos_token", "[BOS]")
        self.eos_id = special("eos_token", "[EOS]")
        self.pad_id = special("pad_token", "[PAD]") or self.eos_id
        self.specials = specials

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special="all")

    def encode_ordinary(self, text: str) -> list[int]:
        """``text`` with no special token recognised: a typed ``<|open|>`` is BPE-encoded like any other text."""
        return self.enc.encode(text, disallowed_special=())

    def special_id(self, name: str) -> int | None:
        """The id of the special token spelled ``name`` (``tokenizer_config.json``'s or a reserved one), else None."""
        return self.specials.get(name)

    def decode(self, ids) -> str:
        return self.enc.decode([int(i) for i in ids])


def load_tokenizer(spec: str | Path | None):
    """The tokenizer a spec names (``k3jax train --set tokenizer=…``, a training run's ``train_config.json``,
    ``k3jax generate``): ``None``/``""``/``"bytes"`` → :class:`ByteTokenizer`; a file → a Hugging Face
    ``tokenizer.json`` (:class:`HFTokenizer`); a directory → its ``tiktoken.model`` (the release format,
    :class:`TiktokenTokenizer`) or else its ``tokenizer.json``."""
    if spec in (None, "", "bytes"):
        return ByteTokenizer()
    p = Path(spec)
    if p.is_dir():
        if (p / "tiktoken.model").exists():
            return TiktokenTokenizer(p)
        if (p / "tokenizer.json").exists():
            return HFTokenizer(p / "tokenizer.json")
        raise DataError(f"{p}: no tokenizer found (expected tiktoken.model or tokenizer.json)")
    if p.is_file():
        return HFTokenizer(p)
    raise DataError(f"tokenizer {str(spec)!r}: not 'bytes', a tokenizer.json file or a directory holding one")


__all__ = ["DataError", "ByteTokenizer", "HFTokenizer", "TiktokenTokenizer", "load_tokenizer", "read_tiktoken_ranks",
           "KIMI_PAT_STR", "NUM_RESERVED_SPECIAL"]
