"""The server's prompt cache across a restart, measured (never asserted).

A three-request conversation on the trained demo (its replies close): requests 1 and 2 on
one engine with `--prompt-cache-dir`, then a new engine (a restarted server) answers request
3, once reading its prefix from disk and once without the cache, alternated, `--reps` times.
Prints the median time from request 3 to its first text each way (the state file's load
included), the positions read from disk, and whether the ids agree.

    python benchmarks/bench_prompt_cache.py [--model DIR] [--reps 3] [--trunk-gb X]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from k3engine.chat import History, Message
from k3engine.engine import load_spec_from, open_engine
from k3engine.prompt_cache import PromptCache
from k3engine.server.engine import Backend, Delta, Done, Job, Started
from k3engine.server.protocol import GenRequest, Limits, SamplingIn
from k3engine.tools.demo import ready_dir

FOLLOW = ("What is 3 plus 4?", "And what day comes after Monday?")


def engine(model: str, trunk_gb: float | None):
    memory = [] if trunk_gb is None else [("--trunk-gb", trunk_gb), ("--cache-gb", 0.01)]
    trunk = os.path.join(model, "trunk") if trunk_gb is not None else None
    return open_engine(load_spec_from(model, memory, tok_dir=model, trunk_dir=trunk,
                                      incremental=True), gen=96)


def ask(backend: Backend, history: list[Message]):
    """(Started, Done, reply text, seconds from the request to its first text): the time a
    client waits, the state file's load included."""
    posted, first = [], []
    req = GenRequest(kind="chat", model="demo", gen=96,
                     sampling=SamplingIn(None, None, None, None, True), stops=(),
                     stream=False, include_usage=True, history=History(list(history)),
                     thinking=False)

    def post(item):
        if isinstance(item, Delta) and not first:
            first.append(time.monotonic())
        posted.append(item)
    t0 = time.monotonic()
    backend.execute(Job(req, post))
    text = "".join(p.text for p in posted if isinstance(p, Delta) and p.kind == "content")
    return (next(p for p in posted if isinstance(p, Started)),
            next(p for p in posted if isinstance(p, Done)), text, first[0] - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the trained demo (k3 demo --path)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--trunk-gb", type=float, default=None,
                    help="stream the trunk with this budget (default: resident)")
    a = ap.parse_args(argv)
    model = a.model or ready_dir()
    runs = {"disk": [], "none": []}
    for rep in range(a.reps):
        with tempfile.TemporaryDirectory() as d:
            eng = engine(model, a.trunk_gb)
            h = [Message("user", "Hello!")]
            try:
                backend = Backend(eng, "demo", Limits(), cache=PromptCache(eng, 0, d))
                for follow in FOLLOW:
                    _, done, text, _ = ask(backend, h)
                    h += [Message("assistant", text), Message("user", follow)]
            finally:
                eng.close()
            order = ("disk", "none") if rep % 2 == 0 else ("none", "disk")
            for name in order:                        # alternated, each a fresh engine
                eng = engine(model, a.trunk_gb)
                try:
                    cache = PromptCache(eng, 0, d if name == "disk" else None)
                    started, done, _, wait = ask(Backend(eng, "demo", Limits(), cache=cache),
                                                 h)
                finally:
                    eng.close()
                runs[name].append((wait, started.reused, started.prompt_ids,
                                   done.ext["ids"]))
    for name in ("disk", "none"):
        t = statistics.median(r[0] for r in runs[name])
        print(f"request 3, {'from the disk cache' if name == 'disk' else 'no cache':>19}: "
              f"to the first text median {t:.4f} s over {a.reps} "
              f"({', '.join(f'{r[0]:.4f}' for r in runs[name])}); "
              f"{runs[name][0][1]} of {runs[name][0][2]} positions reused")
    same = all(d[3] == n[3] for d, n in zip(runs["disk"], runs["none"]))
    print(f"ids equal with and without the cache: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
