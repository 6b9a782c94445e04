"""Batching through `k3 serve` (measured, never asserted): B clients send completions at
once to a server started with `--parallel` = the largest B, and the aggregate generated
tokens/s is timed from the first request to the last answer, for each B (alternated, `--reps`
times, median); the server's own step log (`GET /k3/steps`) gives the bytes read a generated
token.  Each B's answers are checked equal to the same prompts served one at a time.

    python benchmarks/bench_serve_batch.py MODEL [--trunk DIR] [--budget-args "--trunk-gb 0.5 --cache-gb 0.5"]
                                           [--sizes 1,2,4] [--gen 16] [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def main(argv=None) -> int:
    import openai
    from serve_helpers import serve
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--trunk", default=None)
    ap.add_argument("--budget-args", default="")
    ap.add_argument("--sizes", default="1,2,4")
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    sizes = [int(x) for x in a.sizes.split(",")]
    args = [*shlex.split(a.budget_args), "--parallel", str(max(sizes)), "--gen", str(a.gen),
            "--queue", str(max(sizes))] + (["--trunk", a.trunk] if a.trunk else [])
    prompts = [[(17 * b + 3 * i) % 3000 + 10 for i in range(32)] for b in range(max(sizes))]
    with serve(a.model, *args) as srv:
        c = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=3600)
        mid = c.models.list().data[0].id

        def ask(p):
            return c.completions.create(model=mid, prompt=p, max_tokens=a.gen,
                                        temperature=0).model_extra["k3"]["ids"]

        def steps_since(n):
            with urllib.request.urlopen(f"{srv.base_url[:-3]}/k3/steps?since={n}") as r:
                return json.loads(r.read())
        alone = [ask(p) for p in prompts]              # one at a time: the expected ids
        got = {B: [] for B in sizes}
        for rep in range(a.reps):
            for B in (sizes if rep % 2 == 0 else sizes[::-1]):
                first = steps_since(0)["next"]
                out = [None] * B
                threads = [threading.Thread(target=lambda b=b: out.__setitem__(b, ask(prompts[b])))
                           for b in range(B)]
                t0 = time.monotonic()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                wall = time.monotonic() - t0
                log = steps_since(first)["steps"]
                tokens = sum(len(o) for o in out)
                read = sum(s["trunk_bytes"] + s["expert_bytes"] for s in log)
                equal = out == alone[:B]
                got[B].append((tokens / wall, read / tokens, equal,
                               max((s["batch"] for s in log), default=0)))
    base = statistics.median(r[0] for r in got[sizes[0]])
    print(f"k3 serve {os.path.basename(a.model.rstrip('/'))} '{a.budget_args or 'resident'}', "
          f"--parallel {max(sizes)}, 32-id prompts, {a.gen} tokens each, median of {a.reps}")
    for B in sizes:
        rate = statistics.median(r[0] for r in got[B])
        per = statistics.median(r[1] for r in got[B])
        print(f"  B={B} clients: {rate:7.2f} tokens/s in all ({rate / base:.2f}x), "
              f"{per / 1e6:8.1f} MB read a generated token, largest batch "
              f"{max(r[3] for r in got[B])}, answers equal to one at a time: "
              f"{all(r[2] for r in got[B])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
