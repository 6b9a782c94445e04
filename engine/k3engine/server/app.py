"""The HTTP face of `k3 serve` (FastAPI on uvicorn).

Every route is async and never touches the engine: it validates, submits a job to the
engine thread, and awaits what the job posts on an asyncio queue (the engine thread hands
items over with call_soon_threadsafe, so the event loop never blocks on a generation).
The three generation routes differ only in how they parse a body and render the job's
items (a "wire": protocol.ChatWire, protocol.CompletionWire, messages.MessagesWire);
`_serve` drives them all.

Early bytes: a streamed request gets its headers and a first event within HEADER_GRACE_S
(at once when its job starts, which is also when a refusal such as a too-long prompt can
still be a plain 4xx), then a `: keep-alive` comment every `keepalive_s` while it waits
in the queue or in the prompt pass, and our prefill figures as `: k3 {...}` comments.

Disconnects: a streaming client that goes away makes Starlette cancel the response's
generator; its `finally` withdraws the job, so the engine stops at its next safe point.  A
non-streaming client is watched with `request.is_disconnected()` while it waits.  A client
that leaves before its body arrived is a quiet 499 in the access log, never a traceback.
"""
from __future__ import annotations

import asyncio
import hmac
import time
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .engine import Delta, Done, EngineThread, Fail, Job, QueueFull, Started
from .loopback import is_loopback
from .messages import MessagesWire, parse_messages
from .protocol import (KEEPALIVE, ApiError, ChatWire, CompletionWire, Limits, ModelNames,
                       Progress, parse_chat, parse_completion, parse_json,
                       progress_comment, too_large)

POLL_S = 0.25                   # how often a waiting request checks its client
HEADER_GRACE_S = 0.5            # a stream's headers wait this long for its job to start
GONE, WAITED = object(), object()          # Inbox.next: the client left / nothing yet


class ClientGone(Exception):
    """The client closed the connection before its request body arrived."""


