"""The remote client's parsing against a loopback HTTP server that answers the way other
OpenAI-compatible servers do (vLLM's `reasoning` field, SSE comments, CRLF lines, an error
body), which `k3 serve` itself never sends."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from k3studio.remote_client import Delta, Endpoint, Finished, RemoteError


def chunk(delta=None, finish=None, usage=None):
    obj = {"choices": [] if delta is None and finish is None else
           [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}
    if usage:
        obj["usage"] = usage
    return f"data: {json.dumps(obj)}\r\n\r\n".encode()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        if self.headers.get("Authorization") != "Bearer k":
            self.send_response(401)
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "bad key", "type": "auth"}}')
            return
        self.send_response(200)
        self.end_headers()
        self.wfile.write(json.dumps({"data": [{"id": "kimi-k3"}, {"id": "other"}]}).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        w = self.wfile.write
        w(b": keep-alive\r\n\r\n")
        w(chunk({"role": "assistant", "content": ""}))
        w(chunk({"reasoning": "think "}))                   # vLLM's name
        w(chunk({"reasoning_content": "more"}))             # SGLang's / k3 serve's
        w(chunk({"content": "An"}))
        w(b'data: {"choices": [{"index": 0, "delta": {"content": "swer"},\r\n'
          b'data:  "finish_reason": null}]}\r\n\r\n')          # one event over two lines
        w(chunk(finish="stop"))
        w(chunk(usage={"prompt_tokens": 3, "completion_tokens": 4}))
        w(b"data: [DONE]\r\n\r\n")


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.bodies = []
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_stream_reads_both_reasoning_names_comments_and_multiline_events(server):
    ep = Endpoint(f"http://127.0.0.1:{server.server_port}/v1", "k")
    assert ep.models() == ["kimi-k3", "other"]
    items = list(ep.stream_chat({"model": "kimi-k3", "messages": []}))
    deltas = [(d.kind, d.text) for d in items if isinstance(d, Delta)]
    assert deltas == [("reasoning", "think "), ("reasoning", "more"), ("content", "An"),
                      ("content", "swer")]
    done = items[-1]
    assert isinstance(done, Finished) and done.finish == "stop"
    assert done.usage == {"prompt_tokens": 3, "completion_tokens": 4}
    sent = server.bodies[-1]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}


def test_errors_name_the_url_and_the_server_message(server):
    url = f"http://127.0.0.1:{server.server_port}/v1"
    with pytest.raises(RemoteError, match="HTTP 401: bad key"):
        Endpoint(url, "wrong").models()
    with pytest.raises(RemoteError, match="is not an http"):
        Endpoint("ftp://x/v1")
