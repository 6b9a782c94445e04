#!/usr/bin/env python
"""The integer path of one- and two-token MXFP4 matvecs (k3mxint.h) against the double path,
A/B in one process (a script, not a test; figures are reported, never asserted).

    python benchmarks/bench_mxfp4_int.py [--reps 5] [--threads 1,2] [--mb 200] [--tokens 1,2,4]

For each shape it times `mxfp4_matvec` of T tokens (--tokens; the path takes 1..7) with the
path on and off, alternated
`--reps` times, over enough copies of the weights (`--mb`) that every call reads them from
DRAM, as the engine's expert cache does; then a decode step's `moe_experts` batch (16 K3
experts, 8 mid experts) the same way.  The input is Gaussian (digit planes 4-5 per group,
all groups exact); the outputs are compared bit for bit between the two paths.  Median ms
per call, G multiply-adds/s, the ratio, and the range over the alternations.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np

from k3engine import kernels as K
from k3engine.weights import MXFP4, ExpertWeights

MATVEC_SHAPES = [(3072, 3584), (3584, 3072), (1536, 1024), (1024, 1536)]
MOE = {"K3": (16, 3584, 3072), "mid": (8, 1024, 1536)}     # experts, latent, width


def rand_mxfp4(r, rows: int, n: int) -> MXFP4:
    return MXFP4(r.integers(0, 256, (rows, n // 2), dtype=np.uint8),
                 r.integers(118, 130, (rows, n // 32), dtype=np.uint8))


def ab(run_one, copies: int, out: np.ndarray, reps: int) -> tuple[dict, dict]:
    """{on: [median seconds per round]} and {on: output} for the path on and off; a round
    calls run_one(i) for i over 3 x `copies` (each a different copy of the weights)."""
    res, outs = {True: [], False: []}, {}
    for _ in range(reps):
        for on in (True, False):
            K.set_mxq(on)
            ts = []
            for i in range(3 * copies):
                t = time.perf_counter()
                run_one(i % copies)
                ts.append(time.perf_counter() - t)
            res[on].append(statistics.median(ts))
            outs[on] = out.copy()
    K.set_mxq(True)
    return res, outs


def report(label: str, work: int, res: dict, out: dict) -> None:
    a, b = statistics.median(res[True]), statistics.median(res[False])
    same = out[True].tobytes() == out[False].tobytes()
    print(f"{label}: integer {a * 1e3:.3f} ms ({work / a / 1e9:.1f} G) double {b * 1e3:.3f} ms "
          f"({work / b / 1e9:.1f} G) {b / a:.2f}x [integer {min(res[True]) * 1e3:.3f}-"
          f"{max(res[True]) * 1e3:.3f}, double {min(res[False]) * 1e3:.3f}-"
          f"{max(res[False]) * 1e3:.3f}] bits equal: {same}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--mb", type=float, default=200.0, help="weights rotated over, MB")
    ap.add_argument("--tokens", default="1", help="comma-separated T for the matvec rows")
    ap.add_argument("--no-moe", action="store_true", help="only the matvec rows")
    args = ap.parse_args()
    if not K.mxq_supported():
        raise SystemExit("this CPU lacks AVX-512 VNNI/VBMI/CD: the integer path never runs")
    print(f"machine: {platform.processor() or platform.machine()}, kernels {K.isa()}")
    r = np.random.default_rng(7)
    nts = [int(t) for t in args.threads.split(",")]
    for (rows, n), T in ((shape, int(t)) for shape in MATVEC_SHAPES
                         for t in args.tokens.split(",")):
        copies = max(2, int(args.mb * 1e6 // (rows * n // 2)))
        mats = [rand_mxfp4(r, rows, n) for _ in range(copies)]
        X = r.standard_normal((T, n), dtype=np.float32)
        Y = np.empty((T, rows), np.float32)

        def matvec(i, X=X, Y=Y, mats=mats):
            K.mxfp4_matvec(mats[i].packed, mats[i].scales, X, Y)
        for nt in nts:
            K.set_num_threads(nt)
            report(f"mxfp4_matvec {rows}x{n} T={T} {nt}t", rows * n * T,
                   *ab(matvec, copies, Y, args.reps))
    for name, (k, L, inter) in ([] if args.no_moe else MOE.items()):
        sets = max(2, int(args.mb * 1e6 // (3 * inter * L // 2 * k)))
        experts = [{e: ExpertWeights(rand_mxfp4(r, inter, L), rand_mxfp4(r, inter, L),
                                     rand_mxfp4(r, L, inter)) for e in range(k)}
                   for _ in range(sets)]
        Z = r.standard_normal((1, L), dtype=np.float32)
        starts, token = np.empty(k + 1, np.int32), np.empty(k, np.int32)
        S = K.moe_groups(np.arange(k, dtype=np.int32)[None, :], np.full(1, k, np.int32), k,
                         starts, token, np.empty((1, k), np.int32))
        D = np.empty((S, L), np.float32)

        def batch(i, k=k, experts=experts, Z=Z, token=token, starts=starts, D=D):
            K.moe_experts([(e, experts[i][e]) for e in range(k)], Z, token, starts,
                          np.float32(4.0), np.float32(25.0), D)
        for nt in nts:
            K.set_num_threads(nt)
            report(f"moe_experts {name} {k} x ({inter}x{L}, {inter}x{L}, {L}x{inter}) {nt}t",
                   k * inter * L * 3, *ab(batch, sets, D, args.reps))


if __name__ == "__main__":
    main()
