"""The OpenAI-compatible HTTP API over a :class:`~k3jax.infer.scheduler.Scheduler` (FastAPI).

Endpoints: ``POST /v1/completions`` (prompt as text or token ids), ``POST /v1/chat/completions`` (messages in the
release's chat format, reasoning apart from content, tool calls parsed back), both with ``stream`` (server-sent
events in OpenAI's chunk format, ending ``data: [DONE]``); ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus text format).

Bad input → 400 with an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}`` naming the field; a
full queue → 429 with ``Retry-After``; an exception while serving one request → 500 for that request only. A client
that disconnects mid-stream cancels its request (slot and pages are free at the next step).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from k3jax.infer.scheduler import QueueFull, RequestError, SamplingParams, Scheduler, TokenEvent
from k3jax.serve.metrics import ServerMetrics
from k3jax.vision.model import PromptError, splice_prompt
from k3jax.text.chat import ChatFormatError, AssistantStreamParser, chat_tokenizer_problem, encode_chat

log = logging.getLogger("k3jax.serve")

Number = StrictInt | StrictFloat


class APIError(Exception):
    """An error answered as ``{"error": …}`` with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.status}}, status_code=self.status, headers=self.headers)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class _Common(BaseModel):
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


class CompletionBody(_Common):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = None


class ChatBody(_Common):
    messages: list[dict[str, Any]]
    max_completion_tokens: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    reasoning_effort: Literal["none", "low", "high", "max"] | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: StrictBool | None = None


