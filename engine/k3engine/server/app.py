"""The HTTP face of `k3 serve` (FastAPI on uvicorn).

Every route is async and never touches the engine: it validates, submits a job to the
engine thread, and awaits what the job posts on an asyncio queue (the engine thread hands
items over with call_soon_threadsafe, so the event loop never blocks on a generation).

Disconnects: a streaming client that goes away makes Starlette cancel the response's
generator; its `finally` withdraws the job, so the engine stops at its next safe point.  A
non-streaming client is watched with `request.is_disconnected()` while it waits.
"""
from __future__ import annotations

import asyncio
import hmac
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .engine import Delta, Done, EngineThread, Fail, Job, QueueFull, Started
from .protocol import (ApiError, Limits, chat_body, chat_chunk, completion_body, new_id, now,
                       parse_chat, parse_completion, parse_json, sse, too_large, usage_chunk)

POLL_S = 0.25                   # how often a waiting non-stream request checks its client


def create_app(engine: EngineThread, model_id: str, api_key: str | None,
               limits: Limits = Limits()) -> FastAPI:
    app = FastAPI(title="k3 serve", docs_url=None, redoc_url=None, openapi_url=None)
    key = api_key.encode("utf-8") if api_key else None

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    def authorize(request: Request) -> None:
        if key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        # constant time over the presented bytes; the key is never logged or echoed
        ok = scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("utf-8"),
                                                                key)
        if not ok:
            raise ApiError(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            raise too_large(limits)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise too_large(limits)
            chunks.append(chunk)
        return b"".join(chunks)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_id, **engine.status()}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": model_id, "object": "model",
                                            "created": 0, "owned_by": "k3studio"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        req = parse_chat(parse_json(await read_body(request), limits), model_id, limits)
        return await _serve(request, req, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        req = parse_completion(parse_json(await read_body(request), limits), model_id,
                               limits)
        return await _serve(request, req, "completion")

    async def _serve(request: Request, req, kind: str):
        inbox = Inbox(request)
        job = Job(req, inbox.post_from(asyncio.get_running_loop()))
        try:
            engine.submit(job)
        except QueueFull as e:
            raise ApiError(429, f"the engine is busy (one generation at a time, "
                                f"{engine.capacity} waiting); retry later",
                           type_="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(e.retry_after)}) from None
        try:
            first = await inbox.next()
        except BaseException:
            engine.withdraw(job)
            inbox.close()
            raise
        if first is None:                            # the client left while queued
            engine.withdraw(job)
            inbox.close()
            return JSONResponse({}, status_code=499)
        if isinstance(first, Fail):
            raise first.error
        assert isinstance(first, Started)
        rid, created = new_id("chatcmpl" if kind == "chat" else "cmpl"), now()
        if req.stream:
            return StreamingResponse(_stream(rid, created, req, kind, inbox, job),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        try:
            parts: dict[str, list[str]] = {"reasoning": [], "content": [], "text": []}
            while True:
                item = await inbox.next()
                if item is None:
                    engine.withdraw(job)
                    return JSONResponse({}, status_code=499)
                if isinstance(item, Delta):
                    parts[item.kind].append(item.text)
                elif isinstance(item, Fail):
                    raise item.error
                elif isinstance(item, Done):
                    break
        except BaseException:
            engine.withdraw(job)
            raise
        finally:
            inbox.close()
        if kind == "chat":
            reasoning = "".join(parts["reasoning"]) if req.thinking else None
            return chat_body(rid, req.model, created, "".join(parts["content"]), reasoning,
                             item.finish, item.usage, item.ext)
        return completion_body(rid, req.model, created, "".join(parts["text"]), item.finish,
                               item.usage, item.ext)

    async def _stream(rid: str, created: int, req, kind: str, inbox: Inbox,
                      job: Job) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        try:
            if kind == "chat":
                yield sse(chat_chunk(rid, req.model, created, {"role": "assistant",
                                                                "content": ""}))
            while True:
                item = await inbox.next()
                if item is None:                     # the client left mid-stream
                    return
                if isinstance(item, Delta):
                    if kind == "chat":
                        field = "reasoning_content" if item.kind == "reasoning" else "content"
                        yield sse(chat_chunk(rid, req.model, created, {field: item.text}))
                    else:
                        yield sse(completion_body(rid, req.model, created, item.text, None))
                elif isinstance(item, Fail):
                    # headers are sent: the error goes in the stream, in the same shape
                    yield sse(item.error.body())
                    break
                elif isinstance(item, Done):
                    if kind == "chat":
                        yield sse(chat_chunk(rid, req.model, created, {}, item.finish))
                    else:
                        yield sse(completion_body(rid, req.model, created, "", item.finish))
                    if req.include_usage:
                        yield sse(usage_chunk(rid, req.model, created, obj, item.usage,
                                              item.ext))
                    break
            yield sse("[DONE]")
        finally:
            engine.withdraw(job)       # no-op when it ended; a stop when the client left
            inbox.close()

    return app


class Inbox:
    """What a job posts, read on the event loop.  One getter task is kept across polls:
    wait_for(queue.get(), t) can drop an item that arrives as the timeout fires (Python
    3.11), and a lost Done would leave a client waiting for ever."""

    def __init__(self, request: Request):
        self.request = request
        self.items: asyncio.Queue = asyncio.Queue()
        self._getter: asyncio.Task | None = None

    def post_from(self, loop: asyncio.AbstractEventLoop):
        def post(item) -> None:                      # called on the engine thread
            try:
                loop.call_soon_threadsafe(self.items.put_nowait, item)
            except RuntimeError:                     # the loop is gone (shutdown)
                pass
        return post

    async def next(self):
        """The job's next item, or None when the client disconnected while waiting."""
        while True:
            if self._getter is None:
                self._getter = asyncio.ensure_future(self.items.get())
            done, _ = await asyncio.wait({self._getter}, timeout=POLL_S)
            if done:
                item, self._getter = self._getter.result(), None
                return item
            if await self.request.is_disconnected():
                return None

    def close(self) -> None:
        if self._getter is not None:
            self._getter.cancel()
            self._getter = None
