"""A 2-thread matvec while another process holds one CPU (a script, not a test; figures
are reported, never asserted).

    python benchmarks/bench_contention.py [--repeat 15] [--threads 2]

A desktop is rarely idle.  With a static split of the rows, a matvec waits for the thread
whose CPU was taken; with the dynamic split the kernels use, the other threads take its
rows.  This times a BF16 12288x7168 matvec at --threads on a quiet machine, then with a
busy loop pinned to the last CPU (os.sched_setaffinity), and prints both medians.  Rebuild
with schedule="static" in kernels/_kernels.pyx to compare (the bits are the same either
way: a row's sum does not depend on which thread computes it).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

from k3engine import kernels as K


def busy(cpu: int, seconds: float) -> None:
    os.sched_setaffinity(0, {cpu})
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def timed(W, X, Y, repeat: int) -> list[float]:
    for _ in range(3):
        K.matvec(W, X, Y)
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        K.matvec(W, X, Y)
        out.append(time.perf_counter() - t)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    W = (rng.standard_normal((12288, 7168)).astype(np.float32).view(np.uint32) >> 16
         ).astype(np.uint16)
    X = rng.standard_normal((1, 7168)).astype(np.float32)
    Y = np.empty((1, 12288), np.float32)
    K.set_num_threads(a.threads)
    quiet = timed(W, X, Y, a.repeat)
    cpu = max(os.sched_getaffinity(0))
    p = mp.Process(target=busy, args=(cpu, 60.0), daemon=True)
    p.start()
    time.sleep(0.5)
    loaded = timed(W, X, Y, a.repeat)
    p.terminate()
    for name, ts in (("quiet", quiet), (f"CPU {cpu} held by a busy loop", loaded)):
        print(f"BF16 12288x7168, {a.threads} threads, {name}: median "
              f"{1000 * statistics.median(ts):.2f} ms, min {1000 * min(ts):.2f} ms "
              f"({a.repeat} calls)")
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
