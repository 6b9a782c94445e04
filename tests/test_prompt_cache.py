"""The server's prompt cache (prompt_cache.PromptCache): several kept conversations, each
continued by the request that extends it; on disk across a restart, bit-identical to a full
prefill; stale or damaged files refused and deleted, never trusted; the folder capped."""
from __future__ import annotations

import os
import time

import pytest

from k3engine.chat import History, Message
from k3engine.engine import load_spec_from, open_engine
from k3engine.prompt_cache import SUFFIX, PromptCache
from k3engine.server.engine import Backend, Done, Job, Started
from k3engine.server.protocol import GenRequest, Limits, SamplingIn
from serve_helpers import make_demo, serve


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return make_demo(str(tmp_path_factory.mktemp("pc") / "demo"))


def _engine(demo):
    return open_engine(load_spec_from(demo, tok_dir=demo, incremental=True), gen=8)


def ask(backend, history):
    """One greedy chat request on `backend`: (Started, Done)."""
    posted = []
    req = GenRequest(kind="chat", model="demo", gen=8,
                     sampling=SamplingIn(None, None, None, None, True), stops=(),
                     stream=False, include_usage=True, history=History(list(history)))
    backend.execute(Job(req, posted.append))
    return (next(p for p in posted if isinstance(p, Started)),
            next(p for p in posted if isinstance(p, Done)))


def two_conversations():
    a = [Message("system", "Be brief."), Message("user", "Tell me about the moon")]
    b = [Message("system", "You answer in French."), Message("user", "Name a colour")]
    return a, b


def test_several_conversations_each_reuse_their_own_state(demo):
    """Alternating two conversations: with room for one sequence each request starts over;
    with room for both, each continues its own (and the ids do not change)."""
    a, b = two_conversations()
    figures = {}
    for name, gb in (("one", 0.0), ("both", 1.0)):
        eng = _engine(demo)
        try:
            backend = Backend(eng, "demo", Limits(), cache=PromptCache(eng, int(gb * 1e9)))
            runs = [ask(backend, h) for h in (a, b, a, b)]
        finally:
            eng.close()
        figures[name] = [(s.reused, d.ext["ids"]) for s, d in runs]
    print(f"[gate] prompt cache, alternating A B A B: reused with one kept sequence "
          f"{[r for r, _ in figures['one']]}, with two {[r for r, _ in figures['both']]}")
    assert [r for r, _ in figures["one"]] == [0, 0, 0, 0]
    assert figures["both"][2][0] > 0 and figures["both"][3][0] > 0
    assert [i for _, i in figures["one"]] == [i for _, i in figures["both"]]


def test_a_restart_continues_from_the_state_on_disk(tmp_path):
    """A three-request conversation on the trained demo (its replies close) with a restart
    between requests 2 and 3: request 3 reads its prefix from request 2's state file;
    cached positions reported, the ids equal a fresh full prefill's."""
    from k3engine.tools.demo import shipped_dir
    model = shipped_dir()
    d = str(tmp_path / "cache")

    def engine():
        return open_engine(load_spec_from(model, tok_dir=model, incremental=True), gen=64)

    def conv_ask(backend, history, gen_thinking=False):
        posted = []
        req = GenRequest(kind="chat", model="demo", gen=64,
                         sampling=SamplingIn(None, None, None, None, True), stops=(),
                         stream=False, include_usage=True, history=History(list(history)),
                         thinking=gen_thinking)
        backend.execute(Job(req, posted.append))
        text = "".join(p.text for p in posted if getattr(p, "kind", None) == "content")
        return (next(p for p in posted if isinstance(p, Started)),
                next(p for p in posted if isinstance(p, Done)), text)
    h = [Message("user", "Hello!")]
    eng = engine()
    try:
        backend = Backend(eng, "demo", Limits(), cache=PromptCache(eng, 0, d))
        for follow in ("What is 3 plus 4?", "And 2 plus 2?"):
            _, done, text = conv_ask(backend, h)
            assert done.finish == "stop", "the trained demo closes its replies"
            h += [Message("assistant", text), Message("user", follow)]
    finally:
        eng.close()
    files = [f for f in os.listdir(d) if f.endswith(SUFFIX)]
    assert files and all(os.stat(os.path.join(d, f)).st_mode & 0o777 == 0o600 for f in files)
    assert os.stat(d).st_mode & 0o777 == 0o700
    timings = {}
    for name, folder in (("restarted", d), ("no cache", None)):
        eng = engine()                                   # a new process's engine
        try:
            cache = PromptCache(eng, 0, folder)
            started, done, _ = conv_ask(Backend(eng, "demo", Limits(), cache=cache), h)
            timings[name] = (started.reused, done.ext["ttft_s"], done.ext["ids"], cache.loads)
        finally:
            eng.close()
    (r1, t1, ids1, loads), (r0, t0, ids0, _) = timings["restarted"], timings["no cache"]
    print(f"[gate] request 3 after a restart: {r1} of {started.prompt_ids} positions from "
          f"disk (time to first token {t1:.3f} s) vs none without the cache ({t0:.3f} s); "
          f"ids equal a fresh full prefill: {ids1 == ids0}")
    assert loads == 1 and r1 > 0 and r0 == 0 and ids1 == ids0


