"""A release-layout tokenizer directory for tests: ``tiktoken.model`` (the 256 single-byte ranks, plus optional
merges after them) and ``tokenizer_config.json`` naming the release's 16 special tokens in the 256-id block that
follows the ranks, at the same offsets as in the release (whose block starts at 163584).

With no merges the block is ids 256..511, i.e. release id − 163328 (``<|end_of_msg|>`` 258, ``<|open|>`` 259,
``<|close|>`` 260, ``<|sep|>`` 261, ``[PAD]`` 511), so a 512-token test model has exactly the release's layout.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

RELEASE_SPECIAL_BASE = 163584

# name → (release id, HF "special" flag); <|open|> <|close|> <|sep|> are the release's non-special added tokens.
RELEASE_SPECIALS = {
    "[BOS]": (163584, True), "[EOS]": (163585, True), "<|end_of_msg|>": (163586, True),
    "<|open|>": (163587, False), "<|close|>": (163588, False), "<|sep|>": (163589, False),
    "[start_header_id]": (163590, True), "[end_header_id]": (163591, True), "[EOT]": (163593, True),
    "<|media_begin|>": (163602, True), "<|media_content|>": (163603, True), "<|media_end|>": (163604, True),
    "<|media_pad|>": (163605, True), "<osagent_mode>": (163649, True), "[UNK]": (163838, True),
    "[PAD]": (163839, True),
}


def chat_ids(base: int = 256) -> dict[str, int]:
    """The id of each named special when the special block starts at ``base`` (= the number of BPE ranks)."""
    return {name: base + rid - RELEASE_SPECIAL_BASE for name, (rid, _) in RELEASE_SPECIALS.items()}


CHAT_IDS = chat_ids()      # the layout of write_release_tokenizer(dir) with no extra merges


def write_release_tokenizer(directory, extra_merges=()) -> None:
    """Write ``tiktoken.model`` and ``tokenizer_config.json`` into ``directory`` (created if needed)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ranks = [bytes([i]) for i in range(256)] + [m.encode() if isinstance(m, str) else bytes(m) for m in extra_merges]
    (d / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    ids = chat_ids(len(ranks))
    decoder = {str(ids[name]): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                                "single_word": False, "special": special}
               for name, (_, special) in RELEASE_SPECIALS.items()}
    (d / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
        "unk_token": "[UNK]", "tokenizer_class": "TikTokenTokenizer"}, indent=2))
