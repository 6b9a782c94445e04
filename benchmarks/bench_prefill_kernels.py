#!/usr/bin/env python
"""What the prefill paths of the matvec kernels buy (a script, not a test).

    python benchmarks/bench_prefill_kernels.py [--kinds bf16,f32,i8r,mxfp4]
        [--shapes 2048x2048,1024x2048,7168x7168] [--tokens 8,64,512] [--threads 1,2]
        [--repeat 9] [--compare panel,wide,block,mxdecode]

For each kind, shape (rows x inputs) and token count it alternates, in one process, the
built-in path against one switched off, checks the outputs are bit-identical, and reports
multiply-adds per second (median of --repeat pairs after a warm-up pair):

* panel: the panels of BF16, F32 and I8R on AVX2 or AVX-512 (T >= 5: a weight block
  widened once for up to 48 tokens) against the tiles (K.set_panel_min_tokens off); MXFP4
  has no panel;
* wide: what the CPU runs above 2,730 inputs (AMD's AVX-512: the tiles; K.set_panel_wide_tiles)
  against the panels;
* block: with the panels off, the tiles' L2-sized token blocks against none
  (K.set_token_block_bytes);
* mxdecode: AVX-512 MXFP4 with each group decoded once for all the call's tokens (T >= 8)
  against the 4-token tiles, which decode it per tile (K.set_mx_tokens_min off).

Weights are the same matrix each call (they stay in L3 at these shapes), as a prefill
reuses a layer's weights for every token of the prompt.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from k3engine import kernels as K

sys.path.insert(0, os.path.dirname(__file__))
from bench_kernels import loadavg, machine_info  # noqa: E402

OFF = 1 << 40
SWITCHES = {   # name: (set the path under test on or off, label on, label off)
    "panel": (lambda on: (K.set_token_block_bytes(0), K.set_panel_wide_tiles(0),
                          K.set_panel_min_tokens(0 if on else OFF)), "panel", "tiles"),
    "wide": (lambda on: (K.set_token_block_bytes(0), K.set_panel_min_tokens(0),
                         K.set_panel_wide_tiles(-1 if on else 0)), "CPU's choice", "panel"),
    "block": (lambda on: (K.set_panel_min_tokens(OFF), K.set_token_block_bytes(0 if on else OFF)),
              "blocked", "unblocked"),
    "mxdecode": (lambda on: K.set_mx_tokens_min(0 if on else OFF), "decoded once", "tiles"),
}


def weights(r, kind: str, rows: int, n: int):
    if kind == "bf16":
        return r.integers(0x3c00, 0x4000, (rows, n), dtype=np.uint16)
    if kind == "f32":
        return r.standard_normal((rows, n)).astype(np.float32)
    if kind == "i8r":
        return (r.integers(-128, 128, (rows, n)).astype(np.int8),
                (r.random(rows) + 0.01).astype(np.float32))
    return (r.integers(0, 256, (rows, n // 2), dtype=np.uint16).astype(np.uint8),
            r.integers(118, 125, (rows, n // 32), dtype=np.uint16).astype(np.uint8))


def call(kind: str, W, X, Y) -> None:
    if kind == "i8r":
        K.i8r_matvec(W[0], W[1], X, Y)
    elif kind == "mxfp4":
        K.mxfp4_matvec(W[0], W[1], X, Y)
    else:
        K.matvec(W, X, Y)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="bf16,f32,i8r")
    ap.add_argument("--shapes", default="2048x2048,1024x2048,7168x7168")
    ap.add_argument("--tokens", default="8,64,512")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--compare", default="panel", help="panel, wide, block and/or mxdecode")
    a = ap.parse_args(argv)
    r = np.random.default_rng(11)
    print(f"machine: {machine_info()}; kernel path {K.isa()}; load average {loadavg()}")
    ok = True
    for what in a.compare.split(","):
        switch, on_name, off_name = SWITCHES[what]
        for kind in a.kinds.split(","):
            for shape in a.shapes.split(","):
                rows, n = (int(v) for v in shape.split("x"))
                W = weights(r, kind, rows, n)
                for T in (int(t) for t in a.tokens.split(",")):
                    X = r.standard_normal((T, n)).astype(np.float32)
                    Ys = {on_name: np.empty((T, rows), np.float32),
                          off_name: np.empty((T, rows), np.float32)}
                    for nt in (int(t) for t in a.threads.split(",")):
                        K.set_num_threads(nt)
                        times: dict[str, list[float]] = {on_name: [], off_name: []}
                        for i in range(a.repeat + 1):
                            for name, on in ((on_name, True), (off_name, False)):
                                switch(on)
                                t0 = time.perf_counter()
                                call(kind, W, X, Ys[name])
                                if i:                          # the first pair warms up
                                    times[name].append(time.perf_counter() - t0)
                        same = bool(np.array_equal(Ys[on_name].view(np.uint32),
                                                   Ys[off_name].view(np.uint32)))
                        ok &= same
                        med = {k: statistics.median(v) for k, v in times.items()}
                        macs = rows * n * T
                        print(f"{kind:5s} {rows}x{n} T={T:<4d} threads {nt}: {on_name} "
                              f"{med[on_name] * 1e3:8.2f} ms ({macs / med[on_name] / 1e9:5.1f} G/s)"
                              f" | {off_name} {med[off_name] * 1e3:8.2f} ms "
                              f"({macs / med[off_name] / 1e9:5.1f} G/s) | "
                              f"{med[off_name] / med[on_name]:.2f}x | bits equal: {same}",
                              flush=True)
    switch(True)
    K.set_panel_min_tokens(0)
    K.set_token_block_bytes(0)
    K.set_mx_tokens_min(0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
