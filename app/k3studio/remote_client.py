"""A minimal OpenAI-compatible client for a remote K3 endpoint (vLLM, SGLang, k3 serve):
`GET /v1/models` and a streamed `POST /v1/chat/completions`, on the standard library.

Stop: `abort()` shuts the connection's socket down from any thread, which unblocks the
reading thread at once (a blocked read cannot be interrupted otherwise) and tells the
server the client left, so a server like `k3 serve` stops generating at its next safe
point.  The reasoning arrives as `reasoning_content` (SGLang, k3 serve) or `reasoning`
(some vLLM versions); both are read.
"""
from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator
from urllib.parse import urlsplit

CONNECT_TIMEOUT_S = 10.0


class RemoteError(Exception):
    """A failure talking to the endpoint, worded for a person (it names the URL)."""


@dataclass
class Delta:
    kind: str                       # "reasoning" | "content"
    text: str


@dataclass
class Finished:
    finish: str | None              # stop / length / cancelled / None (stream ended early)
    usage: dict | None
    seconds: float
    first_token_seconds: float | None
    deltas: int
    extra: dict = field(default_factory=dict)     # e.g. k3 serve's `k3` figures


class Endpoint:
    def __init__(self, base_url: str, api_key: str = ""):
        url = base_url.strip().rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RemoteError(f"'{base_url}' is not an http(s) URL (e.g. "
                              f"http://127.0.0.1:8000/v1)")
        self.base_url, self.api_key = url, api_key
        self._parts = parts
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._aborted = False

    # -- plumbing ----------------------------------------------------------------------
    def _connection(self, timeout: float | None) -> http.client.HTTPConnection:
        p = self._parts
        if p.scheme == "https":
            return http.client.HTTPSConnection(p.hostname, p.port or 443, timeout=timeout,
                                               context=ssl.create_default_context())
        return http.client.HTTPConnection(p.hostname, p.port or 80, timeout=timeout)

    def _path(self, tail: str) -> str:
        return (self._parts.path.rstrip("/") or "") + tail

    def _headers(self) -> dict:
        h = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def _open(self, method: str, tail: str, body: dict | None = None,
              timeout: float | None = CONNECT_TIMEOUT_S):
        conn = self._connection(CONNECT_TIMEOUT_S)
        data = None if body is None else json.dumps(body).encode("utf-8")
        try:
            conn.request(method, self._path(tail), body=data, headers=self._headers())
            conn.sock.settimeout(timeout)        # a long prefill: no read timeout
            with self._lock:
                self._sock = conn.sock
                if self._aborted:
                    self._shutdown()
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            if self._aborted:
                raise _Aborted() from None
            raise RemoteError(f"cannot reach {self.base_url}: {_why(e)}") from None
        if resp.status != 200:
            text = resp.read(65536).decode("utf-8", "replace")
            conn.close()
            raise RemoteError(f"{self.base_url}{tail}: HTTP {resp.status}: "
                              f"{_error_message(text)}")
        return conn, resp

    def _shutdown(self) -> None:
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def abort(self) -> None:
        """Stop the request in flight (any thread)."""
        with self._lock:
            self._aborted = True
            self._shutdown()

    # -- the API -----------------------------------------------------------------------
    def models(self) -> list[str]:
        conn, resp = self._open("GET", "/models")
        try:
            data = json.loads(resp.read(1 << 20))
            return [m["id"] for m in data.get("data", []) if isinstance(m, dict) and "id" in m]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise RemoteError(f"{self.base_url}/models: not an OpenAI model list ({e})") \
                from None
        finally:
            conn.close()

    def stream_chat(self, body: dict) -> Iterator[Delta | Finished]:
        """Yields Delta per text piece, then one Finished.  `abort()` ends it with
        finish 'cancelled'."""
        body = dict(body, stream=True, stream_options={"include_usage": True})
        t0 = time.monotonic()
        first, n, finish, usage, extra = None, 0, None, None, {}
        try:
            conn, resp = self._open("POST", "/chat/completions", body, timeout=None)
        except _Aborted:
            yield Finished("cancelled", None, time.monotonic() - t0, None, 0)
            return
        try:
            for event in _sse_events(resp):
                if event == "[DONE]":
                    break
                try:
                    obj = json.loads(event)
                except ValueError:
                    raise RemoteError(f"{self.base_url}: a stream event is not JSON: "
                                      f"{event[:200]!r}") from None
                if "error" in obj:
                    raise RemoteError(f"{self.base_url}: {_error_message(json.dumps(obj))}")
                if obj.get("usage"):
                    usage = obj["usage"]
                if isinstance(obj.get("k3"), dict):
                    extra = obj["k3"]
                for choice in obj.get("choices") or ():
                    delta = choice.get("delta") or {}
                    for key, kind in (("reasoning_content", "reasoning"),
                                      ("reasoning", "reasoning"), ("content", "content")):
                        text = delta.get(key)
                        if isinstance(text, str) and text:
                            if first is None:
                                first = time.monotonic() - t0
                            n += 1
                            yield Delta(kind, text)
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
        except (OSError, http.client.HTTPException) as e:
            if not self._aborted:
                raise RemoteError(f"{self.base_url}: the stream broke: {_why(e)}") from None
        finally:
            conn.close()
        if self._aborted and finish is None:
            finish = "cancelled"
        yield Finished(finish, usage, time.monotonic() - t0, first, n, extra)


class _Aborted(Exception):
    pass


def _sse_events(resp) -> Iterator[str]:
    """The `data:` payloads of a server-sent event stream (multi-line data joined)."""
    data: list[str] = []
    while True:
        raw = resp.readline(1 << 24)
        if not raw:
            break
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue                            # a comment (keep-alive)
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def _why(e: BaseException) -> str:
    if isinstance(e, socket.timeout):
        return "timed out"
    return getattr(e, "strerror", None) or str(e) or type(e).__name__


def _error_message(text: str) -> str:
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    except (ValueError, AttributeError):
        pass
    return text.strip()[:300] or "(no message)"
