"""Every option of the serving engine in one frozen, validated dataclass: :class:`EngineConfig`.

Each option has its default, its check and its help text here, once; ``k3jax serve``'s flags are made from the same
fields (:func:`add_options` / :func:`options_from_args`), and the Python API takes the dataclass. What depends on
the model (the longest sequence it allows, the bytes of a page) is resolved by :meth:`EngineConfig.sizes` into an
:class:`EngineSizes`: the static shapes of the engine (slots, pages, prefill and decode buckets).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from k3jax.infer.speculative import SpecConfig


class EngineConfigError(ValueError):
    """An engine option with a bad value; ``field`` names it."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def option(default, help: str, *, flag: str | None = "auto", parse: Callable[[str], Any] | None = None,
           metavar: str | None = None):
    """A dataclass field with its command-line form: ``flag`` (``"auto"``: ``--field-name``; None: Python only),
    ``parse`` (text → value), ``help``. A bool field with default True gets ``--no-field-name``."""
    return field(default=default, metadata={"help": help, "flag": flag, "parse": parse, "metavar": metavar})


def parse_bytes(text: str) -> int:
    """``"512MiB"``, ``"2GB"`` or a byte count."""
    from k3jax.io.export import parse_size

    try:
        return parse_size(int(text) if str(text).isdigit() else text)
    except ValueError:
        raise ValueError(f"expected bytes or a size like '512MiB', got {text!r}") from None


def parse_switch(text: str) -> bool | None:
    """``auto`` → None, ``on``/``true`` → True, ``off``/``false`` → False."""
    t = str(text).lower()
    if t not in ("auto", "on", "true", "off", "false"):
        raise ValueError(f"expected auto, on or off, got {text!r}")
    return None if t == "auto" else t in ("on", "true")


