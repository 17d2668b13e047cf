"""Training data: an embedded default corpus, user data, and packing into fixed-length rows.

* Default corpus: the ``.py`` sources of this Python's standard library (real text on every machine, no
  download), chosen deterministically (sorted relative paths, test suites and vendored packages excluded) up to a
  byte budget; its SHA-256 is recorded so a run says exactly what it trained on.
* User data: a ``.txt`` file (one document), a ``.jsonl`` file (one document per line, field ``text`` by default),
  or a directory (every ``.txt``/``.md``/``.py``/``.jsonl`` file under it, sorted).
* Tokenizers: :mod:`k3jax.text.tokenizer` (bytes, a Hugging Face ``tokenizer.json`` or a release ``tiktoken.model``),
  shared with inference; its :class:`~k3jax.text.tokenizer.DataError` is the error of this module too.
* Packing: documents become ``[BOS] tokens [EOS]`` and are concatenated into rows of ``seq_len + 1`` tokens with a
  segment id per position (static shapes). KDA state, conv windows and MLA attention restart at every segment
  boundary; targets that cross a boundary are masked out of the loss.
* Split: every ``val_every``-th document (in corpus order) is validation. Batches come from a seeded permutation
  of the training rows per epoch; the iterator position is a step count, checkpointed with the model.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from k3jax.text.tokenizer import DataError


# ---------------------------------------------------------------------------------------------- documents
_SKIP_PARTS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__", "turtledemo",
               "ensurepip", "_vendor", "pydoc_data"}


def stdlib_corpus(max_bytes: int = 4_000_000) -> tuple[list[str], dict]:
    """The default corpus: standard-library ``.py`` files in sorted order up to ``max_bytes``; and its record."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not (_SKIP_PARTS & set(p.relative_to(root).parts)))
    docs, names, h, total = [], [], hashlib.sha256(), 0
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        if total + len(text) > max_bytes:
            break
        docs.append(text)
        names.append(str(p.relative_to(root)))
        h.update(names[-1].encode() + b"\0" + text.encode() + b"\0")
        total += len(text)
    if not docs:
        raise DataError(f"{root}: no standard-library sources found for the default corpus")
    return docs, {"source": f"python-stdlib:{root}", "files": len(docs), "bytes": total, "sha256": h.hexdigest(),
                  "first": names[0], "last": names[-1]}


def _read_text(p: Path) -> str:
    raw = p.read_bytes()
    if b"\0" in raw[:8192]:
        raise DataError(f"{p}: looks binary (NUL bytes); expected UTF-8 text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{p}: not UTF-8 text ({e})") from None


def _read_jsonl(p: Path, field: str) -> list[str]:
    docs = []
    for n, line in enumerate(_read_text(p).splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{p}:{n}: not valid JSON ({e})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
            raise DataError(f"{p}:{n}: expected an object with a string field {field!r}")
        docs.append(obj[field])
    return docs


def user_corpus(path: str | Path, text_field: str = "text") -> tuple[list[str], dict]:
    """Documents from a ``.txt``/``.jsonl`` file or a directory of text files."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: no such file or directory")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in (".txt", ".md", ".py", ".jsonl"))
        if not files:
            raise DataError(f"{p}: no .txt, .md, .py or .jsonl files inside")
    else:
        files = [p]
    docs: list[str] = []
    h = hashlib.sha256()
    for f in files:
        part = _read_jsonl(f, text_field) if f.suffix == ".jsonl" else [_read_text(f)]
        docs.extend(d for d in part if d.strip())
        h.update(f.read_bytes())
    if not docs:
        raise DataError(f"{p}: contains no text (empty documents only)")
    return docs, {"source": str(p), "files": len(files), "bytes": sum(len(d) for d in docs), "sha256": h.hexdigest()}


# ------------------------------------------------------------------------------------------------- packing
@dataclass
class PackedSplit:
    """Rows of ``seq_len + 1`` token ids with per-position segment ids (documents numbered from 1)."""

    tokens: np.ndarray      # [rows, seq_len + 1] int32
    segments: np.ndarray    # [rows, seq_len + 1] int32

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]


def pack(docs: list[list[int]], seq_len: int, bos: int, eos: int, name: str = "data") -> PackedSplit:
    """Concatenate ``[BOS] doc [EOS]`` and cut rows of ``seq_len + 1`` (the tail shorter than a row is dropped)."""
    stream = np.concatenate([np.asarray([bos] + d + [eos], np.int32) for d in docs])
    seg = np.concatenate([np.full(len(d) + 2, i + 1, np.int32) for i, d in enumerate(docs)])
    n = (len(stream) // (seq_len + 1))
    if n == 0:
        raise DataError(f"{name}: {len(stream)} tokens in total, fewer than one sequence of seq_len+1 = "
                        f"{seq_len + 1}; use a shorter seq_len or more data")
    return PackedSplit(stream[: n * (seq_len + 1)].reshape(n, seq_len + 1),
                       seg[: n * (seq_len + 1)].reshape(n, seq_len + 1))


class Dataset:
    """Tokenized, packed train/val splits and a deterministic batch iterator."""

    def __init__(self, docs: list[str], info: dict, tokenizer, seq_len: int, val_every: int = 20, seed: int = 0):
        if seq_len < 2:
            raise DataError(f"seq_len: expected ≥ 2, got {seq_len}")
        self.tokenizer, self.seq_len, self.seed, self.info = tokenizer, seq_len, seed, info
        ids = [tokenizer.encode(d) for d in docs]
        val = [d for i, d in enumerate(ids) if i % val_every == val_every - 1]
        train = [d for i, d in enumerate(ids) if i % val_every != val_every - 1]
        if not val:                                   # tiny corpora: hold out the last document's tail instead
            cut = max(1, len(train[-1]) * 9 // 10)
            val, train = [train[-1][cut:]], train[:-1] + [train[-1][:cut]]
        src = info.get("source", "data")
        self.train = pack(train, seq_len, tokenizer.bos_id, tokenizer.eos_id, f"{src} (train split)")
        self.val = pack(val, seq_len, tokenizer.bos_id, tokenizer.eos_id, f"{src} (validation split)")
        counts = np.bincount(np.concatenate([np.asarray(d, np.int64) for d in train]),
                             minlength=tokenizer.vocab_size).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        self.unigram_entropy = float(-(p * np.log(p)).sum())        # nats per token (train split)
        self.train_tokens = int(sum(len(d) for d in train))

    def batch(self, split: PackedSplit, index: np.ndarray) -> dict[str, np.ndarray]:
        tok, seg = split.tokens[index], split.segments[index]
        return {"input_ids": tok[:, :-1], "targets": tok[:, 1:], "segment_ids": seg[:, :-1],
                "loss_mask": (seg[:, 1:] == seg[:, :-1]).astype(np.float32)}

    def train_batch(self, step: int, batch_size: int) -> dict[str, np.ndarray]:
        """The batch for ``step`` (0-based): epoch-wise seeded permutations of the training rows."""
        rows = self.train.rows
        start = step * batch_size
        idx = []
        while len(idx) < batch_size:
            epoch, off = divmod(start + len(idx), rows)
            perm = np.random.default_rng([self.seed, epoch]).permutation(rows)
            take = min(batch_size - len(idx), rows - off)
            idx.extend(perm[off: off + take])
        return self.batch(self.train, np.asarray(idx))

    def val_batches(self, batch_size: int, max_batches: int):
        rows = self.val.rows
        for b in range(min(max_batches, max(1, rows // batch_size))):
            idx = np.arange(b * batch_size, (b + 1) * batch_size) % rows
            yield self.batch(self.val, idx)
