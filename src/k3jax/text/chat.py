"""The Kimi K3 chat format ("XTML"): OpenAI-style messages → prompt segments → token ids, and the model's reply
back into reasoning, content and tool calls — for ``/v1/chat/completions``.

A tag is ``<|open|>NAME( KEY="VALUE")*<|sep|>`` … ``<|close|>NAME<|sep|>`` and every message ends with
``<|end_of_msg|>``. The four markers are special tokens; everything else (tag names, attribute keys and values,
message text) is ordinary text. :func:`render_chat` therefore returns *segments* ``(text, allow_special)`` and
:func:`encode_chat` tokenizes each one on its own, so a user who types ``<|open|>`` gets ordinary ids and never the
marker's id, and no BPE merge crosses a segment boundary (encoding the joined string in one pass would do both
wrong).

Prompt order: a tool-declare system message (when ``tools``), a thinking-effort system message (thinking mode with
an effort), the conversation, a tool-choice message (``required``/``none``), a response-format message
(``json_object``/``json_schema``), and the generation prompt — ``<|open|>message role="assistant"<|sep|>`` followed
by ``<|open|>think<|sep|>`` (thinking) or ``<|open|>response<|sep|>``.

The model's reply is parsed by :class:`AssistantStreamParser` (incrementally, for streaming) or
:func:`parse_assistant`: the think channel → ``reasoning``, the response channel → ``content``, the tools block →
OpenAI ``tool_calls``. Generation stops on ``<|end_of_msg|>`` (``tokenizer.special_id("<|end_of_msg|>")``), not on
the tokenizer's ``[EOS]``.
"""

from __future__ import annotations

import json
import re

__all__ = ["ChatFormatError", "CHAT_MARKERS", "IMAGE_PLACEHOLDER", "render_chat", "render_chat_text", "chat_tokenizer_problem",
           "encode_chat", "AssistantMessage", "AssistantStreamParser", "parse_assistant"]


class ChatFormatError(ValueError):
    """A request the chat format cannot render; the message starts with the offending field's path
    (``messages[2].role: …``, ``reasoning_effort: …``) so a server can answer 400 with it as is."""


OPEN, SEP, CLOSE, END = "<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>"
CHAT_MARKERS = (OPEN, SEP, CLOSE, END)
# Other release specials an allow_special segment may hold (image prompts); split out like the markers.
_MEDIA_SPECIALS = ("<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")
_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(m) for m in CHAT_MARKERS + _MEDIA_SPECIALS) + ")")

ROLES = ("system", "user", "assistant", "tool")
EFFORTS = ("low", "high", "max")

