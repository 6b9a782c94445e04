"""A bounded load test of `k3 serve` on loopback (measured, not asserted).

    python benchmarks/bench_serve_load.py [--clients 8] [--requests 20] [--model DIR]
                                          [--parallel N]

Starts `k3 serve` on a generated demo model (or --model) with a small queue, then runs N
clients x M requests through the official `openai` client: most non-streamed, some streamed
to the end, some streams abandoned after two chunks (the client disconnects).  Every request
must end as answered (its greedy ids equal the ids the same prompt gave when the server was
idle: nothing crossed between requests, whatever state was reused), refused with 429 and a
Retry-After, or abandoned by the client; anything else is counted as an error, and a request
that never came back as lost.  The server's RSS is sampled throughout.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

PROMPTS = ["Hello", "What is a disk?", "Count to three.", "Name a colour.",
           "Why is the sky blue?", "Say something short."]
MAX_TOKENS = 6


def main() -> int:
    import openai
    from serve_helpers import make_demo, serve
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--queue", type=int, default=4)
    ap.add_argument("--parallel", type=int, default=1,
                    help="k3 serve --parallel: requests decoded together")
    ap.add_argument("--model", help="model dir (default: a generated demo model)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model
        if model is None:
            model = make_demo(os.path.join(tmp, "demo"))
        with serve(model, "--queue", str(a.queue), "--gen", "64",
                   "--parallel", str(a.parallel)) as srv:
            return run_load(srv, a, openai)


def run_load(srv, a, openai) -> int:
    def client():
        return openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0,
                             timeout=600)

    def ask(c, prompt, **kw):
        return c.chat.completions.create(model=c_model, messages=[{"role": "user",
                                                                   "content": prompt}],
                                         max_tokens=MAX_TOKENS, reasoning_effort="none", **kw)
    c0 = client()
    c_model = c0.models.list().data[0].id
    expected = {p: ask(c0, p).model_extra["k3"]["ids"] for p in PROMPTS}   # idle, one by one
    rss: list[tuple[float, int]] = []
    done = threading.Event()
    t_start = time.monotonic()

    def sample():
        while not done.is_set():
            rss.append((time.monotonic() - t_start, srv.rss_bytes()))
            time.sleep(0.5)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    outcomes: Counter = Counter()
    errors: list[str] = []
    lock = threading.Lock()

    def worker(w: int):
        c = client()
        for i in range(a.requests):
            prompt = PROMPTS[(w * 7 + i) % len(PROMPTS)]
            mode = ("abandon", "stream", "plain", "plain")[(w + i) % 4]
            try:
                if mode == "abandon":
                    s = ask(c, prompt, stream=True)
                    it = iter(s)
                    next(it), next(it)
                    s.close()
                    kind = "abandoned"
                elif mode == "stream":
                    chunks = list(ask(c, prompt, stream=True,
                                      stream_options={"include_usage": True}))
                    ids = chunks[-1].model_extra["k3"]["ids"]
                    kind = "answered" if ids == expected[prompt] else "crossed"
                else:
                    r = ask(c, prompt)
                    kind = "answered" if r.model_extra["k3"]["ids"] == expected[prompt] \
                        else "crossed"
            except openai.RateLimitError as e:
                kind = "refused_429" if e.response.headers.get("retry-after") else "429_no_retry"
                time.sleep(0.05)
            except Exception as e:                      # noqa: BLE001 (counted and shown)
                kind = "error"
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
            with lock:
                outcomes[kind] += 1
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    h = srv.wait_idle()
    done.set()
    sampler.join()
    wall = time.monotonic() - t_start
    total = a.clients * a.requests
    accounted = sum(outcomes.values())
    print(f"k3 serve load test: {a.clients} clients x {a.requests} requests = {total}, "
          f"queue {a.queue}, --parallel {a.parallel}, max_tokens {MAX_TOKENS}, {wall:.1f} s wall "
          f"(on a shared 2-core machine: times are under load)")
    for k in ("answered", "abandoned", "refused_429", "crossed", "429_no_retry", "error"):
        print(f"  {k:<13} {outcomes.get(k, 0)}")
    print(f"  lost          {total - accounted}")
    print(f"  server counts {dict((k, h[k]) for k in ('answered', 'cancelled', 'refused_busy', 'failed'))}")
    mb = [b / 2**20 for _, b in rss]
    if mb:
        q = len(mb) // 4 or 1
        print(f"  server RSS MB: first {mb[0]:.1f}, min {min(mb):.1f}, max {max(mb):.1f}, "
              f"last {mb[-1]:.1f}; mean of first quarter {sum(mb[:q]) / q:.1f}, "
              f"last quarter {sum(mb[-q:]) / q:.1f} ({len(mb)} samples, every 0.5 s)")
    for e in errors[:5]:
        print("  error:", e)
    bad = outcomes.get("crossed", 0) + outcomes.get("error", 0) + \
        outcomes.get("429_no_retry", 0) + (total - accounted)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