def test_a_damaged_state_file_is_deleted_not_trusted(demo, tmp_path):
    """A prompt that extends a saved sequence loads it; the same file with one flipped
    payload byte is refused by the state file's hash, deleted, and the request starts over."""
    a, _ = two_conversations()
    d = str(tmp_path / "cache")
    eng = _engine(demo)
    try:
        cache = PromptCache(eng, 0, d)
        ask(Backend(eng, "demo", Limits(), cache=cache), a)
        fed = cache.kept[0].ids[:cache.kept[0].position]
        path = os.path.join(d, os.listdir(d)[0])
        good = PromptCache(eng, 0, d).take(fed + [7, 8])
        with open(path, "r+b") as f:                  # one flipped byte in the payload
            f.seek(os.path.getsize(path) - 100)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
        bad_cache = PromptCache(eng, 0, d)
        bad = bad_cache.take(fed + [7, 8])
    finally:
        eng.close()
    print(f"[gate] state file for {len(fed)} fed positions: intact -> {good.position} "
          f"positions loaded; one byte flipped -> {bad.position} loaded, file left "
          f"{os.path.exists(path)}")
    assert good.position == len(fed) and good.ids[:len(fed)] == fed
    assert bad.position == 0 and bad_cache.loads == 0 and not os.path.exists(path)


def test_the_folder_keeps_within_its_cap(demo, tmp_path):
    a, b = two_conversations()
    d = str(tmp_path / "cache")
    eng = _engine(demo)
    try:
        one = PromptCache(eng, 0, d)
        ask(Backend(eng, "demo", Limits(), cache=one), a)
        size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
        time.sleep(0.01)
        capped = PromptCache(eng, 0, d, disk_bytes=size + size // 2)
        ask(Backend(eng, "demo", Limits(), cache=capped), b)
    finally:
        eng.close()
    left = os.listdir(d)
    print(f"[gate] cap {size + size // 2} B: {len(left)} state file(s) left of 2 written")
    assert len(left) == 1


def test_serve_reports_cached_tokens_across_a_restart(tmp_path):
    """`k3 serve --prompt-cache-dir` on the trained demo: the conversation's second request,
    sent to a restarted server, reports cached prompt tokens through the official client and
    answers as a server without the cache does."""
    from openai import OpenAI
    from k3engine.tools.demo import shipped_dir
    model = shipped_dir()
    d = str(tmp_path / "cache")
    msgs = [{"role": "user", "content": "Hello!"}]

    def chat(*flags):
        with serve(model, "--tok", model, "--gen", "64", "--accept-any-model", *flags) as s:
            return OpenAI(base_url=s.base_url, api_key="none").chat.completions.create(
                model="demo", messages=msgs, max_tokens=64,
                reasoning_effort="none")
    first = chat("--prompt-cache-dir", d)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "What is 3 plus 4?"}]
    cached = chat("--prompt-cache-dir", d)
    plain = chat()

    def n_cached(r):
        return r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details \
            else 0
    print(f"[gate] k3 serve restarted: request 2 cached prompt tokens {n_cached(cached)} of "
          f"{cached.usage.prompt_tokens} (without the cache: {n_cached(plain)}); same answer "
          f"{cached.choices[0].message.content == plain.choices[0].message.content}")
    assert first.choices[0].finish_reason == "stop"
    assert n_cached(cached) > 0 and n_cached(plain) == 0
    assert cached.choices[0].message.content == plain.choices[0].message.content