def parse_ints(text: str) -> tuple[int, ...]:
    """``"1024,4096"`` → ``(1024, 4096)``."""
    try:
        return tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class EngineConfig:
    """The engine's options (see each field's help; ``None`` means: derived, as the help says)."""

    max_slots: int = option(8, "decode slots: sequences decoded together")
    max_model_len: int | None = option(None, "longest prompt + generation (default min(max_position_embeddings, "
                                             "8192))")
    page_size: int = option(64, "tokens per MLA cache page")
    num_pages: int | None = option(None, "MLA cache pages in the pool (default: every slot at max-model-len, or "
                                         "what --kv-cache-memory holds)")
    kv_cache_memory: int | None = option(None, "bytes of MLA latent page pool, e.g. 256MiB (instead of "
                                               "--num-pages)", parse=parse_bytes, metavar="BYTES")
    chunk: int = option(256, "largest prefill chunk, a multiple of 16 (buckets chunk, chunk/4, chunk/16)")
    max_step_tokens: int | None = option(None, "token budget of one step: decode tokens + one prefill chunk "
                                               "(default --chunk; smaller: lower time per token, longer time to "
                                               "first token)")
    mixed_steps: bool = option(True, "run the decoding rows and the step's prefill chunk in one forward (off: "
                                     "two forwards, each reading every weight)")
    scan_layers: bool | None = option(None, "the model's periodic run of layers as one scan body, compiled once "
                                            "(auto: where it leaves at most half the layers to compile, e.g. K3's 9 "
                                            "of 93; on; off)", parse=lambda t: parse_switch(t), metavar="auto|on|off")
    max_queue: int = option(256, "waiting requests before new ones are refused (HTTP 429)")
    prefix_cache: bool = option(True, "the KDA-aware prefix cache")
    prefix_cache_memory: int | None = option(None, "bytes for KDA checkpoints and cached MLA pages together, e.g. "
                                                   "2GiB (default: the page pool plus one checkpoint per slot)",
                                             parse=parse_bytes, metavar="BYTES")
    prefix_cache_block: int = option(512, "tokens per prefix-cache hash block (a multiple of 16)")
    prefix_cache_stride: int = option(4, "inside a prompt, a KDA checkpoint every N blocks (besides each prompt's "
                                         "last boundary and branch points)")
    prefix_cache_verify: bool = option(False, "debug: recompute every prefix-cache hit from scratch and compare (a "
                                              "mismatch is logged, counted and recomputed without the cache)")
    speculative: SpecConfig | None = option(None, "speculative decoding: ngram:K (prompt lookup, K drafts per "
                                                  "round; ngram:K:MIN:MAX sets the n-gram sizes, default 2..4) or "
                                                  "draft:PATH:K (a draft model with the same tokenizer)",
                                            parse=SpecConfig.parse, metavar="SPEC")
    vision_buckets: tuple[int, ...] | None = option(None, "vision encoder patch buckets, comma-separated, "
                                                          "compiled at warm-up (default: the encoder's own, "
                                                          "compiled on first use)", parse=parse_ints,
                                                    metavar="ROWS,…")
    record_logits: bool = option(False, "keep each request's next-token logits per generated token", flag=None)
    eos_token_ids: tuple[int, ...] | None = option(None, "ids that end a sequence (default: the model config's "
                                                         "eos_token_id)", flag=None)

    def __post_init__(self):
        if isinstance(self.speculative, str):
            object.__setattr__(self, "speculative", SpecConfig.parse(self.speculative))
        for name in ("vision_buckets", "eos_token_ids"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, tuple):
                object.__setattr__(self, name, tuple(v) if not isinstance(v, int) else (v,))
        for name, ok, want in _CHECKS:
            v = getattr(self, name)
            if not ok(v):
                raise EngineConfigError(f"{name}: expected {want}, got {v!r}", name)
        if self.num_pages is not None and self.kv_cache_memory is not None:
            raise EngineConfigError("num_pages: give num_pages or kv_cache_memory, not both", "num_pages")

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def sizes(self, model_cfg) -> "EngineSizes":
        """The engine's static shapes for a model config (:class:`EngineSizes`); errors name the option."""
        from k3jax.nn.cache import page_bytes

        limit = model_cfg.max_position_embeddings
        max_len = int(self.max_model_len or min(limit, 8192))
        if max_len > limit:
            raise EngineConfigError(f"max_model_len: {max_len} exceeds the model's max_position_embeddings {limit}",
                                    "max_model_len")
        token_bytes = page_bytes(model_cfg)
        max_pages = -(-max_len // self.page_size)
        num_pages = self.num_pages
        if num_pages is None and self.kv_cache_memory is not None:
            num_pages = self.kv_cache_memory // max(1, token_bytes * self.page_size)
            if num_pages < 1:
                raise EngineConfigError(
                    f"kv_cache_memory: {self.kv_cache_memory} bytes is less than one page ({token_bytes * self.page_size}"
                    f" bytes = {self.page_size} tokens × {token_bytes} bytes of MLA latent per token)", "kv_cache_memory")
        eos = model_cfg.eos_token_id if self.eos_token_ids is None else self.eos_token_ids
        eos = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        return EngineSizes(max_slots=self.max_slots, max_model_len=max_len, page_size=self.page_size,
                           max_pages=max_pages, num_pages=int(num_pages or self.max_slots * max_pages),
                           token_bytes=token_bytes, chunk=self.chunk, prefill=prefill_buckets(self.chunk),
                           decode=decode_buckets(self.max_slots), max_step_tokens=int(self.max_step_tokens or self.chunk),
                           eos_ids=frozenset(eos), vocab_size=model_cfg.vocab_size)


_CHECKS: list[tuple[str, Callable[[Any], bool], str]] = [
    ("max_slots", lambda v: _int(v) and v >= 1, "an integer ≥ 1"),
    ("max_model_len", lambda v: v is None or (_int(v) and v >= 2), "an integer ≥ 2 or None"),
    ("page_size", lambda v: _int(v) and v >= 1, "an integer ≥ 1"),
    ("num_pages", lambda v: v is None or (_int(v) and v >= 1), "an integer ≥ 1 or None"),
    ("kv_cache_memory", lambda v: v is None or (_int(v) and v >= 1), "bytes ≥ 1 or None"),
    ("chunk", lambda v: _int(v) and v >= 16 and v % 16 == 0, "a multiple of 16 (KDA's tile)"),
    ("max_step_tokens", lambda v: v is None or (_int(v) and v >= 1), "an integer ≥ 1 or None"),
    ("mixed_steps", lambda v: isinstance(v, bool), "true or false"),
    ("scan_layers", lambda v: v is None or isinstance(v, bool), "true, false or None (auto)"),
    ("max_queue", lambda v: _int(v) and v >= 0, "an integer ≥ 0"),
    ("prefix_cache", lambda v: isinstance(v, bool), "true or false"),
    ("prefix_cache_memory", lambda v: v is None or (_int(v) and v >= 0), "bytes ≥ 0 or None"),
    ("prefix_cache_block", lambda v: _int(v) and v >= 16 and v % 16 == 0, "a multiple of 16 tokens"),
    ("prefix_cache_stride", lambda v: _int(v) and v >= 1, "an integer ≥ 1 (blocks)"),
    ("prefix_cache_verify", lambda v: isinstance(v, bool), "true or false"),
    ("speculative", lambda v: v is None or isinstance(v, SpecConfig), "a SpecConfig, its text or None"),
    ("vision_buckets", lambda v: v is None or (len(v) > 0 and all(_int(b) and b > 0 and b % 4 == 0 for b in v)),
     "positive multiples of 4 rows or None"),
    ("record_logits", lambda v: isinstance(v, bool), "true or false"),
    ("eos_token_ids", lambda v: v is None or all(_int(t) and t >= 0 for t in v), "token ids or None"),
]


def decode_buckets(max_slots: int) -> tuple[int, ...]:
    """The static decode batch sizes: ``max_slots``, and from 8 slots on also the powers of 4 below it (1, 4, 16,
    …), so a lightly loaded pool does not pay for every slot. Each step runs the smallest that holds its rows."""
    out = {max_slots}
    if max_slots >= 8:
        b = 1
        while b < max_slots:
            out.add(b)
            b *= 4
    return tuple(sorted(out))


def prefill_buckets(chunk: int) -> tuple[int, ...]:
    """The static prefill chunk lengths: ``chunk``, ``chunk/4``, ``chunk/16`` (those ≥ 16, multiples of 16)."""
    out = {chunk}
    for d in (4, 16):
        c = chunk // d
        if c >= 16 and c % 16 == 0:
            out.add(c)
    return tuple(sorted(out))


@dataclass(frozen=True)
class EngineSizes:
    """The engine's static shapes, resolved for one model (:meth:`EngineConfig.sizes`)."""

    max_slots: int
    max_model_len: int
    page_size: int
    max_pages: int                # page-table entries per slot
    num_pages: int
    token_bytes: int              # MLA latent bytes per token over all MLA layers
    chunk: int
    prefill: tuple[int, ...]      # prefill chunk buckets
    decode: tuple[int, ...]       # decode batch buckets
    max_step_tokens: int
    eos_ids: frozenset
    vocab_size: int

    def mixed_chunks(self) -> tuple[int, ...]:
        """The chunk buckets a step with decoding rows can carry: those within the step's budget after one
        decode token (a chunk takes what the budget leaves, at least the smallest bucket)."""
        cap = max(self.prefill[0], self.max_step_tokens - 1)
        return tuple(c for c in self.prefill if c <= cap)

    def bucket(self, n_rows: int) -> int:
        """The smallest decode bucket holding ``n_rows`` rows."""
        return next(b for b in self.decode if b >= n_rows)


# ----------------------------------------------------------------------------------------------- command line
def add_options(parser: argparse.ArgumentParser, cls=EngineConfig, skip: Sequence[str] = ()) -> None:
    """One flag per field of ``cls`` that has one (see :func:`option`); defaults stay the dataclass's."""
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if f.name in skip or meta.get("flag") is None:
            continue
        flag = meta["flag"] if meta["flag"] != "auto" else "--" + f.name.replace("_", "-")
        if f.default is True:
            parser.add_argument("--no-" + flag[2:], dest=f.name, action="store_false", default=None,
                                help=f"turn off: {meta['help']}")
        elif f.default is False:
            parser.add_argument(flag, dest=f.name, action="store_true", default=None, help=meta["help"])
        else:
            kind = meta.get("parse") or (_parse_int if isinstance(f.default, int) or "int" in str(f.type) else str)
            parser.add_argument(flag, dest=f.name, default=None, metavar=meta.get("metavar"),
                                help=f"{meta['help']} (default {f.default})" if f.default is not None else meta["help"],
                                type=_flag_parser(flag, kind))


def _parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None


def _flag_parser(flag: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def run(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    run.__name__ = flag
    return run


def options_from_args(args: argparse.Namespace, cls=EngineConfig, **extra):
    """``cls`` from the parsed flags :func:`add_options` made (flags not given keep the defaults) and ``extra``."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
             if getattr(args, f.name, None) is not None}
    return cls(**{**given, **extra})


__all__ = ["EngineConfig", "EngineConfigError", "EngineSizes", "decode_buckets", "prefill_buckets", "add_options",
           "options_from_args", "option", "parse_bytes"]
