"""`k3 serve`'s HTTP layer against a scripted engine: the real app, the real uvicorn config
(`main.uvicorn_config`: header deadline, keep-alive, limits) on loopback, and a fake
Backend whose jobs post Started / Progress / Delta / Done on cue.  What is checked here
needs control of the engine's timing, which a model does not give: early bytes and
keep-alive comments while a request waits, prefill progress, control text kept out of
/v1/completions, body and header deadlines, quiet disconnects, the access log, /health."""
from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="k3 serve needs fastapi")

from k3engine.server.app import create_app  # noqa: E402
from k3engine.server.engine import Delta, Done, EngineThread, Started  # noqa: E402
from k3engine.server.main import parser, uvicorn_config  # noqa: E402
from k3engine.server.protocol import (ApiError, Limits, ModelNames, Progress,  # noqa: E402
                                      usage_body)

KEY = "k-http-77"
KEEPALIVE_S = 0.2


class ScriptedBackend:
    """Runs a job by the script in its last user message (chat) or prompt (completions):
    `hold` waits for `release` (or the job's cancel) before it starts; `prefill` posts
    Progress during a slow prompt pass; `ctl` sends control text split over deltas."""

    def __init__(self):
        self.release = threading.Event()

    def execute(self, job) -> str:
        req = job.req
        script = req.prompt if req.kind == "completion" else req.history.messages[-1].content
        if "hold" in script:
            while not self.release.wait(0.02):
                if job.cancel:
                    return "cancelled"
        if "refuse" in script:                # as the adapter refuses a too-long prompt
            raise ApiError(400, "the prompt is 99999 tokens; this server's limit is 10",
                           param="messages", code="context_length_exceeded")
        job.post(Started(10))
        if "prefill" in script:
            for done in (4, 8):
                time.sleep(3 * KEEPALIVE_S)
                job.post(Progress(done, 10))
        if req.kind == "completion":
            pieces = ["a<|clo", "se|>b<|sep|>", "c<", "|sep|>"] if "ctl" in script else ["x"]
            for p in pieces:
                job.post(Delta("text", p))
        else:
            job.post(Delta("reasoning", "think"))
            job.post(Delta("content", "answer"))
        ext = {"reused_positions": 6, "ids": [1, 2, 3], "prompt_positions": 10}
        job.post(Done("length", usage_body(10, 3, 1 if req.kind == "chat" else 0), ext))
        return "answered"


@pytest.fixture
def live():
    """The app on uvicorn with main.py's config, in a thread; yields (host, port, ctx)."""
    import uvicorn
    backend = ScriptedBackend()
    engine = EngineThread(backend, queue=4)
    logs: list[str] = []
    a = parser().parse_args(["m", "--timeout-header", "1", "--timeout-keep-alive", "1"])
    app = create_app(engine, ModelNames("demo"), KEY, Limits(max_body_bytes=100_000),
                     hidden_text=("<|close|>", "<|sep|>"), keepalive_s=KEEPALIVE_S,
                     body_timeout_s=1.0, access_log=logs.append)
    server = uvicorn.Server(uvicorn_config(app, a))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    errors: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            errors.append(record.getMessage() + (record.exc_text or ""))
    handler = Keep(level=logging.WARNING)
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.01)
    logging.getLogger("uvicorn").addHandler(handler)   # after uvicorn configured logging
    yield {"port": sock.getsockname()[1], "backend": backend, "logs": logs,
           "errors": errors, "engine": engine}
    backend.release.set()
    server.should_exit = True
    t.join(10)
    engine.close()
    logging.getLogger("uvicorn").removeHandler(handler)


AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def post(live, path, body, headers=AUTH, timeout=10):
    c = http.client.HTTPConnection("127.0.0.1", live["port"], timeout=timeout)
    c.request("POST", path, body if isinstance(body, bytes) else json.dumps(body), headers)
    return c, c.getresponse()


def chat_body(text, **kw):
    return {"model": "demo", "messages": [{"role": "user", "content": text}], **kw}


