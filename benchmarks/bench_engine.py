"""Engine speed and memory per budget on a generated multi-GB checkpoint (a script, not a
test; figures are reported, never asserted).

    python benchmarks/bench_engine.py MODEL_DIR TRUNK_DIR [--runs 3] [--gen 8] [--json PATH]
                                      [--hybrid DRAFT_TRUNK_DIR]

For every budget row it runs the real `k3` process `--runs` times (page cache dropped
before each run when /proc/sys/vm/drop_caches is writable), and reports the median
s/token, GB read per token, I/O share, peak RSS next to the plan's TOTAL, and the trunk
and expert read rates next to the device's O_DIRECT read bandwidth measured here.
With --hybrid it compares plain decode with hybrid decode (--draft-trunk) at one streamed
budget instead, with the drafts accepted.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

BUDGETS = [
    ("resident (no --trunk), cache 64 GB", []),
    ("trunk all pinned + cache 8 GB", ["--trunk", "{trunk}", "--trunk-gb", "8", "--cache-gb", "8"]),
    ("trunk 1.0 GB + cache 1.0 GB", ["--trunk", "{trunk}", "--trunk-gb", "1", "--cache-gb", "1"]),
    ("trunk 0.5 GB + cache 0.5 GB", ["--trunk", "{trunk}", "--trunk-gb", "0.5", "--cache-gb", "0.5"]),
    ("nothing pinned, ring 2 + cache 0.3 GB", ["--trunk", "{trunk}", "--trunk-gb", "0",
                                               "--cache-gb", "0.3"]),
]

HYBRID_BASE = ["--trunk", "{trunk}", "--trunk-gb", "0.5", "--cache-gb", "0.5"]
HYBRID = [
    ("plain decode", []),
    ("exact trunk as draft, top-k of the model", ["--draft-trunk", "{trunk}", "--draft-trunk-gb",
                                                  "2", "--draft-topk", "{topk}"]),
    ("8-bit draft, defaults (top-4 via cache)", ["--draft-trunk", "{draft}", "--draft-trunk-gb",
                                                 "2"]),
    ("8-bit draft, cache-only, --spec-auto", ["--draft-trunk", "{draft}", "--draft-trunk-gb", "2",
                                              "--draft-cache-only", "--spec-auto"]),
]


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def device_bandwidth(path: str, reads: int = 192, block: int = 4 << 20, qd: int = 16):
    """O_DIRECT reads of `block` bytes at random aligned offsets of an existing big file,
    `qd` in flight -- the way the engine reads experts and trunk chunks.  MB/s."""
    import random
    from concurrent.futures import ThreadPoolExecutor
    from k3engine.diskio import AlignedBuffer, open_for_streaming, pread_into
    fd, direct = open_for_streaming(path)
    n_blocks = os.fstat(fd).st_size // block
    rng = random.Random(0)
    offs = [rng.randrange(n_blocks) * block for _ in range(reads)]
    bufs = [AlignedBuffer(block) for _ in range(qd)]
    for b in bufs:                                  # fault the pages in before timing
        b.view[::4096] = b"\0" * len(b.view[::4096])
    t0 = time.monotonic()
    with ThreadPoolExecutor(qd) as pool:
        got = sum(pool.map(lambda i: pread_into(fd, bufs[i % qd].view, offs[i]), range(reads)))
    dt = time.monotonic() - t0
    os.close(fd)
    return got / dt / 1e6, direct


def run_once(model: str, args: list[str], gen: int, out: str) -> dict:
    cmd = [sys.executable, "-m", "k3engine", model, "--ids", "1008,10484,318,15383,387",
           "--gen", str(gen), "--incremental", "--out", out, *args]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} -> {p.returncode}\n{p.stderr[-2000:]}")
    j = json.loads(open(out, "rb").read().decode("utf-8", "replace"))
    total = re.search(r"TOTAL\s+([\d.]+) (GB|MB)", p.stdout)
    plan = float(total.group(1)) * (1e9 if total.group(2) == "GB" else 1e6) if total else 0.0
    io = re.search(r"I/O share of wall clock: ([\d.]+)%", p.stdout)
    steps = [ln for ln in p.stdout.splitlines() if re.match(r"^\d+\s+\d+\s", ln)]
    step_s = [float(ln.split()[2]) for ln in steps]
    return dict(ids=j["generated_ids"], spt=j["seconds_per_token"],
                accepted=j.get("spec_accepted"), drafted=j.get("spec_drafted"),
                steady=statistics.median(step_s[1:]) if len(step_s) > 1 else step_s[0],
                read_gb=(j["trunk_bytes_read"] + j["expert_bytes_read"]) / 1e9 / max(len(steps), 1),
                peak=j["peak_rss_bytes"], plan=plan, io=float(io.group(1)) if io else 0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("trunk")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--json")
    ap.add_argument("--hybrid", metavar="DRAFT_TRUNK_DIR")
    a = ap.parse_args()
    budgets, topk = BUDGETS, 0
    if a.hybrid:
        cfg = json.load(open(os.path.join(a.model, "config.json")))
        topk = cfg.get("text_config", cfg)["num_experts_per_token"]
        budgets = [(name, HYBRID_BASE + args) for name, args in HYBRID]
    shard = sorted(f for f in os.listdir(a.model) if f.endswith(".safetensors"))[0]
    bw, direct = device_bandwidth(os.path.join(a.model, shard))
    dropped = drop_caches()
    print(f"machine: {platform.processor() or platform.machine()} | cores {os.cpu_count()} | "
          f"device read {bw:.0f} MB/s ({'O_DIRECT' if direct else 'buffered'}, 4 MiB x 16) | "
          f"page cache dropped between runs: {dropped}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in budgets:
            args = [x.format(trunk=a.trunk, draft=a.hybrid, topk=topk) for x in args]
            runs = []
            for _ in range(a.runs):
                drop_caches()
                runs.append(run_once(a.model, args, a.gen, os.path.join(tmp, "o.json")))
            ids = {tuple(r["ids"]) for r in runs}
            row = dict(budget=name, runs=a.runs,
                       s_per_token=statistics.median(r["spt"] for r in runs),
                       steady_s_per_token=statistics.median(r["steady"] for r in runs),
                       gb_read_per_step=statistics.median(r["read_gb"] for r in runs),
                       io_share=statistics.median(r["io"] for r in runs),
                       peak_rss_gb=statistics.median(r["peak"] for r in runs) / 1e9,
                       plan_gb=runs[0]["plan"] / 1e9, ids=list(next(iter(ids))),
                       drafted=runs[0]["drafted"], accepted=runs[0]["accepted"],
                       ids_identical_across_runs=len(ids) == 1)
            rows.append(row)
            print(f"{name:40s} {row['s_per_token']:7.3f} s/tok (steady {row['steady_s_per_token']:.3f})"
                  f"  {row['gb_read_per_step']:6.2f} GB/step  I/O {row['io_share']:5.1f}%  "
                  f"peak {row['peak_rss_gb']:5.2f} GB (plan {row['plan_gb']:5.2f})"
                  + (f"  accepted {row['accepted']}/{row['drafted']}" if row["drafted"] else ""),
                  flush=True)
    same = len({tuple(r["ids"]) for r in rows}) == 1
    print(f"ids identical across all budgets: {same} ({rows[0]['ids']})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device_mb_s=bw, direct=direct, rows=rows, ids_identical=same), f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
