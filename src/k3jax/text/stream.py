"""Streaming text out of a growing token list: incremental detokenization and stop strings.

:class:`IncrementalDecoder` turns token ids pushed a few at a time into the text they add, in O(new tokens) per push
(the CLI's stream and the server's both use it); :class:`StopStrings` cuts streamed text at the first stop string,
holding back what could still be the start of one.
"""

from __future__ import annotations

from typing import Sequence


class IncrementalDecoder:
    """Text deltas of a token stream. Each push decodes only a short window — the ids after the last emitted
    boundary — and returns what that window adds past the text already sent; an unfinished UTF-8 sequence (a
    trailing U+FFFD) is held back until its bytes arrive (or until :meth:`flush`).

    The window restarts at each emitted boundary, so the text of ``ids[:prefix]`` is never decoded again: a
    tokenizer whose text for ``ids[a:]`` does not start where the text of ``ids[:a]`` ended (one that merges across
    the boundary) would need a longer window; byte-level BPE tokenizers (tiktoken, the byte tokenizer) do not."""

    def __init__(self, tokenizer):
        self.tok, self.ids = tokenizer, []
        self.prefix = self.read = 0          # ids[prefix:read] were emitted; their text is the window's start

    def push(self, ids: Sequence[int], final: bool = False) -> str:
        """The text ``ids`` add (possibly empty while a multi-byte character is incomplete)."""
        self.ids.extend(int(t) for t in ids)
        text = self.tok.decode(self.ids[self.prefix:])
        if text.endswith("\ufffd") and not final:
            return ""
        done = self.tok.decode(self.ids[self.prefix:self.read])
        delta = text[len(done):]
        self.prefix, self.read = self.read, len(self.ids)
        return delta

    def flush(self) -> str:
        """What is still held back (an unfinished character at the end of the stream, decoded as U+FFFD)."""
        return self.push([], final=True)


class StopStrings:
    """Stop strings over streamed text: :meth:`push` returns what may be sent now — holding back a possible prefix
    of a stop string — and sets :attr:`hit` when a stop string appears (the text is cut before it; later pushes
    return nothing)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buf = ""
        self.hit = False

    def push(self, text: str, final: bool = False) -> str:
        if self.hit:
            return ""
        self.buf += text
        if self.stops:
            cut = min((i for i in (self.buf.find(s) for s in self.stops) if i >= 0), default=-1)
            if cut >= 0:
                out, self.buf, self.hit = self.buf[:cut], "", True
                return out
        if final or not self.hold:
            out, self.buf = self.buf, ""
            return out
        if len(self.buf) <= self.hold:
            return ""
        out, self.buf = self.buf[:-self.hold], self.buf[-self.hold:]
        return out


class TextStream:
    """Generated ids → text deltas: :class:`IncrementalDecoder`, then :class:`StopStrings`; ids in ``skip`` (stop
    tokens) add no text. ``hit`` says a stop string ended the text."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), skip: Sequence[int] = ()):
        self.decoder, self.stops, self.skip = IncrementalDecoder(tokenizer), StopStrings(stop), frozenset(skip)

    @property
    def hit(self) -> bool:
        return self.stops.hit

    def push(self, ids: Sequence[int]) -> str:
        ids = [t for t in ids if t not in self.skip]
        return self.stops.push(self.decoder.push(ids)) if ids else ""

    def finish(self) -> str:
        """The text still held back, at the end of the stream."""
        return "" if self.hit else self.stops.push(self.decoder.flush(), final=True)


__all__ = ["IncrementalDecoder", "StopStrings", "TextStream"]
