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