def create_app(engine: EngineThread, models: ModelNames | str, api_key: str | None,
               limits: Limits = Limits(), *, hidden_text: tuple[str, ...] = (),
               end_ids: frozenset[int] = frozenset(), keepalive_s: float = 5.0,
               body_timeout_s: float = 30.0,
               access_log: Callable[[str], None] | None = None) -> FastAPI | AccessLog:
    """`hidden_text`: the tokenizer's added-token strings, never sent as completion text;
    `end_ids`: the chat's end ids (an Anthropic end_turn is one of them)."""
    if isinstance(models, str):
        models = ModelNames(models)
    app = FastAPI(title="k3 serve", docs_url=None, redoc_url=None, openapi_url=None)
    key = api_key.encode("utf-8") if api_key else None

    def anthropic(request: Request) -> bool:
        return request.url.path.startswith("/v1/messages")

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        body = e.anthropic_body() if anthropic(request) else e.body()
        return JSONResponse(body, status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        # unknown paths and methods (404, 405) in the route family's shape too
        return await _api_error(request, ApiError(e.status_code, f"{request.method} "
                                                  f"{request.url.path}: {e.detail}",
                                                  headers=e.headers))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, e: ClientGone):
        return Response(status_code=499)      # nobody reads it: the access log does

    def presented(request: Request) -> bytes | None:
        """The key a request presents: `Authorization: Bearer KEY` (OpenAI's clients) or
        `x-api-key: KEY` (Anthropic's), on every route."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            return token.strip().encode("utf-8")
        got = request.headers.get("x-api-key")
        return got.strip().encode("utf-8") if got is not None else None

    def authorized(request: Request) -> bool:
        if key is None:
            return True
        got = presented(request)
        # constant time over the presented bytes; the key is never logged or echoed
        return got is not None and hmac.compare_digest(got, key)

    def authorize(request: Request) -> None:
        if not authorized(request):
            raise ApiError(401, "invalid or missing API key (send Authorization: Bearer KEY "
                                "or x-api-key: KEY)", type_="authentication_error",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            raise too_large(limits)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limits.max_body_bytes:
                        raise too_large(limits)
                    chunks.append(chunk)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {body_timeout_s:g} "
                                f"s", code="body_timeout", headers={"Connection": "close"}
                           ) from None
        except ClientDisconnect:
            raise ClientGone() from None
        return b"".join(chunks)

    @app.get("/health")
    async def health(request: Request):
        # without the key: only that it is up (no counters, no model name)
        if not authorized(request):
            return {"status": "ok"}
        return {"status": "ok", "model": models.served, **engine.status()}

    @app.get("/k3/steps")
    async def steps(request: Request):
        # the engine's recent steps (batch size, seconds, bytes, per-slot rates): for a
        # monitor on this machine (K3 Studio's plots), never across the network
        client = request.client.host if request.client else ""
        if not is_loopback(client):
            raise ApiError(403, "GET /k3/steps answers only on loopback (127.0.0.1, ::1)",
                           type_="permission_error", code="loopback_only")
        authorize(request)
        raw = request.query_params.get("since", "0")
        if not raw.isdigit() or len(raw) > 18:
            raise ApiError(400, f"since must be a step number >= 0 (got {raw[:40]!r})",
                           param="since")
        return {"object": "k3.steps", "slots": getattr(engine, "parallel", 1),
                **engine.steps.since(int(raw))}

    @app.get("/v1/models")
    async def list_models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": m, "object": "model", "created": 0,
                                            "owned_by": "k3studio"}
                                           for m in models.listed()]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        req = parse_chat(parse_json(await read_body(request), limits), models, limits)
        return await _serve(request, ChatWire(req))

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        req = parse_completion(parse_json(await read_body(request), limits), models, limits)
        return await _serve(request, CompletionWire(req, hidden_text))

    @app.post("/v1/messages")
    async def messages(request: Request):
        authorize(request)
        req, show_thinking = parse_messages(parse_json(await read_body(request), limits),
                                            models, limits)
        return await _serve(request, MessagesWire(req, end_ids, show_thinking))

    async def _serve(request: Request, wire):
        req = wire.req
        inbox = Inbox(request)
        job = Job(req, inbox.post_from(asyncio.get_running_loop()))
        try:
            engine.submit(job)
        except QueueFull as e:
            raise ApiError(429, f"the engine is busy ({getattr(engine, 'parallel', 1)} "
                                f"at a time, {engine.capacity} waiting); retry later",
                           type_="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(e.retry_after)}) from None
        try:
            first = await inbox.next(HEADER_GRACE_S if req.stream else None)
        except BaseException:
            engine.withdraw(job)
            inbox.close()
            raise
        if first is GONE:                            # the client left while queued
            engine.withdraw(job)
            inbox.close()
            return Response(status_code=499)
        if isinstance(first, Fail):
            inbox.close()
            raise first.error
        if req.stream:
            return StreamingResponse(_stream(wire, inbox, job, first),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        parts: dict[str, list[str]] = {"reasoning": [], "content": [], "text": []}
        item = first
        try:
            while not isinstance(item, Done):
                if item is GONE:
                    engine.withdraw(job)
                    return Response(status_code=499)
                if isinstance(item, Fail):
                    raise item.error
                if isinstance(item, Delta):
                    parts[item.kind].append(item.text)
                item = await inbox.next()
        except BaseException:
            engine.withdraw(job)
            raise
        finally:
            inbox.close()
        return JSONResponse(wire.body(parts, item))

    async def _stream(wire, inbox: Inbox, job: Job, item) -> AsyncIterator[bytes]:
        try:
            opening = wire.opening(waiting=item is WAITED)
            if opening:
                yield opening
            while True:
                if item is GONE:                     # the client left mid-stream
                    return
                if item is WAITED:
                    yield KEEPALIVE
                elif isinstance(item, Started):
                    yield progress_comment(0, item.prompt_ids) + wire.started(item)
                elif isinstance(item, Progress):
                    yield progress_comment(item.done, item.total)
                elif isinstance(item, Delta):
                    out = wire.delta(item)
                    if out:
                        yield out
                elif isinstance(item, Fail):
                    yield wire.failed(item.error)
                    return
                elif isinstance(item, Done):
                    yield wire.done(item)
                    return
                item = await inbox.next(keepalive_s)
        finally:
            engine.withdraw(job)       # no-op when it ended; a stop when the client left
            inbox.close()

    if access_log is None:
        return app
    return AccessLog(app, access_log)


class AccessLog:
    """One line per request: client, method, path, status, seconds (to the response's
    end, so a stream counts whole).  Never the query string, a header or the body: those
    may hold keys and content.  Status 499: the client left before a response began."""

    def __init__(self, app, log: Callable[[str], None]):
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.monotonic(), [499]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, send_status)
        finally:
            host = (scope.get("client") or ("-",))[0]
            self.log(f"{host} {scope['method']} {scope['path']} {status[0]} "
                     f"{time.monotonic() - t0:.3f}s")


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

    async def next(self, wait_s: float | None = None):
        """The job's next item; GONE when the client disconnected while waiting; WAITED
        when `wait_s` passed with nothing (the item stays due to the next call)."""
        end = None if wait_s is None else time.monotonic() + wait_s
        while True:
            if self._getter is None:
                self._getter = asyncio.ensure_future(self.items.get())
            left = POLL_S if end is None else min(POLL_S, max(end - time.monotonic(), 0))
            done, _ = await asyncio.wait({self._getter}, timeout=left)
            if done:
                item, self._getter = self._getter.result(), None
                return item
            if await self.request.is_disconnected():
                return GONE
            if end is not None and time.monotonic() >= end:
                return WAITED

    def close(self) -> None:
        if self._getter is not None:
            self._getter.cancel()
            self._getter = None