def _field_of(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    # drop pydantic's union-member tags ("str", "list[int]", …) so the field reads as the user wrote it
    parts = [p for p in parts if not (p.startswith(("list[", "dict[")) or p in ("str", "int", "float", "bool"))]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


def _parse(cls, raw: bytes):
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
        field = _field_of(tuple(errs[0]["loc"]))
        msgs = list(dict.fromkeys(x["msg"] for x in errs if _field_of(tuple(x["loc"])) == field))
        given = errs[0].get("input")
        got = "nothing" if errs[0]["type"] == "missing" else json.dumps(given)[:80]
        raise APIError(400, f"{field}: {' or '.join(msgs)} (got {got})", field) from None


@dataclass
class ServeConfig:
    model_name: str
    max_model_len: int
    default_max_tokens: int = 256
    drain_timeout: float = 10.0
    own_scheduler: bool = True        # closing the app closes the scheduler (False: another app shares it)


class _TextDecoder:
    """Incremental detokenisation in O(new tokens): each push decodes only a short window — the ids after the last
    emitted boundary (``prefix``) — and emits what that window adds past the text already sent; an unfinished UTF-8
    sequence (a trailing U+FFFD) is held back until its bytes arrive."""

    def __init__(self, tokenizer):
        self.tok, self.ids = tokenizer, []
        self.prefix = self.read = 0          # ids[prefix:read] were emitted; their text is the window's start

    def push(self, ids: list[int], final: bool = False) -> str:
        self.ids.extend(ids)
        text = self.tok.decode(self.ids[self.prefix:])
        if text.endswith("\ufffd") and not final:
            return ""
        done = self.tok.decode(self.ids[self.prefix:self.read])
        delta = text[len(done):]
        self.prefix, self.read = self.read, len(self.ids)
        return delta

    def flush(self) -> str:
        return self.push([], final=True)


class _StopText:
    """Stop strings over streamed text: returns what may be sent now (holding back a possible stop prefix) and
    whether a stop string was hit (the text is cut before it)."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buf = ""
        self.hit = False

    def push(self, text: str, final: bool = False) -> str:
        self.buf += text
        if self.stops:
            cut = min((i for i in (self.buf.find(s) for s in self.stops) if i >= 0), default=-1)
            if cut >= 0:
                out, self.buf, self.hit = self.buf[:cut], "", True
                return out
        if final or not self.stops:
            out, self.buf = self.buf, ""
            return out
        keep = self.hold
        out, self.buf = (self.buf[:-keep], self.buf[-keep:]) if keep and len(self.buf) > keep else \
            (("", self.buf) if keep else (self.buf, ""))
        return out


def create_app(sched: Scheduler, tokenizer, config: ServeConfig, vision=None):
    """The FastAPI app serving ``sched`` (already warmed up and started). Closing the app (lifespan end: Ctrl-C,
    SIGTERM) drains running requests for ``config.drain_timeout`` seconds, then cancels the rest. ``vision`` (a
    :class:`~k3jax.serve.images.VisionService`): chat messages may carry ``image_url`` parts."""
    metrics = ServerMetrics(sched)
    chat_problem = chat_tokenizer_problem(tokenizer)
    end_of_msg = tokenizer.special_id("<|end_of_msg|>") if hasattr(tokenizer, "special_id") else None
    created = int(time.time())

    def on_finish(req):
        metrics.observe(req)
        ttft = (req.first_token_time - req.arrival) if req.first_token_time else float("nan")
        log.info("%s done: %s, prompt %d tokens (%d cached), generated %d, ttft %.3f s, %.1f s total%s%s", req.id,
                 req.finish_reason, req.prompt_tokens, req.cached_tokens, len(req.tokens), ttft,
                 (req.finish_time or time.perf_counter()) - req.arrival,
                 f", preempted {req.preemptions}×" if req.preemptions else "",
                 f", drafts {req.spec_accepted}/{req.spec_drafted} accepted" if req.spec_drafted else "")

    sched.finish_hooks.append(on_finish)

    @asynccontextmanager
    async def lifespan(app):
        yield
        sched.finish_hooks.remove(on_finish)
        if not config.own_scheduler:
            return
        log.info("shutting down: draining %d running request(s) for up to %.0f s",
                 sched.snapshot()["slots_in_use"], config.drain_timeout)
        await asyncio.to_thread(sched.close, config.drain_timeout)

    app = FastAPI(title="k3jax", lifespan=lifespan)
    app.state.scheduler, app.state.metrics, app.state.config = sched, metrics, config

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_server_error").response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        err = exc.errors()[0]
        field = _field_of(tuple(err.get("loc", ())))
        return APIError(400, f"{field}: {err.get('msg')}", field).response()

    @app.get("/health")
    async def health():
        s = sched.snapshot()
        return {"status": "ok", "model": config.model_name, "slots_in_use": s["slots_in_use"],
                "queue_length": s["queue_length"]}

    @app.get("/metrics")
    async def prom():
        return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": created,
                                            "owned_by": "k3jax", "max_model_len": config.max_model_len}]}

    def sampling(body: _Common, max_tokens: int | None, extra_stops: tuple[int, ...] = ()) -> SamplingParams:
        if body.model is not None and body.model != config.model_name:
            raise APIError(400, f"model: unknown model {body.model!r}; this server serves {config.model_name!r}",
                           "model", "model_not_found")
        if body.n != 1:
            raise APIError(400, f"n: only n=1 is supported, got {body.n}", "n")
        if max_tokens is None:
            max_tokens = config.default_max_tokens
        top_k = body.top_k
        if top_k is not None and top_k < -1:
            raise APIError(400, f"top_k: expected -1 or 0 (all) or a positive integer, got {top_k}", "top_k")
        temperature = 1.0 if body.temperature is None else float(body.temperature)
        if temperature > 100:
            raise APIError(400, f"temperature: expected a number in [0, 100], got {temperature}", "temperature")
        for t in body.stop_token_ids or ():
            if not 0 <= t < sched.cfg.vocab_size:
                raise APIError(400, f"stop_token_ids: {t} is outside [0, {sched.cfg.vocab_size})", "stop_token_ids")
        p = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                           top_k=None if top_k in (None, -1, 0) else top_k,
                           top_p=None if body.top_p is None else float(body.top_p), seed=body.seed,
                           stop_token_ids=tuple(body.stop_token_ids or ()) + tuple(extra_stops),
                           ignore_eos=body.ignore_eos)
        try:
            p.check()
        except RequestError as e:
            raise APIError(400, str(e), e.field) from None
        return p

    def prediction_ids(body: _Common) -> list[int]:
        """The token ids of a predicted output (text, text parts, or — a k3jax extension — token ids)."""
        pred = body.prediction
        if pred is None:
            return []
        content = pred.get("content")
        if pred.get("type") != "content" or content is None:
            raise APIError(400, 'prediction: expected {"type": "content", "content": text or text parts}',
                           "prediction")
        if isinstance(content, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in content):
            return list(content)
        if isinstance(content, list) and all(isinstance(x, dict) and x.get("type") == "text"
                                             and isinstance(x.get("text"), str) for x in content):
            content = "".join(x["text"] for x in content)
        if not isinstance(content, str):
            raise APIError(400, "prediction.content: expected text, a list of text parts or a list of token ids",
                           "prediction")
        return tokenizer.encode(content)

    def stops_of(body: _Common) -> list[str]:
        return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])

    async def run(ids: list[int], params: SamplingParams, body: _Common, embeds=None) -> tuple[Any, asyncio.Queue]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def cb(ev: TokenEvent) -> None:
            loop.call_soon_threadsafe(q.put_nowait, ev)

        try:
            req = sched.submit(ids, params, callback=cb, request_id=f"req-{uuid.uuid4().hex[:12]}",
                               use_speculative=body.speculative, prediction=prediction_ids(body), embeds=embeds)
        except RequestError as e:
            raise APIError(400, str(e), e.field) from None
        except QueueFull as e:
            raise APIError(429, str(e), None, "rate_limit_error",
                           headers={"Retry-After": str(max(1, int(round(e.retry_after))))}) from None
        return req, q

    async def events(req, q) -> AsyncIterator[TokenEvent]:
        """The request's events; cancels it if the consumer goes away (client disconnect) before the end."""
        done = False
        try:
            while True:
                ev = await q.get()
                yield ev
                if ev.finished:
                    done = True
                    return
        finally:
            if not done:
                sched.cancel(req)

    def usage(req, n_out: int) -> dict:
        return {"prompt_tokens": req.prompt_tokens, "completion_tokens": n_out,
                "total_tokens": req.prompt_tokens + n_out,
                "prompt_tokens_details": {"cached_tokens": req.cached_tokens}}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def error_body(ev: TokenEvent) -> dict:
        return {"error": {"message": f"internal error while generating: {ev.error}", "type": "internal_server_error",
                          "param": None, "code": 500}}

    # ------------------------------------------------------------------------------------------ completions
    @app.post("/v1/completions")
    async def completions(request: Request):
        body = _parse(CompletionBody, await request.body())
        if body.echo:
            raise APIError(400, "echo: not supported", "echo")
        if body.logprobs is not None:
            raise APIError(400, "logprobs: not supported", "logprobs")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"prompt: one prompt per request is supported, got a batch of {len(prompt)}",
                               "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "prompt: empty", "prompt")
            bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
            ids = bos + tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        params = sampling(body, body.max_tokens)
        req, q = await run(ids, params, body)
        rid, model = f"cmpl-{req.id[4:]}", config.model_name

        def chunk(text: str, finish: str | None, ids: list[int] | None = None) -> dict:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            if body.return_token_ids and ids is not None:
                choice["token_ids"] = ids
            return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                    "choices": [choice]}

        stops = stops_of(body)

        async def gen_text() -> AsyncIterator[tuple[str, TokenEvent, list[int]]]:
            """(text delta, event, generated ids since the last delta)."""
            dec, st, ids = _TextDecoder(tokenizer), _StopText(stops), []
            async for ev in events(req, q):
                ids += ev.tokens
                toks = [t for t in ev.tokens if t not in req.stops]
                text = st.push(dec.push(toks), final=False) if toks else ""
                if st.hit:
                    yield text, TokenEvent(ev.request_id, [], True, "stop"), ids
                    return
                if ev.finished:
                    text += st.push(dec.flush(), final=True)
                    yield text, ev, ids
                    return
                if text:
                    yield text, ev, ids
                    ids = []

        if not body.stream:
            parts, last, all_ids = [], None, []
            async for text, ev, ids in gen_text():
                parts.append(text)
                all_ids += ids
                last = ev
            if last.finish_reason == "error":
                raise APIError(500, f"internal error while generating: {last.error}", None, "internal_server_error")
            out = chunk("".join(parts), last.finish_reason, all_ids)
            if body.return_token_ids:
                out["choices"][0]["prompt_token_ids"] = req.prompt
            return {**out, "usage": usage(req, len(req.tokens))}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def stream():
            async for text, ev, ids in gen_text():
                if ev.finished and ev.finish_reason == "error":
                    yield sse(error_body(ev))
                    break
                yield sse(chunk(text, ev.finish_reason if ev.finished else None, ids))
            if include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                           "choices": [], "usage": usage(req, len(req.tokens))})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    # ------------------------------------------------------------------------------------------------- chat
    async def chat_images(messages) -> list:
        """The request's images, processed (in order); 400 naming the content part when one is unusable."""
        from k3jax.serve.images import image_parts, load_request_images
        from k3jax.vision.processor import ImageError

        parts = image_parts(messages)
        if not parts:
            return []
        if vision is None:
            raise APIError(400, f"{parts[0][0]}: this server has no vision tower (serve a checkpoint with a "
                                f"vision_config to send images)", parts[0][0])
        try:
            return await asyncio.to_thread(load_request_images, messages, vision)
        except ImageError as e:
            raise APIError(400, str(e), str(e).split(":", 1)[0]) from None

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = _parse(ChatBody, await request.body())
        if chat_problem is not None:
            raise APIError(400, f"messages: this model cannot chat: {chat_problem}; use /v1/completions", "messages")
        if body.logprobs:
            raise APIError(400, "logprobs: not supported", "logprobs")
        kw = dict(body.chat_template_kwargs or {})
        thinking = kw.pop("thinking", None)
        effort = kw.pop("thinking_effort", "default")           # an explicit null: no effort message
        if body.reasoning_effort == "none":
            thinking = False if thinking is None else thinking
        elif body.reasoning_effort is not None:
            effort = body.reasoning_effort
        thinking = True if thinking is None else thinking
        if not isinstance(thinking, bool):
            raise APIError(400, "chat_template_kwargs.thinking: expected true or false", "chat_template_kwargs")
        if kw:
            raise APIError(400, f"chat_template_kwargs: unknown key(s) {sorted(kw)}; known: thinking, "
                                f"thinking_effort", "chat_template_kwargs")
        if effort == "default":
            effort = "max"                                      # the release's default (K3_CHAT §4)
        images = await chat_images(body.messages)
        try:
            ids = encode_chat(tokenizer, body.messages, tools=body.tools, thinking=thinking,
                              thinking_effort=effort if thinking else None, tool_choice=body.tool_choice,
                              response_format=body.response_format,
                              image_prompts=[im.prompt() for im in images] if images else None)
        except ChatFormatError as e:
            field = str(e).split(":", 1)[0]
            raise APIError(400, str(e), field) from None
        embeds = None
        if images:
            feats = await asyncio.to_thread(vision.encode, images)
            try:
                embeds = splice_prompt(ids, feats, vision.pad_id, [im.digest for im in images])
            except PromptError as e:
                raise APIError(400, f"messages: {e}", "messages") from None
        extra = (end_of_msg,) if end_of_msg is not None else ()
        params = sampling(body, body.max_completion_tokens or body.max_tokens, extra)
        req, q = await run(ids, params, body, embeds)
        rid, model = f"chatcmpl-{req.id[4:]}", config.model_name
        stops = stops_of(body)

        def chunk(delta: dict, finish: str | None) -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        async def gen_deltas() -> AsyncIterator[tuple[list, TokenEvent | None, Any]]:
            """(deltas [(kind, text)], final event or None, parsed message at the end)."""
            dec, st, parser = _TextDecoder(tokenizer), _StopText(stops), AssistantStreamParser(thinking)
            async for ev in events(req, q):
                toks = [t for t in ev.tokens if t not in req.stops]
                text = st.push(dec.push(toks)) if toks else ""
                final = ev.finished or st.hit
                if ev.finished and not st.hit:
                    text += st.push(dec.flush(), final=True)
                deltas = parser.feed(text) if text else []
                if final:
                    msg = parser.finish()
                    deltas += parser.finish_deltas
                    fin = TokenEvent(ev.request_id, [], True, "stop") if st.hit else ev
                    yield deltas, fin, msg
                    return
                if deltas:
                    yield deltas, None, None

        def finish_reason(ev: TokenEvent, msg) -> str:
            return "tool_calls" if (msg is not None and msg.tool_calls and ev.finish_reason == "stop") \
                else ev.finish_reason

        if not body.stream:
            async for _, ev, msg in gen_deltas():
                if ev is not None:
                    break
            if ev.finish_reason == "error":
                raise APIError(500, f"internal error while generating: {ev.error}", None, "internal_server_error")
            message = {"role": "assistant", "content": msg.content}
            if msg.reasoning is not None:
                message["reasoning_content"] = msg.reasoning
            if msg.tool_calls:
                message["tool_calls"] = msg.tool_calls
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason(ev, msg)}
            if body.return_token_ids:
                choice["token_ids"], choice["prompt_token_ids"] = list(req.tokens), req.prompt
            return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                    "choices": [choice], "usage": usage(req, len(req.tokens))}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def stream():
            yield sse(chunk({"role": "assistant", "content": ""}, None))
            async for deltas, ev, msg in gen_deltas():
                for kind, text in deltas:
                    yield sse(chunk({"reasoning_content" if kind == "reasoning" else "content": text}, None))
                if ev is not None:
                    if ev.finish_reason == "error":
                        yield sse(error_body(ev))
                        break
                    if msg.tool_calls:
                        yield sse(chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(msg.tool_calls)]},
                                        None))
                    yield sse(chunk({}, finish_reason(ev, msg)))
            if include_usage:
                yield sse({"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                           "choices": [], "usage": usage(req, len(req.tokens))})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return _RequestLog(app, metrics)


class _RequestLog:
    """ASGI wrapper: one log line per HTTP request (method, path, status, seconds), ``k3jax_requests_total`` by
    endpoint and status, and a 500 body for an exception before the response started (the server goes on)."""

    def __init__(self, app: FastAPI, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics
        self.state = app.state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), [None]

        async def send_(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_)
        except Exception as e:  # noqa: BLE001 - one failing request answers 500, the others go on
            log.exception("%s %s failed", scope["method"], scope["path"])
            if status[0] is None:
                await APIError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_server_error"
                               ).response()(scope, receive, send_)
        finally:
            path = scope["path"]
            if path.startswith("/v1/"):
                self.metrics.requests.labels(path, str(status[0] or 500)).inc()
            if path not in ("/metrics", "/health"):
                log.info("%s %s %s %.3f s", scope["method"], path, status[0], time.perf_counter() - t0)


__all__ = ["create_app", "ServeConfig", "ServerMetrics", "APIError"]
