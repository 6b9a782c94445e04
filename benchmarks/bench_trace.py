"""The expert heat view's cost per refresh (issue: the app called np.unique over every
request since the session began, 12 s per call after 4,096 tokens at K3's 1,472 requests
per token).  A script, not a test: figures are printed, never asserted.

    python benchmarks/bench_trace.py [--requests 1000000] [--runs 5]

Records N requests with K3's shape (60 MoE layers x 896 experts, top-16 per token) into
experts.RequestTrace, then times counts_grid() (what the app's heat view calls now) and,
for comparison, the old path (np.unique over every kept pair), median of --runs.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np

from k3engine.experts import RequestTrace


def median_ms(fn, runs: int) -> float:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    L = rng.integers(1, 61, a.requests)
    e = rng.integers(0, 896, a.requests)
    t = RequestTrace(61, 896, keep_pairs=True)
    t0 = time.perf_counter()
    for li, ei in zip(L.tolist(), e.tolist()):
        t.record(li, ei)
    rec_s = time.perf_counter() - t0
    grid_ms = median_ms(t.counts_grid, a.runs)
    pairs = np.frombuffer(t.pairs, np.int32).reshape(-1, 2)
    unique_ms = median_ms(lambda: np.unique(pairs, axis=0, return_counts=True), a.runs)
    print(f"machine: {platform.processor() or platform.machine()}, {a.requests:,} requests")
    print(f"record: {1e9 * rec_s / a.requests:.0f} ns per request")
    print(f"heat refresh now (counts_grid): {grid_ms:.3f} ms per call (median of {a.runs})")
    print(f"old path (np.unique over every pair): {unique_ms:.1f} ms per call")
    print(f"memory: counts {t.counts.nbytes / 1e3:.0f} KB fixed; pairs "
          f"{len(t.pairs) * 4 / 1e6:.1f} MB (kept only for --dump-cache-trace)")


if __name__ == "__main__":
    main()
