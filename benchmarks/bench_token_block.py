#!/usr/bin/env python
"""What the row drivers' token blocks buy a prefill's matvecs (a script, not a test).

    python benchmarks/bench_token_block.py [--shapes 2048x2048,3072x2048,7168x7168]
                                           [--tokens 64,256] [--threads 1,2] [--repeat 9]

For each BF16 shape and token count it times `K.matvec` with the built-in token block
(inputs walked in blocks of 256 KiB of widened doubles) and with blocking off (one block:
every row pair walks all tokens), alternating the two in one process, checks the outputs
are bit-identical, and reports multiply-adds per second.
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

NO_BLOCKING = 1 << 40


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="2048x2048,3072x2048,7168x7168")
    ap.add_argument("--tokens", default="64,256")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeat", type=int, default=9)
    a = ap.parse_args(argv)
    r = np.random.default_rng(11)
    print(f"machine: {machine_info()}; load average {loadavg()}")
    ok = True
    for shape in a.shapes.split(","):
        rows, n = (int(v) for v in shape.split("x"))
        W = r.integers(0x3c00, 0x4000, (rows, n), dtype=np.uint16)
        for T in (int(t) for t in a.tokens.split(",")):
            X = r.standard_normal((T, n)).astype(np.float32)
            Y1, Y2 = np.empty((T, rows), np.float32), np.empty((T, rows), np.float32)
            for nt in (int(t) for t in a.threads.split(",")):
                K.set_num_threads(nt)
                times = {"blocked": [], "unblocked": []}
                for i in range(a.repeat + 1):
                    for name, nbytes, Y in (("blocked", 0, Y1), ("unblocked", NO_BLOCKING, Y2)):
                        K.set_token_block_bytes(nbytes)
                        t0 = time.perf_counter()
                        K.matvec(W, X, Y)
                        if i:                                  # the first pair warms up
                            times[name].append(time.perf_counter() - t0)
                K.set_token_block_bytes(0)
                same = bool(np.array_equal(Y1.view(np.uint32), Y2.view(np.uint32)))
                ok &= same
                med = {k: statistics.median(v) for k, v in times.items()}
                macs = rows * n * T
                print(f"bf16 {rows}x{n} T={T:<4d} threads {nt}: blocked "
                      f"{med['blocked'] * 1e3:8.2f} ms ({macs / med['blocked'] / 1e9:5.1f} G/s) | "
                      f"unblocked {med['unblocked'] * 1e3:8.2f} ms "
                      f"({macs / med['unblocked'] / 1e9:5.1f} G/s) | "
                      f"{med['unblocked'] / med['blocked']:.2f}x | bits equal: {same}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