def messages_body(text, **kw):
    return {"model": "demo", "max_tokens": 5, "messages": [{"role": "user", "content": text}],
            **kw}


def sse_until(resp, end: bytes, limit_s=10.0) -> tuple[list[bytes], list[float]]:
    """Raw lines of a stream up to the one starting with `end`, with arrival times."""
    lines, times, t0 = [], [], time.monotonic()
    while time.monotonic() - t0 < limit_s:
        line = resp.readline()
        if not line:
            break
        lines.append(line.rstrip(b"\n"))
        times.append(time.monotonic() - t0)
        if line.startswith(end):
            break
    return lines, times


# ---------------------------------------------------------------- early bytes

@pytest.mark.parametrize("path,body,first,end", [
    ("/v1/chat/completions", chat_body("go", stream=True), b'data: {"id"', b"data: [DONE]"),
    ("/v1/messages", messages_body("go", stream=True), b"event: ping",
     b"event: message_stop"),
])
def test_a_queued_stream_gets_headers_a_first_event_and_keepalives(live, path, body, first,
                                                                   end):
    """The engine is busy with a held request: a stream still gets its headers and a
    first event within the header grace (0.5 s), then `: keep-alive` comments every
    KEEPALIVE_S until its job runs, then its events."""
    holder = threading.Thread(target=post, args=(live, "/v1/chat/completions",
                                                 chat_body("hold")), daemon=True)
    holder.start()
    while not live["engine"].status()["busy"]:
        time.sleep(0.01)
    t0 = time.monotonic()
    c, resp = post(live, path, body)
    head_s = time.monotonic() - t0
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    line = resp.readline()
    first_s = time.monotonic() - t0
    print(f"[gate] {path} while queued: headers after {head_s:.3f} s, first event "
          f"{line[:30]!r} after {first_s:.3f} s")
    assert line.startswith(first) and first_s < 2.0
    waited, _ = sse_until(resp, b": keep-alive")
    time.sleep(5 * KEEPALIVE_S)
    live["backend"].release.set()
    lines, _ = sse_until(resp, end)
    keepalives = (waited + lines).count(b": keep-alive")
    assert keepalives >= 3, lines
    assert any(x.startswith(b': k3 {"prefill":{"done":0,"total":10}}') for x in lines)
    assert lines[-1].startswith(end)
    holder.join(10)


@pytest.mark.parametrize("queued", [False, True])
def test_a_refusal_is_a_4xx_when_it_can_be_and_in_the_stream_when_headers_went(live,
                                                                               queued):
    """A refusal the adapter makes as the job starts: a plain 400 when the job starts
    within the header grace; after it (queued behind another job) the 200 is sent, so
    the error arrives as the stream's error event, in Anthropic's shape."""
    if queued:
        holder = threading.Thread(target=post, args=(live, "/v1/chat/completions",
                                                     chat_body("hold")), daemon=True)
        holder.start()
        while not live["engine"].status()["busy"]:
            time.sleep(0.01)
        threading.Timer(1.0, live["backend"].release.set).start()
    c, resp = post(live, "/v1/messages", messages_body("refuse", stream=True))
    if not queued:
        body = json.loads(resp.read())
        assert resp.status == 400 and body["error"]["type"] == "invalid_request_error"
        return
    assert resp.status == 200
    lines, _ = sse_until(resp, b"data: {\"type\":\"error\"")
    assert lines[0] == b"event: ping" and lines[-2] == b"event: error"
    err = json.loads(lines[-1][6:])
    assert err["error"]["type"] == "invalid_request_error" and "99999" in err["error"]["message"]
    holder.join(10)


def test_unknown_paths_have_the_route_shape(live):
    c, resp = post(live, "/v1/messages/count_tokens", messages_body("x"))
    body = json.loads(resp.read())
    assert resp.status == 404 and body["type"] == "error"
    assert body["error"]["type"] == "not_found_error"
    c, resp = post(live, "/v1/embeddings", {"input": "x"})
    body = json.loads(resp.read())
    assert resp.status == 404 and "/v1/embeddings" in body["error"]["message"]


