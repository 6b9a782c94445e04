"""`GET /k3/steps` and the per-slot figures of `/health`: what each engine step did (batch
size, seconds, bytes read, tokens, each request's slot, tokens and decode rate), for
K3 Studio's batch plots.  The ring itself (server/steps.py), the route's refusals (a
non-loopback client, a bad `since`) on the real app, and a real `k3 serve --parallel 2`
whose two concurrent requests share steps."""
from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi", reason="k3 serve needs fastapi")

from k3engine.server.steps import StepLog  # noqa: E402

from serve_helpers import make_demo, open_stream, serve  # noqa: E402

TEL = SimpleNamespace(trunk_bytes=1000, expert_bytes=300)


def test_the_log_gives_each_request_its_decode_rate_and_stays_bounded():
    log = StepLog(keep=4)
    log.record(2.0, TEL, [(7, 0, 1)])                 # request 7's first token: a prefill
    log.record(0.5, TEL, [(7, 0, 1), (8, 1, 1)])      # 8 joins
    log.record(0.25, TEL, [(7, 0, 1), (8, 1, 1)])
    got = log.since(0)
    last = got["steps"][-1]
    print(f"[steps] {got}")
    assert [s["batch"] for s in got["steps"]] == [1, 2, 2] and got["next"] == 3
    assert last["tokens"] == 2 and last["tokens_per_s"] == 8.0
    assert last["trunk_bytes"] == 1000 and last["expert_bytes"] == 300
    # 7: tokens 2 and 3 in 0.75 s (its first token's 2 s prefill left out); 8: one token
    # after its first, in 0.25 s
    assert last["slots"] == [{"slot": 0, "request": 7, "tokens": 3, "tokens_per_s": 2.667},
                             {"slot": 1, "request": 8, "tokens": 2, "tokens_per_s": 4.0}]
    assert log.slots([(7, 0), (8, 1), (9, 2)]) == last["slots"] + [
        {"slot": 2, "request": 9, "tokens": 0, "tokens_per_s": 0.0}]  # 9: in its prompt pass
    log.leave(7)
    assert log.slots([(7, 0)])[0]["tokens"] == 0          # its figures are gone
    for _ in range(5):                                 # the ring keeps the newest 4
        log.record(0.1, TEL, [(8, 1, 1)])
    got = log.since(1)
    assert [s["n"] for s in got["steps"]] == [4, 5, 6, 7] and got["dropped"] == 3
    assert log.since(8)["steps"] == [] and log.since(8)["next"] == 8
    # a poller ahead of the log (the server restarted) gets what is kept
    assert [s["n"] for s in log.since(99)["steps"]] == [4, 5, 6, 7]


def asgi_get(app, path: str, query: str, client: str) -> tuple[int, dict]:
    """One GET through the ASGI app with the given client address (what uvicorn puts in
    the scope), without a socket: a non-loopback client cannot be made on this machine."""
    out: dict = {"body": b""}

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        elif message["type"] == "http.response.body":
            out["body"] += message.get("body", b"")
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "GET", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": query.encode(), "headers": [], "client": (client, 40000),
             "server": ("127.0.0.1", 8000), "root_path": ""}
    asyncio.run(app(scope, receive, send))
    return out["status"], json.loads(out["body"])


def test_the_route_is_loopback_only_and_refuses_a_bad_since():
    from k3engine.server.app import create_app
    from k3engine.server.engine import EngineThread
    from k3engine.server.protocol import ModelNames
    engine = EngineThread(SimpleNamespace(steps=StepLog()), queue=1)
    try:
        engine.steps.record(0.1, TEL, [(1, 0, 1)])
        app = create_app(engine, ModelNames("demo"), None)
        status, body = asgi_get(app, "/k3/steps", "since=0", "127.0.0.1")
        assert status == 200 and body["next"] == 1 and body["steps"][0]["batch"] == 1
        status, body = asgi_get(app, "/k3/steps", "since=0", "::ffff:127.0.0.1")
        assert status == 200
        status, body = asgi_get(app, "/k3/steps", "", "192.0.2.7")
        print(f"[steps] from 192.0.2.7: {status} {body}")
        assert status == 403 and body["error"]["code"] == "loopback_only"
        for bad in ("since=-1", "since=abc", "since=1.5", "since=" + "9" * 30):
            status, body = asgi_get(app, "/k3/steps", bad, "127.0.0.1")
            assert status == 400 and body["error"]["param"] == "since", bad
    finally:
        engine.close()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return make_demo(str(tmp_path_factory.mktemp("steps") / "demo"))


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def test_two_concurrent_requests_share_steps_and_each_has_its_rate(demo):
    from openai import OpenAI
    with serve(demo, "--tok", demo, "--accept-any-model", "--gen", "2000",
               "--parallel", "2") as s:
        conn, _ = open_stream(s)                     # the long one
        during = {}

        def other():
            client = OpenAI(base_url=s.base_url, api_key="none", max_retries=0)
            stream = client.chat.completions.create(
                model="demo", max_tokens=40, stream=True,
                messages=[{"role": "user", "content": "Name a colour"}])
            for i, _ in enumerate(stream):
                if i == 5:              # both run now: the long one has not ended
                    during["health"] = s.health()
        t = threading.Thread(target=other)
        t.start()
        t.join(300)
        conn.close()                                   # the long one leaves
        s.wait_idle()
        got = get(s.url + "/k3/steps?since=0")
        after = get(s.url + f"/k3/steps?since={got['next']}")
    steps = got["steps"]
    both = [st for st in steps if st["batch"] == 2]
    h = during["health"]
    print(f"[gate] --parallel 2: {len(steps)} steps, {len(both)} with both requests; "
          f"/health during both: slots_busy {h['slots_busy']}, slot_figures "
          f"{h['slot_figures']}; a shared step: {both[len(both) // 2]}")
    assert got["slots"] == 2 and h["slots_busy"] == 2
    assert sorted(f["slot"] for f in h["slot_figures"]) == [0, 1]
    assert len(both) >= 40                  # each of the short one's 40 tokens (it never ends)
    for st in both:
        assert {x["slot"] for x in st["slots"]} == {0, 1} and st["tokens"] == 2
        assert st["seconds"] > 0 and st["trunk_bytes"] >= 0 and st["expert_bytes"] >= 0
    short = [x for st in both for x in st["slots"] if x["request"] == 2][-1]
    assert short["slot"] == 1 and short["tokens"] == 40 and short["tokens_per_s"] > 0
    assert [st["n"] for st in steps] == list(range(len(steps)))
    assert after["steps"] == [] and after["next"] == got["next"]