_TOOLS_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
# The heading is the format's; the sentence under it is k3jax's wording (the spec gives only the heading).
_DYNAMIC_TOOLS_HEADER = "## New Tools Available\nHere are the newly available tools, described in JSONSchema.\n\n"
_EFFORT_BODY = ("`thinking_effort` guides on how much to think in your thinking channel (not including the response "
                "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                "Now the system is invoked with `thinking_effort={}`.")
# k3jax's wording: the spec fixes the message types (tool-choice, response-format) but not their bodies.
_TOOL_CHOICE_BODY = {"required": "You MUST call at least one tool in the next message.",
                     "none": "You MUST NOT call any tools in the next message."}
_JSON_OBJECT_BODY = "Respond in the response channel with one valid JSON object and nothing else."
_JSON_SCHEMA_BODY = ("Respond in the response channel with one valid JSON value and nothing else; it must conform to "
                     "the JSONSchema{name} below.\n\n")

Segments = list  # list[tuple[str, bool]]


# ---------------------------------------------------------------------------------------------------- rendering
def _escape(value) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def _open(out: Segments, tag: str, /, **attrs) -> None:
    out.append((OPEN, True))
    out.append((tag, False))
    for key, value in attrs.items():
        if value is None:
            continue
        out += [(" " + key, False), ('="', False), (_escape(value), False), ('"', False)]
    out.append((SEP, True))


def _close(out: Segments, tag: str) -> None:
    out += [(CLOSE, True), (tag, False), (SEP, True)]


def _text(out: Segments, text: str) -> None:
    out.append((text, False))


def _message(out: Segments, body: str, **attrs) -> None:
    """A whole ``message`` whose body is one ordinary text."""
    _open(out, "message", **attrs)
    _text(out, body)
    _close(out, "message")
    out.append((END, True))


def _json_block(value) -> str:
    """A JSON code fence: keys recursively sorted, compact separators, non-ASCII kept."""
    return "```json\n" + json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n```"


def _tools_list(tools, where: str) -> list:
    if not isinstance(tools, list):
        raise ChatFormatError(f"{where}: expected a list of tool objects, got {type(tools).__name__}")
    for j, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ChatFormatError(f"{where}[{j}]: expected a tool object, got {type(tool).__name__}")
    return tools


IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"      # plain text, not a vocabulary token (K3_CHAT §5)
IMAGE_PART_TYPES = ("image", "image_url", "input_image")


def _content_text(content, where: str, *, allow_none: bool = True, images: bool = False) -> str:
    """A message's content: a string, ``None`` (empty) or a list of parts whose text is joined with nothing between;
    with ``images`` an image part becomes :data:`IMAGE_PLACEHOLDER`."""
    if content is None and allow_none:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, dict):
                raise ChatFormatError(f"{where}[{j}]: expected a content part object, got {type(part).__name__}")
            kind = part.get("type")
            if kind == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise ChatFormatError(f"{where}[{j}].text: expected a string, got {type(text).__name__}")
                texts.append(text)
            elif kind in IMAGE_PART_TYPES:
                if not images:
                    raise ChatFormatError(f"{where}[{j}]: images are accepted in user and system messages only")
                texts.append(IMAGE_PLACEHOLDER)
            else:
                raise ChatFormatError(f"{where}[{j}].type: expected 'text', got {kind!r}")
        return "".join(texts)
    raise ChatFormatError(f"{where}: expected a string or a list of content parts, got {type(content).__name__}")


def _opt_str(msg: dict, key: str, where: str) -> str | None:
    value = msg.get(key)
    if value is None or isinstance(value, str):
        return value
    raise ChatFormatError(f"{where}.{key}: expected a string, got {type(value).__name__}")


def _arg_value(value) -> tuple[str, str]:
    """(type attribute, rendered value) of one tool-call argument."""
    if isinstance(value, str):
        return "string", value
    if isinstance(value, bool):
        kind = "boolean"
    elif isinstance(value, (int, float)):
        kind = "number"
    elif value is None:
        kind = "null"
    elif isinstance(value, dict):
        kind = "object"
    elif isinstance(value, (list, tuple)):
        kind = "array"
    else:
        raise TypeError(type(value).__name__)
    return kind, json.dumps(value, ensure_ascii=False)


def _calls(tool_calls, where: str) -> list[tuple[str | None, str, object]]:
    """Validated ``(id, name, arguments)`` of an assistant message's ``tool_calls``."""
    if not isinstance(tool_calls, list):
        raise ChatFormatError(f"{where}: expected a list of tool calls, got {type(tool_calls).__name__}")
    calls = []
    for j, call in enumerate(tool_calls):
        w = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise ChatFormatError(f"{w}: expected a tool call object, got {type(call).__name__}")
        fn = call.get("function", call)     # OpenAI form, or a bare {"name", "arguments"}
        if "function" in call:
            w += ".function"
        if not isinstance(fn, dict):
            raise ChatFormatError(f"{w}: expected an object, got {type(fn).__name__}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ChatFormatError(f"{w}.name: expected a non-empty string, got {name!r}")
        args = fn.get("arguments")
        if args is not None and not isinstance(args, (str, dict)):
            raise ChatFormatError(f"{w}.arguments: expected a JSON string or an object, got {type(args).__name__}")
        call_id = call.get("id")
        calls.append((call_id if isinstance(call_id, str) else None, name, args))
    return calls


def _render_call(out: Segments, index: int, name: str, args, where: str) -> None:
    _open(out, "call", tool=name, index=index)
    raw = None
    if isinstance(args, str):
        if args.strip():
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                args = parsed
            else:
                raw = args
        else:
            args = None
    if raw is not None:
        _open(out, "json", type="object")
        _text(out, raw)
        _close(out, "json")
    else:
        for key, value in (args or {}).items():
            try:
                kind, text = _arg_value(value)
            except TypeError as e:
                raise ChatFormatError(f"{where}.arguments.{key}: not a JSON value ({e})") from None
            _open(out, "argument", key=key, type=kind)
            _text(out, text)
            _close(out, "argument")
    _close(out, "call")


def _tool_run_order(run: list[int], messages: list, calls) -> tuple[list[int], bool]:
    """The order to render a run of consecutive tool messages in: call order when every message's
    ``tool_call_id`` names a distinct call of the last assistant turn, else as given."""
    if not calls:
        return run, False
    position = {cid: k for k, (cid, _, _) in enumerate(calls) if cid is not None}
    ids = [messages[i].get("tool_call_id") for i in run]
    if all(isinstance(c, str) and c in position for c in ids) and len(set(ids)) == len(ids):
        return [i for _, i in sorted(zip((position[c] for c in ids), run))], True
    return run, False


def render_chat(messages: list[dict], *, tools: list[dict] | None = None, thinking: bool = True,
                thinking_effort: str | None = "max", tool_choice=None, response_format=None,
                add_generation_prompt: bool = True, image_prompts: list[str] | None = None) -> list[tuple[str, bool]]:
    """Segments ``(text, allow_special)`` of the prompt for ``messages``, in order (empty segments dropped).

    ``allow_special`` segments are the markers (``<|open|>``, ``<|sep|>``, ``<|close|>``, ``<|end_of_msg|>``);
    everything else is ordinary text. ``thinking=False`` drops every think channel, history included, and the
    effort message; with ``thinking`` an effort of ``None`` renders no effort message, anything else must be
    low/high/max. Assistant history: ``reasoning_content`` (else ``reasoning``), ``content``, and ``tool_calls``
    whose ``arguments`` may be a JSON string (parsed first; unparseable or not an object → rendered raw in a
    ``json`` block). Tool messages: ``index`` counts tool messages since the last assistant turn; the tool name is
    the message's ``tool``/``name``, else that turn's call at the same position; a run of tool messages whose
    ``tool_call_id``\\ s all name that turn's calls is first put in call order. A system message carrying ``tools``
    renders its content (if any) and then a dynamic tool-declare message. ``tool_choice`` "required"/"none" and a
    ``response_format`` of ``json_object``/``json_schema`` add a system message after the conversation — their body
    text is k3jax's wording (the format fixes only the message ``type``). An image part (user and system messages)
    renders :data:`IMAGE_PLACEHOLDER`; with ``image_prompts`` (one per image, in order) every placeholder —
    a typed one too — becomes its image's prompt as one allow_special segment, and the counts must agree.
    Any unusable field raises :class:`ChatFormatError` naming it.
    """
    out: Segments = []
    if not isinstance(messages, list):
        raise ChatFormatError(f"messages: expected a list of message objects, got {type(messages).__name__}")
    if tools:
        _message(out, _TOOLS_HEADER + _json_block(_tools_list(tools, "tools")), role="system", type="tool-declare")
    if thinking and thinking_effort is not None:
        if thinking_effort not in EFFORTS:
            raise ChatFormatError(f"reasoning_effort: expected one of {', '.join(EFFORTS)}; got {thinking_effort!r}")
        _message(out, _EFFORT_BODY.format(thinking_effort), role="system", type="thinking-effort")

    # Validate roles first, so the error names the first bad message whatever comes before it.
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ChatFormatError(f"messages[{i}]: expected a message object, got {type(msg).__name__}")
        if "role" not in msg:
            raise ChatFormatError(f"messages[{i}].role: missing (expected one of {', '.join(ROLES)})")
        if msg["role"] not in ROLES:
            raise ChatFormatError(f"messages[{i}].role: expected one of {', '.join(ROLES)}; got {msg['role']!r}")

    calls: list = []        # the last assistant turn's (id, name, arguments)
    tool_count = 0          # tool messages since that turn
    i = 0
    while i < len(messages):
        msg, where = messages[i], f"messages[{i}]"
        role = msg["role"]
        if role == "tool":
            j = i
            while j < len(messages) and messages[j]["role"] == "tool":
                j += 1
            order, from_calls = _tool_run_order(list(range(i, j)), messages, calls)
            by_id = {cid: name for cid, name, _ in calls}
            for k in order:
                tmsg, tw = messages[k], f"messages[{k}]"
                tool_count += 1
                if from_calls:
                    name = by_id[tmsg["tool_call_id"]]
                else:
                    name = _opt_str(tmsg, "tool", tw) or _opt_str(tmsg, "name", tw)
                    if not name:
                        if tool_count > len(calls):
                            raise ChatFormatError(
                                f"{tw}.name: a tool message needs its tool's name (name or tool), or an assistant "
                                f"turn before it with a tool call #{tool_count} to take it from")
                        name = calls[tool_count - 1][1]
                body = _content_text(tmsg.get("content"), f"{tw}.content")
                _message(out, body, role="tool", tool=name, index=tool_count)
            i = j
            continue

        name = _opt_str(msg, "name", where) or None
        if role == "assistant":
            _open(out, "message", role="assistant", name=name)
            if thinking:
                reasoning = msg.get("reasoning_content")
                key = "reasoning_content"
                if reasoning is None:
                    reasoning, key = msg.get("reasoning"), "reasoning"
                if reasoning is not None and not isinstance(reasoning, str):
                    raise ChatFormatError(f"{where}.{key}: expected a string, got {type(reasoning).__name__}")
                _open(out, "think")
                _text(out, reasoning or "")
                _close(out, "think")
            _open(out, "response")
            _text(out, _content_text(msg.get("content"), f"{where}.content"))
            _close(out, "response")
            calls = _calls(msg["tool_calls"], f"{where}.tool_calls") if msg.get("tool_calls") else []
            if calls:
                _open(out, "tools")
                for k, (_, cname, args) in enumerate(calls):
                    _render_call(out, k + 1, cname, args, f"{where}.tool_calls[{k}]")
                _close(out, "tools")
            _close(out, "message")
            out.append((END, True))
            tool_count = 0
        else:  # user / system
            body = _content_text(msg.get("content"), f"{where}.content", images=True)
            dynamic = msg.get("tools") if role == "system" else None
            if dynamic:
                if body:
                    _message(out, body, role=role, name=name)
                tools_json = _json_block(_tools_list(dynamic, f"{where}.tools"))
                _message(out, _DYNAMIC_TOOLS_HEADER + tools_json, role="system", type="tool-declare")
            else:
                _message(out, body, role=role, name=name)
        i += 1

    if tool_choice is not None and not isinstance(tool_choice, dict):
        if tool_choice in _TOOL_CHOICE_BODY:
            _message(out, _TOOL_CHOICE_BODY[tool_choice], role="system", type="tool-choice")
        elif tool_choice != "auto":
            raise ChatFormatError(f"tool_choice: expected 'auto', 'required', 'none' or a named function; "
                                  f"got {tool_choice!r}")
    if response_format is not None:
        _response_format(out, response_format)
    if add_generation_prompt:
        _open(out, "message", role="assistant")
        _open(out, "think" if thinking else "response")
    if image_prompts is not None:
        out = _splice_image_prompts(out, list(image_prompts))
    return [(t, s) for t, s in out if t]


def _splice_image_prompts(out: Segments, prompts: list[str]) -> Segments:
    found = sum(t.count(IMAGE_PLACEHOLDER) for t, _ in out)
    if found != len(prompts):
        raise ChatFormatError(f"image_prompts: {len(prompts)} image prompts for {found} image placeholders "
                              f"({IMAGE_PLACEHOLDER} typed in a message counts too)")
    res: Segments = []
    k = 0
    for text, special in out:
        pieces = text.split(IMAGE_PLACEHOLDER)
        for j, piece in enumerate(pieces):
            if j:
                res.append((prompts[k], True))
                k += 1
            res.append((piece, special))
    return res


def _response_format(out: Segments, rf) -> None:
    if not isinstance(rf, dict):
        raise ChatFormatError(f"response_format: expected an object, got {type(rf).__name__}")
    kind = rf.get("type")
    if kind in (None, "text"):
        return
    if kind == "json_object":
        _message(out, _JSON_OBJECT_BODY, role="system", type="response-format")
        return
    if kind != "json_schema":
        raise ChatFormatError(f"response_format.type: expected one of text, json_object, json_schema; got {kind!r}")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise ChatFormatError("response_format.json_schema: expected an object with a 'schema' object")
    name = spec.get("name")
    body = _JSON_SCHEMA_BODY.format(name=f" `{name}`" if isinstance(name, str) and name else "")
    _message(out, body + _json_block(spec.get("schema", {})), role="system", type="response-format")


def render_chat_text(messages, **kw) -> str:
    """The prompt as one string (the segments joined) — for display and comparison, never for tokenizing."""
    return "".join(text for text, _ in render_chat(messages, **kw))


# ---------------------------------------------------------------------------------------------------- encoding
def chat_tokenizer_problem(tokenizer) -> str | None:
    """``None`` when ``tokenizer`` can encode chats (it has an id for every marker in :data:`CHAT_MARKERS`), else
    a sentence saying what is missing."""
    name = getattr(tokenizer, "name", type(tokenizer).__name__)
    if not callable(getattr(tokenizer, "special_id", None)) or not callable(getattr(tokenizer, "encode_ordinary",
                                                                                     None)):
        return f"tokenizer {name} cannot tell special tokens from text (no special_id/encode_ordinary)"
    missing = [m for m in CHAT_MARKERS if tokenizer.special_id(m) is None]
    if not missing:
        return None
    need = "chat needs the release tokenizer (tiktoken.model + tokenizer_config.json)"
    if len(missing) == len(CHAT_MARKERS):
        return f"tokenizer {name} has no chat markers ({', '.join(CHAT_MARKERS)}): {need}"
    return f"tokenizer {name} lacks the chat marker{'s' if len(missing) > 1 else ''} {', '.join(missing)}: {need}"


def encode_chat(tokenizer, messages, **kw) -> list[int]:
    """Token ids of the chat prompt: each :func:`render_chat` segment tokenized on its own — allow_special
    segments as special ids (split on the special tokens they contain; text between them ordinary), the rest with
    ``tokenizer.encode_ordinary``. Raises :class:`ChatFormatError` for an unusable request or a tokenizer without
    the chat markers (:func:`chat_tokenizer_problem`)."""
    problem = chat_tokenizer_problem(tokenizer)
    if problem:
        raise ChatFormatError(problem)
    ids: list[int] = []
    for text, allow_special in render_chat(messages, **kw):
        if not allow_special:
            ids += tokenizer.encode_ordinary(text)
            continue
        for piece in _SPECIAL_SPLIT.split(text):
            if not piece:
                continue
            if _SPECIAL_SPLIT.fullmatch(piece):
                sid = tokenizer.special_id(piece)
                if sid is None:
                    raise ChatFormatError(f"tokenizer {getattr(tokenizer, 'name', '?')} has no special token {piece}")
                ids.append(sid)
            else:
                ids += tokenizer.encode_ordinary(piece)
    return ids


# ---------------------------------------------------------------------------------------------------- parsing


from k3jax.text.chat_reply import AssistantMessage, AssistantStreamParser, parse_assistant  # noqa: E402  (re-exported)