def test_prefill_progress_and_keepalives_during_the_prompt_pass(live):
    c, resp = post(live, "/v1/messages", messages_body("prefill", stream=True))
    lines, _ = sse_until(resp, b"event: message_stop")
    text = b"\n".join(lines)
    for done in (0, 4, 8):
        assert f': k3 {{"prefill":{{"done":{done},"total":10}}}}'.encode() in text
    # between Started and Progress(4): 3 keep-alive periods without an item
    assert lines.count(b": keep-alive") >= 2
    events = [x[7:] for x in lines if x.startswith(b"event: ")]
    # started at once: message_start first, no ping
    assert events == [b"message_start", b"content_block_start", b"content_block_delta",
                      b"content_block_stop", b"content_block_start", b"content_block_delta",
                      b"content_block_stop", b"message_delta", b"message_stop"]


# ---------------------------------------------------------------- control text

def test_completions_never_send_control_text(live):
    c, resp = post(live, "/v1/completions", {"model": "demo", "prompt": "ctl"})
    body = json.loads(resp.read())
    assert body["choices"][0]["text"] == "abc"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 6
    c, resp = post(live, "/v1/completions", {"model": "demo", "prompt": "ctl", "stream": True})
    lines, _ = sse_until(resp, b"data: [DONE]")
    chunks = [json.loads(x[6:]) for x in lines if x.startswith(b"data: {")]
    streamed = "".join(ch["choices"][0]["text"] for ch in chunks)
    assert streamed == "abc" and b"<|" not in b"".join(lines)


# ---------------------------------------------------------------- hostile bodies

@pytest.mark.parametrize("path,shape", [("/v1/chat/completions", "openai"),
                                        ("/v1/messages", "anthropic")])
def test_a_nesting_bomb_is_a_400_in_the_route_shape(live, path, shape):
    bomb = b'{"model": "demo", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    c, resp = post(live, path, bomb)
    body = json.loads(resp.read())
    assert resp.status == 400
    msg = body["error"]["message"]
    assert "5001 levels deep" in msg and "limit is 64" in msg
    if shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error"]["code"] == "too_deeply_nested"
    # brackets inside strings do not count; 64 levels are fine
    ok = chat_body("[" * 5000)
    ok["x"] = json.loads("[" * 60 + "]" * 60)
    c, resp = post(live, "/v1/chat/completions", ok)
    assert resp.status == 200, resp.read()
    assert not live["errors"], live["errors"]


def test_a_client_gone_before_its_body_is_quiet(live):
    s = socket.create_connection(("127.0.0.1", live["port"]))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
              + KEY.encode() + b"\r\nContent-Length: 5000\r\n\r\n{\"model\"")
    time.sleep(0.3)
    s.close()
    end = time.monotonic() + 5
    while not any(" 499 " in x for x in live["logs"]) and time.monotonic() < end:
        time.sleep(0.05)
    print(f"[gate] access log: {live['logs']}")
    assert any(x.startswith("127.0.0.1 POST /v1/chat/completions 499 ") for x in live["logs"])
    assert not live["errors"], live["errors"]           # no ClientDisconnect traceback


def test_a_slow_body_gets_408(live):
    s = socket.create_connection(("127.0.0.1", live["port"]), timeout=10)
    s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: " + KEY.encode()
              + b"\r\nContent-Length: 50\r\n\r\n{")
    t0 = time.monotonic()
    reply = s.recv(4096)
    took = time.monotonic() - t0
    while chunk := s.recv(4096):         # the body may come in its own segment
        reply += chunk
    s.close()
    assert reply.startswith(b"HTTP/1.1 408") and b'"type":"error"' in reply, reply
    assert 0.8 < took < 5, took


