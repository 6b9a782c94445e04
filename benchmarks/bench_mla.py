"""MLA attention's time against the context (a script, not a test).

A decode step's token attends to every cached position, so its `mla_attention` call grows
with the context, and a prefill's grows with the square of the prompt.  This times both at
mid's head shape (16 heads, nope 128, rope 64, value 128; `--heads` for K3's 64) on a random
cache in the state's layout (state.MLAState: key blocks, value planes), and prints a CRC-32
of each output's bits so two builds of one layout can be checked equal:

    for i in 1 2 3; do for t in /tmp/base/engine /work/main/engine; do
        PYTHONPATH=$t python benchmarks/bench_mla.py; done; done
"""
from __future__ import annotations

import argparse
import statistics
import time
import zlib

import numpy as np

from k3engine import kernels as K
from k3engine.state import MLAState

DN, DR, DV = 128, 64, 128
# (new tokens, cached positions before them): decode steps at growing contexts, then prefills
CASES = ((1, 1023), (1, 4095), (1, 8191), (1, 16383), (1, 32767), (512, 0), (512, 2048),
         (512, 7680), (2048, 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="2", help="comma-separated thread counts")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=9, help="timed calls per decode case")
    a = ap.parse_args()
    H = a.heads
    r = np.random.default_rng(5)
    cap = max(t + p for t, p in CASES)
    Kb, Vc, Rb = (r.standard_normal(shape, dtype=np.float32)      # the state's layout
                  for shape in MLAState.shapes(H, DN, DV, DR, cap).values())
    print(f"kernels {K.__file__}, path {K.isa()}, heads {H}, "
          f"cache {(Kb.nbytes + Vc.nbytes) / 1e6:.0f} MB")
    for nt in (int(x) for x in a.threads.split(",")):
        K.set_num_threads(nt)
        for T, past in CASES:
            Q = r.standard_normal((T, H * (DN + DR)), dtype=np.float32) * np.float32(0.1)
            O = np.empty((T, H * DV), np.float32)
            times = []
            for _ in range(a.repeat if T == 1 else 3):
                t0 = time.perf_counter()
                K.mla_attention(Q, Kb, Vc, Rb, past, O)
                times.append(time.perf_counter() - t0)
            print(f"  {nt} thread(s) T={T:5d} over {past + T:6d} positions: "
                  f"{statistics.median(times) * 1e3:9.2f} ms (median of {len(times)}), "
                  f"bits crc32 {zlib.crc32(O.tobytes()):08x}")


if __name__ == "__main__":
    main()
