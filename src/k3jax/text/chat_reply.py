"""The model's reply in the K3 chat format, back into reasoning, content and OpenAI ``tool_calls``:
:class:`AssistantStreamParser` (incremental, for streaming; markers never leak into the text) and
:func:`parse_assistant`. The prompt side is :mod:`k3jax.text.chat`."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from k3jax.text.chat import CLOSE, END, OPEN, SEP, _unescape  # noqa: F401


@dataclass
class AssistantMessage:
    """A parsed reply: ``reasoning`` (the think channel's text; ``None`` when there was none), ``content`` (the
    response channel, plus any tools block that did not parse) and OpenAI-form ``tool_calls``."""

    reasoning: str | None
    content: str
    tool_calls: list[dict] = field(default_factory=list)


_M_OPEN_THINK = OPEN + "think" + SEP
_M_CLOSE_THINK = CLOSE + "think" + SEP
_M_OPEN_RESPONSE = OPEN + "response" + SEP
_M_CLOSE_RESPONSE = CLOSE + "response" + SEP
_M_OPEN_TOOLS = OPEN + "tools" + SEP
_M_CLOSE_TOOLS = CLOSE + "tools" + SEP
_M_CLOSE_MESSAGE = CLOSE + "message" + SEP

# state → (markers looked for in it); the state a marker leads to is _NEXT[marker]
_CHANNEL_MARKERS = (_M_OPEN_THINK, _M_CLOSE_THINK, _M_OPEN_RESPONSE, _M_CLOSE_RESPONSE, _M_OPEN_TOOLS,
                    _M_CLOSE_MESSAGE, END)
_TOOLS_MARKERS = (_M_CLOSE_TOOLS, _M_CLOSE_MESSAGE, END)
_NEXT = {_M_OPEN_THINK: "think", _M_CLOSE_THINK: "between", _M_OPEN_RESPONSE: "response",
         _M_CLOSE_RESPONSE: "between", _M_OPEN_TOOLS: "tools", _M_CLOSE_TOOLS: "between",
         _M_CLOSE_MESSAGE: "closed", END: "done"}


class _ToolsParseError(ValueError):
    pass


class AssistantStreamParser:
    """Incremental parser of the text the model generates after the generation prompt.

    ``thinking=True``: the prompt ended inside the think channel (``<|open|>think<|sep|>``); ``False``: inside the
    response channel. :meth:`feed` takes newly decoded text and returns deltas ``[("reasoning", s) |
    ("content", s)]``, holding back any suffix that could be the start of a marker, so no marker text ever reaches
    a delta. Text of the tools block is kept until :meth:`finish`. Text outside any channel (between the think and
    response channels, say) counts as content; text after ``<|close|>message<|sep|>`` is ignored.

    :meth:`finish` flushes what was held back (a partial marker at the very end is plain text of the channel it
    was in), parses the tools blocks, and returns the :class:`AssistantMessage`. The deltas it adds (the flushed
    text, and any tools block that did not parse, which becomes content) are left in :attr:`finish_deltas`, so a
    streaming server sends them before its last chunk; all deltas of one kind joined equal that field of the
    message.
    """

    def __init__(self, thinking: bool):
        self.thinking = bool(thinking)
        self.state = "think" if self.thinking else "response"
        self._buf = ""
        self._reasoning: list[str] | None = [] if self.thinking else None
        self._content: list[str] = []
        self._tools: list[list[str]] = []      # raw text of each tools block
        self.finish_deltas: list[tuple[str, str]] = []
        self._finished: AssistantMessage | None = None

    # -- internals
    def _markers(self) -> tuple[str, ...]:
        return _TOOLS_MARKERS if self.state == "tools" else _CHANNEL_MARKERS

    def _emit(self, text: str, deltas: list) -> None:
        if not text or self.state in ("closed", "done"):
            return
        if self.state == "tools":
            self._tools[-1].append(text)
            return
        kind = "reasoning" if self.state == "think" else "content"
        (self._reasoning if kind == "reasoning" else self._content).append(text)
        if deltas and deltas[-1][0] == kind:
            deltas[-1] = (kind, deltas[-1][1] + text)
        else:
            deltas.append((kind, text))

    def _enter(self, marker: str) -> None:
        self.state = _NEXT[marker]
        if self.state == "think" and self._reasoning is None:
            self._reasoning = []
        elif self.state == "tools":
            self._tools.append([])

    def _drain(self, deltas: list, final: bool) -> None:
        buf = self._buf
        while buf and self.state != "done":
            markers = self._markers()
            hits = [(buf.find(m), m) for m in markers]
            hits = [(pos, m) for pos, m in hits if pos >= 0]
            if hits:
                pos, marker = min(hits)
                self._emit(buf[:pos], deltas)
                buf = buf[pos + len(marker):]
                self._enter(marker)
                continue
            hold = 0
            if not final:
                start = buf.find("<", max(0, len(buf) - max(map(len, markers)) + 1))
                while start >= 0:
                    tail = buf[start:]
                    if any(m.startswith(tail) for m in markers):
                        hold = len(tail)
                        break
                    start = buf.find("<", start + 1)
            self._emit(buf[:len(buf) - hold], deltas)
            buf = buf[len(buf) - hold:]
            break
        self._buf = "" if self.state == "done" else buf

    # -- public
    def feed(self, text: str) -> list[tuple[str, str]]:
        """New decoded text in; the reasoning/content deltas it completes out."""
        if self._finished is not None:
            raise RuntimeError("AssistantStreamParser.feed after finish")
        deltas: list[tuple[str, str]] = []
        self._buf += text
        self._drain(deltas, final=False)
        return deltas

    def finish(self) -> AssistantMessage:
        """Flush, parse the tools blocks, and return the whole message (idempotent)."""
        if self._finished is not None:
            return self._finished
        deltas: list[tuple[str, str]] = []
        self._drain(deltas, final=True)
        tool_calls: list[dict] = []
        for block in self._tools:
            raw = "".join(block)
            try:
                tool_calls += _parse_tools(raw, len(tool_calls))
            except _ToolsParseError:
                saved, self.state = self.state, "response"
                self._emit(raw, deltas)
                self.state = saved
        self.finish_deltas = deltas
        self._finished = AssistantMessage(
            reasoning=None if self._reasoning is None else "".join(self._reasoning),
            content="".join(self._content), tool_calls=tool_calls)
        return self._finished


_ATTR = re.compile(r' ([A-Za-z_][\w-]*)="([^"]*)"')


def _take_tag(raw: str, pos: int, name: str) -> tuple[dict, int]:
    """Parse ``<|open|>NAME attrs<|sep|>`` at ``raw[pos:]`` (leading whitespace skipped): (attrs, end)."""
    while pos < len(raw) and raw[pos].isspace():
        pos += 1
    head = OPEN + name
    if not raw.startswith(head, pos):
        raise _ToolsParseError(f"expected {head} at {pos}")
    end = raw.find(SEP, pos)
    if end < 0:
        raise _ToolsParseError("unterminated tag")
    attr_text = raw[pos + len(head):end]
    attrs = {k: _unescape(v) for k, v in _ATTR.findall(attr_text)}
    if _ATTR.sub("", attr_text).strip():
        raise _ToolsParseError(f"bad attributes {attr_text!r}")
    return attrs, end + len(SEP)


def _take_body(raw: str, pos: int, name: str) -> tuple[str, int]:
    """The text up to ``<|close|>NAME<|sep|>`` and the position after it."""
    close = CLOSE + name + SEP
    end = raw.find(close, pos)
    if end < 0:
        raise _ToolsParseError(f"missing {close}")
    return raw[pos:end], end + len(close)


def _parse_value(kind: str | None, text: str):
    if kind == "string":
        return text
    try:
        value = json.loads(text)
    except ValueError:
        if kind in ("number", "boolean", "null", "object", "array"):
            raise _ToolsParseError(f"bad {kind} value {text!r}") from None
        return text          # an unknown type: the JSON if it parses, else the text
    expected = {"number": (int, float), "boolean": bool, "null": type(None), "object": dict, "array": list}.get(kind)
    if expected is not None and (not isinstance(value, expected) or (kind == "number" and isinstance(value, bool))):
        raise _ToolsParseError(f"{text!r} is not a {kind}")
    return value


def _parse_tools(raw: str, first: int) -> list[dict]:
    """OpenAI ``tool_calls`` from the text of a tools block; ``first`` numbers the ids on from earlier blocks."""
    calls, pos = [], 0
    while raw[pos:].strip():
        attrs, pos = _take_tag(raw, pos, "call")
        name = attrs.get("tool")
        if not name:
            raise _ToolsParseError("call without tool name")
        body, pos = _take_body(raw, pos, "call")
        args: dict = {}
        arguments = None
        bpos = 0
        while body[bpos:].strip():
            lead = body[bpos:].lstrip()
            if lead.startswith(OPEN + "json"):
                if arguments is not None or args:
                    raise _ToolsParseError("json body mixed with arguments")
                _, bpos = _take_tag(body, bpos, "json")
                arguments, bpos = _take_body(body, bpos, "json")
                continue
            if arguments is not None:
                raise _ToolsParseError("arguments after a json body")
            a, bpos = _take_tag(body, bpos, "argument")
            if "key" not in a:
                raise _ToolsParseError("argument without key")
            text, bpos = _take_body(body, bpos, "argument")
            args[a["key"]] = _parse_value(a.get("type"), text)
        if arguments is None:
            arguments = json.dumps(args, ensure_ascii=False)
        n = first + len(calls)
        calls.append({"id": f"call_{n}_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": arguments}})
    return calls


def parse_assistant(text: str, *, thinking: bool) -> AssistantMessage:
    """A whole reply at once: :class:`AssistantStreamParser` fed ``text`` and finished."""
    parser = AssistantStreamParser(thinking)
    parser.feed(text)
    return parser.finish()


__all__ = ["AssistantMessage", "AssistantStreamParser", "parse_assistant"]