@pytest.mark.parametrize("sent", [b"", b"GET /health HTTP/1.1\r\nHo"])
def test_headers_have_a_deadline(live, sent):
    """Idle or slowloris: the connection is closed once --timeout-header (1 s here) passes
    without complete headers."""
    s = socket.create_connection(("127.0.0.1", live["port"]), timeout=10)
    s.sendall(sent)
    t0 = time.monotonic()
    for _ in range(3):                   # a byte now and then does not extend it
        time.sleep(0.2)
        try:
            s.sendall(b"s")
        except OSError:
            break
    assert s.recv(100) == b""            # closed by the server
    took = time.monotonic() - t0
    s.close()
    assert 0.5 < took < 5, took


def test_idle_and_slowloris_crowds_are_closed_and_the_server_answers_meanwhile(live):
    """Issue 47 held 50 slowloris and 3,000 idle connections for ever.  Here 150 idle and
    50 slowloris connections are all closed by the header deadline (1 s), and a real
    request is answered while they are open."""
    crowd = []
    for n in range(200):
        s = socket.create_connection(("127.0.0.1", live["port"]), timeout=10)
        if n % 4 == 0:
            s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n")
        crowd.append(s)
    t0 = time.monotonic()
    c = http.client.HTTPConnection("127.0.0.1", live["port"], timeout=10)
    c.request("GET", "/health")
    assert c.getresponse().status == 200
    for n, s in enumerate(crowd):
        if n % 4 == 0:
            try:
                s.sendall(b"X-Slow: 1\r\n")          # a trickle does not extend it
            except OSError:
                pass
    closed, deadline = 0, t0 + 5
    for s in crowd:
        s.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            closed += s.recv(10) == b""
        except ConnectionResetError:                   # closed as well
            closed += 1
        except TimeoutError:                           # still held
            pass
        s.close()
    took = time.monotonic() - t0
    print(f"[gate] crowd of 200 (50 slowloris): {closed} closed by the server within "
          f"{took:.2f} s")
    assert closed == 200 and took < 6


def test_keep_alive_connections_serve_several_requests_then_idle_out(live):
    c = http.client.HTTPConnection("127.0.0.1", live["port"], timeout=10)
    for _ in range(2):
        c.request("GET", "/health")
        assert c.getresponse().read() == b'{"status":"ok"}'
    time.sleep(1.6)                      # --timeout-keep-alive 1
    with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
        c.request("GET", "/health")
        c.getresponse()


# ---------------------------------------------------------------- health, access log

def test_health_is_minimal_without_the_key_and_detailed_with_it(live):
    for headers, detailed in (({}, False), ({"Authorization": "Bearer wrong"}, False),
                              ({"Authorization": f"Bearer {KEY}"}, True),
                              ({"x-api-key": KEY}, True)):
        c = http.client.HTTPConnection("127.0.0.1", live["port"], timeout=10)
        c.request("GET", "/health", headers=headers)
        h = json.loads(c.getresponse().read())
        assert h["status"] == "ok"
        assert ("answered" in h and h["model"] == "demo") is detailed, h
        if not detailed:
            assert h == {"status": "ok"}


def test_access_log_has_method_path_status_seconds_and_no_secrets(live):
    post(live, "/v1/chat/completions?key=" + KEY, chat_body("secret words"))[1].read()
    post(live, "/v1/messages", messages_body("x"), headers={"x-api-key": "bad"})[1].read()
    lines = live["logs"]
    end = time.monotonic() + 5          # a line is written once its response has ended
    while len(lines) < 2 and time.monotonic() < end:
        time.sleep(0.02)
    print(f"[gate] access log: {lines}")
    assert sorted(x.rsplit(" ", 1)[0] for x in lines) == [
        "127.0.0.1 POST /v1/chat/completions 200", "127.0.0.1 POST /v1/messages 401"]
    assert all(x.endswith("s") and float(x.split()[-1][:-1]) >= 0 for x in lines)
    joined = "\n".join(lines)
    assert KEY not in joined and "secret" not in joined and "bad" not in joined
