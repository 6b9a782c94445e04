"""Expert reads overlapped with compute, against reading each group whole first (a script,
not a test; figures are reported, never asserted).

    python benchmarks/bench_overlap.py MODEL_DIR TRUNK_DIR [--runs 3] [--gen 8]
                                       [--trunk-gb 0.5] [--cache-gb 0.5] [--threads 2]

Alternates `k3` runs with the default (SYSTEM §4.5's pipeline: each expert is computed as
soon as its read lands, and the shared expert runs while the reads are in flight) and
K3_NO_EXPERT_PIPELINE=1 (every read of a group lands before any expert is served, §4.4's
whole-batch barrier), page cache dropped before each run where allowed.  Reports
the median s/token, the whole run's time the forward waited for expert reads and its
I/O share, and whether the ids of every run are identical (they must be).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

from bench_engine import drop_caches

IO = re.compile(r"I/O share of wall clock: ([\d.]+)%\s+\(trunk ([\d.]+) s \+ experts ([\d.]+) s")


def run(model: str, trunk: str, a, overlap: bool, out: str) -> dict:
    ids = ",".join(str(100 + i) for i in range(a.prompt))
    cmd = [sys.executable, "-m", "k3engine", model, "--trunk", trunk, "--ids", ids,
           "--gen", str(a.gen), "--trunk-gb", str(a.trunk_gb), "--cache-gb", str(a.cache_gb),
           "--threads", str(a.threads), "--incremental", "--out", out]
    env = {**os.environ, "K3_NO_EXPERT_PIPELINE": "0" if overlap else "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    o = json.load(open(out))
    io = IO.search(p.stdout)
    return dict(s_per_token=o["seconds_per_token"], ids=o["generated_ids"],
                expert_wait_s=float(io.group(3)) if io else None,
                io_share=float(io.group(1)) if io else None)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("trunk")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--trunk-gb", type=float, default=0.5)
    ap.add_argument("--cache-gb", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    res: dict[bool, list[dict]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.runs):
            for overlap in (False, True):
                dropped = drop_caches()
                r = run(a.model, a.trunk, a, overlap, os.path.join(tmp, "o.json"))
                res[overlap].append(r)
                print(f"run {i + 1} overlap={int(overlap)}: {r['s_per_token']:.3f} s/token, "
                      f"waited {r['expert_wait_s']} s for expert reads "
                      f"(page cache dropped: {dropped}); load {os.getloadavg()[0]:.2f}",
                      flush=True)
    ids = {tuple(r["ids"]) for v in res.values() for r in v}
    print(f"\nids identical in all {2 * a.runs} runs: {len(ids) == 1} {sorted(ids)[0]}")
    print("| order of work | s/token (median) | waited for expert reads, s | I/O share |")
    print("|---|---|---|---|")
    for overlap, name in ((False, "read the group, then compute"),
                          (True, "compute as each read lands")):
        v = res[overlap]
        med = lambda k: statistics.median(r[k] for r in v if r[k] is not None)  # noqa: E731
        print(f"| {name} | {med('s_per_token'):.3f} | {med('expert_wait_s'):.2f} | "
              f"{med('io_share'):.1f} % |")
    return 0 if len(ids) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
