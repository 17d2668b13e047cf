"""The completions and chat handlers over one stream pipeline.

A handler turns the body into token ids and :class:`~k3jax.infer.requests.SamplingParams`, submits them
(:class:`Generation`: the request seen from the event loop — its events through an ``asyncio.Queue`` the scheduler
thread feeds, cancelled when the consumer stops early), and answers from :func:`text_deltas`: generated ids →
text (:class:`~k3jax.text.stream.TextStream`: incremental detokenization, stop tokens silent, stop strings cut and
— on a hit — the request cancelled at once with reason ``stop``). The chat handler puts the release's reply parser
on top (reasoning apart from content, tool calls parsed back). Both answer whole or as server-sent events in
OpenAI's chunk format; an error while generating is a 500 (whole) or an error event (streamed).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi.responses import StreamingResponse

from k3jax.infer.requests import QueueFull, Request, RequestError, TokenEvent
from k3jax.serve.protocol import (SSE_DONE, APIError, ChatBody, CommonBody, CompletionBody, DetokenizeBody, Envelope,
                                  TokenizeBody, parse_body, prediction_ids, sampling_params, sse, usage)
from k3jax.text.chat import AssistantStreamParser, ChatFormatError, encode_chat
from k3jax.text.stream import TextStream


class EventStream(StreamingResponse):
    """A streamed response that always closes its body (so the request behind it is cancelled the moment the client
    goes away, not when the abandoned generator is collected): the body runs beside a watch for the client's
    disconnect, and whichever ends first ends the other."""

    async def __call__(self, scope, receive, send) -> None:
        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass

        streaming = asyncio.ensure_future(self.stream_response(send))
        waiting = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({streaming, waiting}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (streaming, waiting):
                t.cancel()
            await asyncio.gather(streaming, waiting, return_exceptions=True)
            await self.body_iterator.aclose()
        if streaming.done() and not streaming.cancelled() and streaming.exception() is not None:
            if not isinstance(streaming.exception(), OSError):
                raise streaming.exception()


class Generation:
    """One submitted request from the event loop's side: ``async for ev in gen`` yields its events; leaving early
    (the client went away, a stop string) cancels it. ``close()`` is idempotent."""

    def __init__(self, sched, req: Request, queue: asyncio.Queue):
        self.sched, self.req, self.queue = sched, req, queue
        self.done = False

    @classmethod
    def submit(cls, sched, ids: list[int], params, **kw) -> "Generation":
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[TokenEvent] = asyncio.Queue()
        try:
            req = sched.submit(ids, params, callback=lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev),
                               request_id=f"req-{uuid.uuid4().hex[:12]}", **kw)
        except RequestError as e:
            raise APIError.bad(e) from None
        except QueueFull as e:
            raise APIError(429, str(e), None, "rate_limit_error",
                           headers={"Retry-After": str(max(1, int(round(e.retry_after))))}) from None
        return cls(sched, req, q)

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        while not self.done:
            ev = await self.queue.get()
            self.done = ev.finished
            yield ev

    def close(self, reason: str = "abort") -> None:
        """Cancel the request unless it already finished (its slot and pages are free at the next step)."""
        if not self.done:
            self.done = True
            self.sched.cancel(self.req, reason)


@dataclass
class Delta:
    """A piece of the answer: ``text``, the generated ``ids`` since the last delta, and at the end ``final`` (the
    request's last event; a stop-string hit reads as ``stop``)."""

    text: str
    ids: list[int]
    final: TokenEvent | None = None


async def text_deltas(gen: Generation, tokenizer, stops: list[str]) -> AsyncIterator[Delta]:
    """The request's answer as text deltas (see the module docstring); closes ``gen`` however it ends."""
    stream, ids = TextStream(tokenizer, stops, skip=gen.req.stops), []
    try:
        async for ev in gen:
            ids += ev.tokens
            text = stream.push(ev.tokens)
            if stream.hit:
                gen.close("stop")
                yield Delta(text, ids, TokenEvent(ev.request_id, [], True, "stop"))
                return
            if ev.finished:
                yield Delta(text + stream.finish(), ids, ev)
                return
            if text:
                yield Delta(text, ids)
                ids = []
    finally:
        gen.close()


class Handlers:
    """``/v1/completions`` and ``/v1/chat/completions`` over a scheduler (see the module docstring). ``vision``: a
    :class:`~k3jax.serve.images.VisionService` (chat image parts), or None."""

    def __init__(self, sched, tokenizer, config, vision=None):
        from k3jax.text.chat import chat_tokenizer_problem

        self.sched, self.tok, self.config, self.vision = sched, tokenizer, config, vision
        self.chat_problem = chat_tokenizer_problem(tokenizer)
        eom = tokenizer.special_id("<|end_of_msg|>") if hasattr(tokenizer, "special_id") else None
        self.chat_stops = (eom,) if eom is not None else ()

    def _check_model(self, body: CommonBody) -> None:
        if body.model is not None and body.model != self.config.model_name:
            raise APIError(400, f"model: unknown model {body.model!r}; this server serves {self.config.model_name!r}",
                           "model", "model_not_found")

    def _submit(self, body: CommonBody, ids: list[int], params, **kw) -> Generation:
        return Generation.submit(self.sched, ids, params, use_speculative=body.speculative,
                                 prediction=prediction_ids(body, self.tok), **kw)

    # ------------------------------------------------------------------------------------------ tokenizer
    def tokenize(self, raw: bytes) -> dict:
        """``POST /tokenize``: ``{count, max_model_len, tokens, token_strs}`` for a prompt or chat messages."""
        body = parse_body(TokenizeBody, raw)
        self._check_model(body)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt and messages", "prompt")
        if body.prompt is not None:
            bos = [self.tok.bos_id] if body.add_special_tokens and self.tok.bos_id is not None else []
            ids = bos + self.tok.encode(body.prompt)
        else:
            if self.chat_problem is not None:
                raise APIError(400, f"messages: this model cannot chat: {self.chat_problem}", "messages")
            try:
                ids = encode_chat(self.tok, body.messages, tools=body.tools)
            except ChatFormatError as e:
                raise APIError(400, str(e), str(e).split(":", 1)[0]) from None
        strs = [self.tok.decode([i]) for i in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(self, raw: bytes) -> dict:
        """``POST /detokenize``: ``{prompt}``, the text of ``tokens``; an id outside the vocabulary is a 400."""
        body = parse_body(DetokenizeBody, raw)
        self._check_model(body)
        V = self.tok.vocab_size
        for i, t in enumerate(body.tokens):
            if not 0 <= t < V:
                raise APIError(400, f"tokens[{i}]: id {t} is outside the vocabulary [0, {V})", f"tokens[{i}]")
        return {"prompt": self.tok.decode(body.tokens)}

    def tokenizer_info(self) -> dict:
        """``GET /tokenizer_info``: what a harness with a remote tokenizer needs (special tokens, vocabulary size,
        whether chat messages are accepted)."""
        def text(i):
            return None if i is None else self.tok.decode([i])

        t = self.tok
        return {"tokenizer_class": type(t).__name__, "name": getattr(t, "name", None), "vocab_size": t.vocab_size,
                "bos_token": text(t.bos_id), "bos_token_id": t.bos_id, "eos_token": text(t.eos_id),
                "eos_token_id": t.eos_id, "pad_token": text(t.pad_id), "pad_token_id": t.pad_id,
                "chat_template": "k3 (k3jax.text.chat)" if self.chat_problem is None else None,
                "max_model_len": self.config.max_model_len}

    # ------------------------------------------------------------------------------------------ completions
    def completion_ids(self, body: CompletionBody) -> list[int]:
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
            return ([self.tok.bos_id] if self.tok.bos_id is not None else []) + self.tok.encode(prompt)
        return list(prompt)

    async def completions(self, raw: bytes):
        body = parse_body(CompletionBody, raw)
        self._check_model(body)
        ids = self.completion_ids(body)
        params = sampling_params(body, body.max_tokens, self.config.default_max_tokens)
        gen = self._submit(body, ids, params)
        env = Envelope(f"cmpl-{gen.req.id[4:]}", "text_completion", self.config.model_name)

        def choice(d: Delta) -> dict:
            out = {"index": 0, "text": d.text, "logprobs": None,
                   "finish_reason": d.final.finish_reason if d.final else None}
            if body.return_token_ids:
                out["token_ids"] = d.ids
            return out

        deltas = text_deltas(gen, self.tok, body.stops)
        if body.stream:
            return self._stream(gen, env, deltas, lambda d: [env([choice(d)])], body.include_usage)
        parts, ids_out, last = [], [], None
        async for d in deltas:
            parts.append(d.text)
            ids_out += d.ids
            last = d.final
        if last.finish_reason == "error":
            raise APIError.internal(last.error)
        ch = choice(Delta("".join(parts), ids_out, last))
        if body.return_token_ids:
            ch["prompt_token_ids"] = gen.req.prompt
        return env([ch], usage=usage(gen.req))

    # ------------------------------------------------------------------------------------------------- chat
    def chat_settings(self, body: ChatBody) -> tuple[bool, str | None]:
        """``(thinking, effort)`` from ``reasoning_effort`` and ``chat_template_kwargs``."""
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
        return thinking, ("max" if effort == "default" else effort) if thinking else None   # release default: max

    async def chat_images(self, messages) -> list:
        """The request's images, fetched and processed off the event loop (no JAX: the engine encodes them)."""
        from k3jax.serve.images import image_parts, load_request_images
        from k3jax.vision.processor import ImageError

        parts = image_parts(messages)
        if not parts:
            return []
        if self.vision is None:
            raise APIError(400, f"{parts[0][0]}: this server has no vision tower (serve a checkpoint with a "
                                f"vision_config to send images)", parts[0][0])
        try:
            return await asyncio.to_thread(load_request_images, messages, self.vision)
        except ImageError as e:
            raise APIError(400, str(e), str(e).split(":", 1)[0]) from None

    async def chat(self, raw: bytes):
        body = parse_body(ChatBody, raw)
        self._check_model(body)
        if self.chat_problem is not None:
            raise APIError(400, f"messages: this model cannot chat: {self.chat_problem}; use /v1/completions",
                           "messages")
        if body.logprobs:
            raise APIError(400, "logprobs: not supported", "logprobs")
        thinking, effort = self.chat_settings(body)
        images = await self.chat_images(body.messages)
        try:
            ids = encode_chat(self.tok, body.messages, tools=body.tools, thinking=thinking, thinking_effort=effort,
                              tool_choice=body.tool_choice, response_format=body.response_format,
                              image_prompts=[im.prompt() for im in images] if images else None)
        except ChatFormatError as e:
            raise APIError(400, str(e), str(e).split(":", 1)[0]) from None
        params = sampling_params(body, body.max_completion_tokens or body.max_tokens, self.config.default_max_tokens,
                                 self.chat_stops)
        gen = self._submit(body, ids, params, images=images or None)
        env = Envelope(f"chatcmpl-{gen.req.id[4:]}", "chat.completion.chunk", self.config.model_name)
        replies = chat_replies(text_deltas(gen, self.tok, body.stops), thinking)
        if body.stream:
            return self._stream(gen, env, replies, chat_chunks(env), body.include_usage,
                                first=env([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]))
        async for _, final, msg in replies:
            if final is not None:
                break
        if final.finish_reason == "error":
            raise APIError.internal(final.error)
        message = {"role": "assistant", "content": msg.content}
        if msg.reasoning is not None:
            message["reasoning_content"] = msg.reasoning
        if msg.tool_calls:
            message["tool_calls"] = msg.tool_calls
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": chat_finish(final, msg)}
        if body.return_token_ids:
            choice["token_ids"], choice["prompt_token_ids"] = list(gen.req.tokens), gen.req.prompt
        env.obj = "chat.completion"
        return env([choice], usage=usage(gen.req))

    # ------------------------------------------------------------------------------------------------ streams
    def _stream(self, gen: Generation, env: Envelope, items, chunks, include_usage: bool, first: dict | None = None):
        """The SSE body: ``first``, ``chunks(item)`` per item, an error event if generating failed, the usage chunk
        when asked, ``[DONE]``."""
        async def body():
            try:
                if first is not None:
                    yield sse(first)
                async for item in items:
                    final = item.final if isinstance(item, Delta) else item[1]
                    if final is not None and final.finish_reason == "error":
                        yield sse(APIError.internal(final.error).body())
                        break
                    for c in chunks(item):
                        yield sse(c)
                if include_usage:
                    yield sse(env([], usage=usage(gen.req)))
                yield SSE_DONE
            finally:
                await items.aclose()
                gen.close()

        return EventStream(body(), media_type="text/event-stream")


async def chat_replies(deltas: AsyncIterator[Delta], thinking: bool):
    """``(deltas [(kind, text)], final event or None, parsed message at the end)`` from the text deltas."""
    parser = AssistantStreamParser(thinking)
    try:
        async for d in deltas:
            out = parser.feed(d.text) if d.text else []
            if d.final is not None:
                msg = parser.finish()
                yield out + parser.finish_deltas, d.final, msg
                return
            if out:
                yield out, None, None
    finally:
        await deltas.aclose()


def chat_finish(final: TokenEvent, msg) -> str:
    return "tool_calls" if (msg is not None and msg.tool_calls and final.finish_reason == "stop") \
        else final.finish_reason


def chat_chunks(env: Envelope):
    """Stream chunks of one chat reply item: a chunk per delta, then the tool calls and the finish reason."""
    def chunk(delta: dict, finish: str | None) -> dict:
        return env([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}])

    def make(item) -> list[dict]:
        deltas, final, msg = item
        out = [chunk({"reasoning_content" if kind == "reasoning" else "content": text}, None) for kind, text in deltas]
        if final is not None:
            if msg.tool_calls:
                out.append(chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(msg.tool_calls)]}, None))
            out.append(chunk({}, chat_finish(final, msg)))
        return out

    return make


__all__ = ["Handlers", "Generation", "Delta", "EventStream", "text_deltas", "chat_replies"]