def test_a_request_resent_after_its_client_left_mid_prefill_continues(demo):
    """The client leaves during the prompt pass (Cancel.leave, what a disconnect sets): the
    pass completes and is kept; the same request sent again starts decoding at once (every
    prompt position reused) with the ids a run never interrupted gives."""
    eng = _engine(demo)
    h = [Message("system", "Be brief."),
         Message("user", " ".join(f"word{i}" for i in range(300)))]
    try:
        backend = Backend(eng, "demo", Limits(), cache=PromptCache(eng, 0))
        posted = []
        req = GenRequest(kind="chat", model="demo", gen=8,
                         sampling=SamplingIn(None, None, None, None, True), stops=(),
                         stream=True, include_usage=True, history=History(list(h)))
        job = Job(req, posted.append)

        def post(item):
            posted.append(item)
            if type(item).__name__ == "Progress":
                job.cancel.leave()                  # the client disconnects mid-pass
        job.post = post
        backend.execute(job)
        left = next(p for p in posted if isinstance(p, Done))
        resent = ask(backend, h)
        fresh = ask(Backend(eng, "demo", Limits(), cache=PromptCache(eng, 0)), h)
    finally:
        eng.close()
    print(f"[gate] left mid-prefill: finish {left.finish}, {len(left.ext['ids'])} ids; "
          f"resent: {resent[0].reused} of {resent[0].prompt_ids} positions reused, time to "
          f"first token {resent[1].ext['ttft_s']:.4f} s vs {fresh[1].ext['ttft_s']:.4f} s "
          f"fresh; ids equal: {resent[1].ext['ids'] == fresh[1].ext['ids']}")
    assert left.finish == "cancelled" and left.ext["ids"] == []
    assert resent[0].reused == resent[0].prompt_ids > 256
    assert resent[1].ext["ids"] == fresh[1].ext["ids"]


def test_k3_serve_continues_a_request_resent_after_a_disconnect(demo):
    """Over HTTP: a streamed request is dropped by its client during the prompt pass (after
    its first progress comment) and sent again; the resent one reports every prompt token
    cached and answers with the ids of an uninterrupted request."""
    import http.client
    import json
    import time as clock
    from urllib.parse import urlparse
    # a prompt pass of a few seconds: the client leaves during it however slow the machine
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": " ".join(f"word{i}" for i in range(1500))}]
    body = {"model": "demo", "messages": msgs, "max_tokens": 8, "stream": True}
    with serve(demo, "--tok", demo, "--gen", "8", "--accept-any-model",
               "--sse-keepalive", "0.2") as s:
        u = urlparse(s.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        seen = b""
        t0 = clock.monotonic()
        while b": k3" not in seen and clock.monotonic() - t0 < 60:
            seen += r.read1(256)
        conn.close()                                 # the client leaves mid-pass
        s.wait_idle()
        t0 = clock.monotonic()
        from openai import OpenAI
        client = OpenAI(base_url=s.base_url, api_key="none")
        resent = client.chat.completions.create(model="demo", messages=msgs, max_tokens=8)
        resent_s = clock.monotonic() - t0
        t0 = clock.monotonic()
        msgs2 = [msgs[0], {"role": "user", "content": msgs[1]["content"] + " again"}]
        fresh = client.chat.completions.create(model="demo", messages=msgs2, max_tokens=8)
        fresh_s = clock.monotonic() - t0
    cached = resent.usage.prompt_tokens_details.cached_tokens
    print(f"[gate] resent after a disconnect mid-prefill: {cached} of "
          f"{resent.usage.prompt_tokens} prompt tokens cached, answered in {resent_s:.2f} s; "
          f"a new prompt of the same length took {fresh_s:.2f} s")
    assert b": k3" in seen and cached == resent.usage.prompt_tokens
