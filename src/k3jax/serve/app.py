"""The OpenAI-compatible HTTP API over a :class:`~k3jax.infer.scheduler.Scheduler` (FastAPI): the routes.

Endpoints: ``POST /v1/completions`` (prompt as text or token ids), ``POST /v1/chat/completions`` (messages in the
release's chat format, reasoning apart from content, tool calls parsed back), both with ``stream`` (server-sent
events in OpenAI's chunk format, ending ``data: [DONE]``); ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus text format). The bodies are :mod:`k3jax.serve.protocol`, the handlers :mod:`k3jax.serve.openai`.

Bad input → 400 with an OpenAI-style body naming the field; a full queue → 429 with ``Retry-After``; an exception
while serving one request → 500 for that request only. A client that disconnects mid-stream cancels its request
(slot and pages are free at the next step). ``/health`` and ``/metrics`` read the scheduler's published snapshot:
nothing here touches engine state or runs JAX on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import generate_latest

from k3jax.serve.metrics import ServerMetrics
from k3jax.serve.openai import Handlers
from k3jax.serve.protocol import APIError, field_of

log = logging.getLogger("k3jax.serve")


@dataclass
class ServeConfig:
    model_name: str
    max_model_len: int
    default_max_tokens: int = 256
    drain_timeout: float = 10.0
    own_scheduler: bool = True        # closing the app closes the scheduler (False: another app shares it)


def create_app(sched, tokenizer, config: ServeConfig, vision=None):
    """The app serving ``sched`` (already warmed up and started). Closing the app (lifespan end: Ctrl-C, SIGTERM)
    drains running requests for ``config.drain_timeout`` seconds, then cancels the rest. ``vision`` (a
    :class:`~k3jax.serve.images.VisionService`): chat messages may carry ``image_url`` parts (the scheduler's engine
    encodes them)."""
    metrics = ServerMetrics(sched)
    handlers = Handlers(sched, tokenizer, config, vision)
    created = int(time.time())

    def on_finish(req):
        metrics.observe(req)
        ttft = (req.first_token_time - req.arrival) if req.first_token_time else float("nan")
        log.info("%s done: %s, prompt %d tokens (%d cached), generated %d, ttft %.3f s, %.1f s total%s%s", req.id,
                 req.finish_reason, req.prompt_tokens, req.cached_tokens, len(req.tokens), ttft,
                 (req.finish_time or time.perf_counter()) - req.arrival,
                 f", preempted {req.preemptions}×" if req.preemptions else "",
                 f", drafts {req.spec.accepted}/{req.spec.drafted} accepted" if req.spec.drafted else "")

    sched.finish_hooks.append(on_finish)

    @asynccontextmanager
    async def lifespan(app):
        yield
        sched.finish_hooks.remove(on_finish)
        if not config.own_scheduler:
            return
        log.info("shutting down: draining %d running request(s) for up to %.0f s",
                 sched.snapshot().get("slots_in_use", 0), config.drain_timeout)
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
        field = field_of(tuple(err.get("loc", ())))
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

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return handlers.tokenize(await request.body())

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return handlers.detokenize(await request.body())

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return handlers.tokenizer_info()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handlers.completions(await request.body())

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handlers.chat(await request.body())

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
