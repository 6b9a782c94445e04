"""`k3 serve --parallel N` (continuous batching): concurrent requests share the engine's steps,
each answered with the ids it gets served alone; requests beyond N wait, not refused; a
client that leaves mid-stream leaves the batch and the others go on."""
from __future__ import annotations

import threading

import pytest

from serve_helpers import make_demo, open_stream, serve

PROMPTS = ["Tell me about the moon", "Name a colour", "Count to ten",
           "What is 3 plus 4?", "Hello!", "Write a haiku about the sea"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return make_demo(str(tmp_path_factory.mktemp("sb") / "demo"))


def ask(base_url: str, prompt: str, gen: int, completion: bool = False):
    from openai import OpenAI
    client = OpenAI(base_url=base_url, api_key="none", max_retries=0)
    if completion:
        r = client.completions.create(model="demo", prompt=prompt, max_tokens=gen)
    else:
        r = client.chat.completions.create(
            model="demo", max_tokens=gen,
            messages=[{"role": "user", "content": prompt}])
    return r.model_extra["k3"]["ids"]


def concurrently(base_url, jobs):
    out = [None] * len(jobs)
    errors = []

    def go(i, job):
        try:
            out[i] = ask(base_url, *job)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=go, args=(i, j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return out


def test_parallel_requests_equal_each_served_alone(demo):
    jobs = [(p, 6 + i, i % 3 == 2) for i, p in enumerate(PROMPTS)]
    with serve(demo, "--tok", demo, "--accept-any-model", "--gen", "16") as s:
        alone = [ask(s.base_url, *j) for j in jobs]
    with serve(demo, "--tok", demo, "--accept-any-model", "--gen", "16",
               "--parallel", "4", "--queue", "8") as s:
        together = concurrently(s.base_url, jobs)
        h = s.wait_idle()
    print(f"[gate] --parallel 4, {len(jobs)} concurrent requests (chat and completions, "
          f"6-11 tokens): ids equal each served alone {together == alone}; /health slots "
          f"{h.get('slots')}, answered {h['answered']}")
    assert together == alone
    assert h["slots"] == 4 and h["answered"] == len(jobs) and h["slots_busy"] == 0


def test_a_client_leaving_mid_stream_leaves_the_batch(demo):
    # 2,000 tokens of a model that never closes its replies: the client leaves mid-stream
    # however slow the machine is
    with serve(demo, "--tok", demo, "--accept-any-model", "--gen", "2000",
               "--parallel", "2") as s:
        conn, _ = open_stream(s)
        other = {}
        t = threading.Thread(target=lambda: other.setdefault(
            "ids", ask(s.base_url, "Name a colour", 8)))
        t.start()
        conn.close()                                   # leaves mid-stream
        t.join(300)
        h = s.wait_idle()
    print(f"[gate] --parallel 2: a client left mid-stream; the other request answered "
          f"{len(other.get('ids', []))} ids; cancelled {h['cancelled']}, answered "
          f"{h['answered']}")
    assert len(other["ids"]) == 8 and h["cancelled"] >= 1


def test_a_batch_that_never_empties_holds_no_finished_request(demo):
    """While one long request keeps the batch running, twenty short ones come and go:
    afterwards the engine thread holds no sequence of a finished request (a map from runs
    to their slots kept every one: the server grew 104 -> 419 MB over 640 requests in
    bench_serve_load.py until it was pruned at each step boundary)."""
    import gc
    import time
    from k3engine.engine import load_spec_from, open_engine
    from k3engine.sequence import Sequence
    from k3engine.server.batching import BatchingEngineThread
    from k3engine.server.engine import Backend, Done, Job
    from k3engine.server.protocol import GenRequest, Limits, SamplingIn

    def job(text: str, gen: int, done: list) -> Job:
        req = GenRequest("completion", model="demo", gen=gen,
                         sampling=SamplingIn(None, None, None, None, True), stops=(),
                         stream=False, include_usage=True, prompt=text)
        return Job(req, lambda item: done.append(item) if isinstance(item, Done) else None)

    eng = open_engine(load_spec_from(demo, tok_dir=demo, incremental=True, sequences=2),
                      gen=2 * 600)
    backend = Backend(eng, "demo", Limits())
    thread = BatchingEngineThread(backend, queue=64, parallel=2)
    try:
        long_done, short_done = [], []
        long_job = job("Tell me a long story", 500, long_done)
        thread.submit(long_job)
        for i in range(20):
            thread.submit(job(f"Count to {i}", 3, short_done))
        end = time.monotonic() + 300
        while len(short_done) < 20 and time.monotonic() < end:
            time.sleep(0.05)
        assert len(short_done) == 20 and not long_done, "the long request must still run"
        gc.collect()
        live = sum(isinstance(o, Sequence) for o in gc.get_objects())
        kept = len(backend.cache.kept)
        print(f"[gate] batch kept running: 20 short requests answered, {live} sequences "
              f"alive (the running one, the prompt cache's {kept})")
        assert live <= 1 + kept + 1
        long_job.cancel.set()
        while not long_done and time.monotonic() < end:
            time.sleep(0.05)
    finally:
        thread.close()
        backend.close()
