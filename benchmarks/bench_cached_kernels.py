"""The matvec kernels' compute rate, weights resident in L2 or L3 (a script, not a test).

bench_kernels.py streams every call's weights from DRAM, so on a host whose memory bandwidth
moves from run to run (docs/benchmarks-engine.md, Zen 4) a change to a kernel's instructions
hides in that spread.  Here one small matrix is called over and over, so the figure is the
core's widening + FMA rate, the bound a kernel meets once the reads keep up.  Weights and
inputs are bench_kernels' own (normal BF16 patterns, random nibbles and scales).

A/B two builds by alternating them (each tree built with `python setup.py build_ext
--inplace`, as docs/benchmarks-engine.md describes):

    for i in 1 2 3; do for t in /tmp/base/engine /work/main/engine; do
        PYTHONPATH=$t python benchmarks/bench_cached_kernels.py; done; done
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench_kernels import call_for, make_weights
from k3engine import kernels as K

# (rows, cols): ~0.3 MB stays in a 1 MB L2 as BF16, ~3.7 MB in L3
SHAPES = ((64, 2048), (256, 7168))


def rate(kind: str, rows: int, cols: int, T: int, repeat: int, r) -> float:
    """Median G multiply-adds/s over `repeat` timings of enough calls for ~0.1 G madds."""
    call = call_for(kind, make_weights(r, kind, rows, cols))
    X = r.standard_normal((T, cols), dtype=np.float32)
    Y = np.empty((T, rows), dtype=np.float32)
    calls = max(1, int(1e8 // (rows * cols * T)))
    call(X, Y)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(calls):
            call(X, Y)
        times.append((time.perf_counter() - t0) / calls)
    return rows * cols * T / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="bf16", help="bf16,f32,i8r,mxfp4")
    ap.add_argument("--tokens", default="1,2,4")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    K.set_num_threads(a.threads)
    r = np.random.default_rng(1)
    cells = []
    for kind in a.kinds.split(","):
        for rows, cols in SHAPES:
            for T in map(int, a.tokens.split(",")):
                cells.append(f"{kind} {rows}x{cols} T={T}: "
                             f"{rate(kind, rows, cols, T, a.repeat, r):.2f}")
    print(f"{K.__file__} | path {K.isa()} | threads {a.threads} | G multiply-adds/s | "
          + " | ".join(cells))


if __name__ == "__main__":
    main()
