"""A real `k3 serve` process on loopback for the server, load-test and app tests."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager

LISTENING = re.compile(r"k3 serve: listening on (http://\S+)")


def make_demo(path: str) -> str:
    """A fresh random-weight demo model (seed 9) at `path`: the model every serve test and
    the load test serve."""
    from k3engine.tools.make_checkpoint import dims_config, make_checkpoint
    make_checkpoint(path, dims_config("demo"), seed=9)
    return path


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, lines: list[str],
                 key: str | None = None):
        self.proc, self.url, self.lines, self.key = proc, url, lines, key

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def health(self) -> dict:
        """The detailed /health (with the key, when the server has one)."""
        req = urllib.request.Request(self.url + "/health", headers={
            "Authorization": f"Bearer {self.key}"} if self.key else {})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def wait_idle(self, limit_s: float = 600.0) -> dict:
        """Poll /health until nothing runs or waits (the limit only guards a hang)."""
        end = time.monotonic() + limit_s
        while True:
            h = self.health()
            if not h["busy"] and not h["queued"]:
                return h
            if time.monotonic() > end:
                raise AssertionError(f"server still busy after {limit_s} s: {h}")
            time.sleep(0.05)

    def rss_bytes(self) -> int:
        import psutil
        return psutil.Process(self.proc.pid).memory_info().rss


@contextmanager
def serve(model_dir: str, *args: str, env: dict | None = None):
    """`k3 serve MODEL_DIR --port 0 ARGS`; yields a Server once it listens."""
    cmd = [sys.executable, "-m", "k3engine", "serve", model_dir, "--port", "0", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    lines: list[str] = []
    found = threading.Event()
    url: list[str] = []

    def pump():
        for line in proc.stdout:
            lines.append(line)
            m = LISTENING.search(line)
            if m and not found.is_set():
                url.append(m.group(1))
                found.set()
        found.set()
    threading.Thread(target=pump, daemon=True).start()
    try:
        found.wait(300)
        if not url:
            proc.kill()
            proc.wait()
            raise AssertionError("k3 serve did not start:\n" + "".join(lines[-30:]))
        key = args[args.index("--api-key") + 1] if "--api-key" in args else None
        yield Server(proc, url[0], lines, key)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def open_stream(server: Server, prompt: str = "Tell me a long story", tokens: int = 2000):
    """A streamed chat request of `tokens` tokens, read until its first text arrives:
    (connection, response).  The random-weight demo never closes its replies, so the
    request runs its tokens unless the caller closes the connection."""
    import http.client
    from urllib.parse import urlparse
    u = urlparse(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = {"model": "demo", "max_tokens": tokens, "stream": True,
            "messages": [{"role": "user", "content": prompt}]}
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    seen = b""
    while b"content" not in seen and b"reasoning" not in seen:
        seen += r.read1(256)
    return conn, r
