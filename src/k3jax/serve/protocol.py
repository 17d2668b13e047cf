"""The OpenAI-compatible wire format: request bodies (pydantic, strict types), their mapping onto the engine's
:class:`~k3jax.infer.requests.SamplingParams`, the response and stream-chunk bodies, and :class:`APIError` (an
OpenAI-style ``{"error": {"message", "type", "param", "code"}}`` answer naming the field).

OpenAI's conventions are mapped here, once: ``temperature`` absent = 1; ``top_k`` -1 or 0 = all tokens (vLLM's
extension); ``max_completion_tokens`` over ``max_tokens``; the server's default ``max_tokens``. Every value is
then checked by ``SamplingParams`` itself (one rule per field).
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from k3jax.infer.requests import Request, RequestError, SamplingParams

Number = StrictInt | StrictFloat


class APIError(Exception):
    """An error answered as ``{"error": …}`` with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    @classmethod
    def bad(cls, e: RequestError) -> "APIError":
        return cls(400, str(e), e.field)

    @classmethod
    def internal(cls, error: str | None) -> "APIError":
        return cls(500, f"internal error while generating: {error}", None, "internal_server_error")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class CommonBody(BaseModel):
    """Fields both endpoints share (OpenAI's names; ``top_k``, ``stop_token_ids``, ``ignore_eos`` as in vLLM)."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    user: StrictStr | None = None
    return_token_ids: StrictBool = False      # k3jax/vLLM extension: the generated ids beside the text
    speculative: StrictBool = True            # k3jax extension: false = plain decode when the server speculates
    prediction: dict[str, Any] | None = None  # OpenAI's predicted output {"type": "content", "content": …}

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionBody(CommonBody):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = None


class ChatBody(CommonBody):
    messages: list[dict[str, Any]]
    max_completion_tokens: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    reasoning_effort: Literal["none", "low", "high", "max"] | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: StrictBool | None = None


class TokenizeBody(BaseModel):
    """``POST /tokenize`` (vLLM's): a ``prompt`` (with BOS when ``add_special_tokens``, as ``/v1/completions``
    encodes it) or chat ``messages`` (+ ``tools``), rendered as ``/v1/chat/completions`` renders them."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeBody(BaseModel):
    """``POST /detokenize`` (vLLM's): token ids → text."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    tokens: list[StrictInt]


def field_of(loc: tuple) -> str:
    """A pydantic error location as the user wrote the field (``messages[0].role``)."""
    parts = [str(p) for p in loc if p not in ("body",)]
    # drop pydantic's union-member tags ("str", "list[int]", …) so the field reads as the user wrote it
    parts = [p for p in parts if not (p.startswith(("list[", "dict[")) or p in ("str", "int", "float", "bool"))]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


def parse_body(cls, raw: bytes):
    """A request body of ``cls`` from raw JSON, or a 400 naming the field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}", "body") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(data).__name__}", "body")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        errs = e.errors()
        field = field_of(tuple(errs[0]["loc"]))
        msgs = list(dict.fromkeys(x["msg"] for x in errs if field_of(tuple(x["loc"])) == field))
        got = "nothing" if errs[0]["type"] == "missing" else json.dumps(errs[0].get("input"))[:80]
        raise APIError(400, f"{field}: {' or '.join(msgs)} (got {got})", field) from None


def sampling_params(body: CommonBody, max_tokens: int | None, default_max_tokens: int,
                    extra_stops: tuple[int, ...] = ()) -> SamplingParams:
    """The request's :class:`SamplingParams` (OpenAI's conventions mapped; bad values → 400 naming the field)."""
    if body.n != 1:
        raise APIError(400, f"n: only n=1 is supported, got {body.n}", "n")
    top_k = None if body.top_k in (-1, 0) else body.top_k
    try:
        return SamplingParams(max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                              temperature=1.0 if body.temperature is None else body.temperature, top_k=top_k,
                              top_p=body.top_p, seed=body.seed,
                              stop_token_ids=tuple(body.stop_token_ids or ()) + tuple(extra_stops),
                              ignore_eos=body.ignore_eos)
    except RequestError as e:
        raise APIError.bad(e) from None


def prediction_ids(body: CommonBody, tokenizer) -> list[int]:
    """The token ids of a predicted output (text, text parts, or — a k3jax extension — token ids)."""
    pred = body.prediction
    if pred is None:
        return []
    content = pred.get("content")
    if pred.get("type") != "content" or content is None:
        raise APIError(400, 'prediction: expected {"type": "content", "content": text or text parts}', "prediction")
    if isinstance(content, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in content):
        return list(content)
    if isinstance(content, list) and all(isinstance(x, dict) and x.get("type") == "text"
                                         and isinstance(x.get("text"), str) for x in content):
        content = "".join(x["text"] for x in content)
    if not isinstance(content, str):
        raise APIError(400, "prediction.content: expected text, a list of text parts or a list of token ids",
                       "prediction")
    return tokenizer.encode(content)


def usage(req: Request) -> dict:
    n = len(req.tokens)
    return {"prompt_tokens": req.prompt_tokens, "completion_tokens": n, "total_tokens": req.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens}}


def sse(obj) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class Envelope:
    """The ``id``/``object``/``created``/``model`` head every body of one response shares."""

    def __init__(self, rid: str, obj: str, model: str):
        self.rid, self.obj, self.model = rid, obj, model

    def __call__(self, choices: list, **more) -> dict:
        return {"id": self.rid, "object": self.obj, "created": int(time.time()), "model": self.model,
                "choices": choices, **more}


__all__ = ["APIError", "CommonBody", "CompletionBody", "ChatBody", "StreamOptions", "field_of", "parse_body",
           "sampling_params", "prediction_ids", "usage", "sse", "SSE_DONE", "Envelope"]
