#!/usr/bin/env python
"""One MoE layer's routed experts: the batch kernel against the per-expert calls it replaced
(a script, not a test).

    python benchmarks/bench_moe_batch.py [--inter 1536] [--latent 1024] [--experts 128]
                                         [--topk 8] [--tokens 1,64] [--threads 1,2]
                                         [--repeat 15] [--json PATH]

For T tokens each choosing `topk` of `experts` MXFP4 experts (w1, w3 [inter, latent],
w2 [latent, inter]; the defaults are the mid checkpoint's shapes), it times
`K.moe_experts` (one thread region for the whole batch) and the per-expert path
(`model.run_expert`: `gather_rows`, three `mxfp4_matvec`, `situ_glu` per expert: four
regions each),
alternating the two in one process, and checks their outputs are bit-identical.  Each
call runs on its own copy of the experts, rotated over four times the last-level cache,
so the weights stream from DRAM as they do in a decode step.  Reports the median per call
and the packed bytes per second.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from k3engine import kernels as K
from k3engine.model import run_expert
from k3engine.weights import MXFP4, ExpertWeights

sys.path.insert(0, os.path.dirname(__file__))
from bench_kernels import l3_bytes, loadavg, machine_info  # noqa: E402


def mxfp4(r, rows: int, cols: int) -> MXFP4:
    return MXFP4(r.integers(0, 256, (rows, cols // 2), dtype=np.uint8),
                 r.integers(118, 130, (rows, cols // 32), dtype=np.uint8))


def batch(r, n_experts: int, topk: int, T: int, inter: int, latent: int):
    idx = np.array([r.choice(n_experts, topk, replace=False) for _ in range(T)], np.int32)
    starts = np.empty(n_experts + 1, np.int32)
    token = np.empty(T * topk, np.int32)
    S = K.moe_groups(idx, np.full(T, topk, np.int32), n_experts, starts, token,
                     np.empty((T, topk), np.int32))
    s = starts.tolist()
    used = [e for e in range(n_experts) if s[e + 1] > s[e]]
    return used, token, starts, S


def per_expert(group, Z, token, starts, D):
    s = starts
    for e, ex in group:
        run_expert(ex, Z, token[s[e]:s[e + 1]], np.float32(4.0), np.float32(25.0),
                   D[s[e]:s[e + 1]])


def fused(group, Z, token, starts, D):
    K.moe_experts(group, Z, token, starts, np.float32(4.0), np.float32(25.0), D)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inter", type=int, default=1536)
    ap.add_argument("--latent", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--tokens", default="1,64")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args(argv)
    r = np.random.default_rng(7)
    info = machine_info()
    print(f"machine: {info}; load average {loadavg()}")
    rows = []
    for T in (int(t) for t in a.tokens.split(",")):
        used, token, starts, S = batch(r, a.experts, a.topk, T, a.inter, a.latent)
        per_set = len(used) * 3 * (a.inter * a.latent // 2 + a.inter * a.latent // 32)
        copies = max(2, -(-4 * l3_bytes() // per_set))
        sets = [[(e, ExpertWeights(mxfp4(r, a.inter, a.latent), mxfp4(r, a.inter, a.latent),
                                   mxfp4(r, a.latent, a.inter))) for e in used]
                for _ in range(copies)]
        Z = r.standard_normal((T, a.latent)).astype(np.float32)
        D1, D2 = np.empty((S, a.latent), np.float32), np.empty((S, a.latent), np.float32)
        st = starts.tolist()
        for nt in (int(t) for t in a.threads.split(",")):
            K.set_num_threads(nt)
            fused(sets[0], Z, token, starts, D1)
            per_expert(sets[0], Z, token, st, D2)
            same = bool(np.array_equal(D1.view(np.uint32), D2.view(np.uint32)))
            times = {"batch": [], "per-expert": []}
            for i in range(a.repeat):
                g = sets[i % copies]
                t0 = time.perf_counter()
                fused(g, Z, token, starts, D1)
                times["batch"].append(time.perf_counter() - t0)
                g = sets[(i + copies // 2) % copies]
                t0 = time.perf_counter()
                per_expert(g, Z, token, st, D2)
                times["per-expert"].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) for k, v in times.items()}
            row = {"tokens": T, "threads": nt, "experts": len(used), "bytes": per_set,
                   "bits_equal": same, **{f"{k}_s": v for k, v in med.items()}}
            rows.append(row)
            print(f"T={T:<3d} threads {nt}: {len(used)} experts ({per_set / 1e6:.1f} MB) | "
                  f"batch {med['batch'] * 1e3:.2f} ms ({per_set / med['batch'] / 1e9:.2f} GB/s)"
                  f" | per-expert {med['per-expert'] * 1e3:.2f} ms "
                  f"({per_set / med['per-expert'] / 1e9:.2f} GB/s) | "
                  f"{med['per-expert'] / med['batch']:.2f}x | bits equal: {same}")
        del sets
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": info, "rows": rows}, f, indent=1)
    return 0 if all(r["bits_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
