#!/usr/bin/env python
"""Forecast against measurement (a script, not a test; figures reported, never asserted).

    python benchmarks/bench_forecast.py MODEL_DIR TRUNK_DIR [--runs 3] [--gen 8]
                                        [--plans NAME,...] [--json PATH] [--markdown]

For each plan (resident to nothing pinned) it prints the forecast (k3engine.forecast, the
machine's cached figures) and runs the real `k3` process `--runs` times with --events,
then compares the medians: steady s/token (steps 1..gen-1), time to first token (step 0),
the run's s/token average, bytes read per steady step, and peak RSS.  The page cache is
not dropped (the machine is shared; trunk and expert reads use O_DIRECT anyway).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from k3engine import forecast as F

IDS = "1008,10484,318,15383,387"

# name -> k3 flags; {trunk} is the packed trunk.  Resident to nothing pinned.
PLANS = {
    "resident": [],
    "all-pinned": ["--trunk", "{trunk}", "--trunk-gb", "8", "--cache-gb", "8"],
    "t1.0+c1.0": ["--trunk", "{trunk}", "--trunk-gb", "1", "--cache-gb", "1"],
    "t0.5+c0.5": ["--trunk", "{trunk}", "--trunk-gb", "0.5", "--cache-gb", "0.5"],
    "nothing-pinned": ["--trunk", "{trunk}", "--trunk-gb", "0", "--cache-gb", "0.3"],
}


def flag(args: list[str], name: str, default=None):
    return args[args.index(name) + 1] if name in args else default


def run_once(model: str, args: list[str], gen: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out, ev = os.path.join(tmp, "out.json"), os.path.join(tmp, "events.jsonl")
        cmd = [sys.executable, "-m", "k3engine", model, "--ids", IDS, "--gen", str(gen),
               "--incremental", "--out", out, "--events", ev, "--threads", str(threads)] + args
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(out) as f:
            res = json.loads(f.read())
        steps = []
        with open(ev) as f:
            for line in f:
                e = json.loads(line)
                if e.get("ev") == "step":
                    steps.append(e)
    decode = steps[1:]
    return {"ttft_s": steps[0]["seconds"],
            "steady_s": statistics.median(s["seconds"] for s in decode) if decode else 0.0,
            "run_s": res["seconds_per_token"], "peak_rss_bytes": res["peak_rss_bytes"],
            "steady_read_bytes": statistics.median(s["trunk_bytes"] + s["expert_bytes"]
                                                   for s in decode) if decode else 0,
            "ids": res["generated_ids"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("trunk")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--threads", type=int, default=1,
                    help="engine threads for the runs and the calibration (default 1: on a "
                         "shared 2-core machine a 2-thread kernel waits for the busier core)")
    ap.add_argument("--json")
    a = ap.parse_args()
    machine = F.machine_figures(a.trunk, a.threads, refresh=True)   # measured now, same load
    print(f"machine: read {machine.read_rate(16) / 1e9:.2f} GB/s (QD16), BF16 "
          f"{machine.bf16_bps / 1e9:.2f} GB/s + {machine.bf16_call_s * 1e6:.0f} us, MXFP4 "
          f"{machine.mxfp4_bps / 1e9:.2f} GB/s + {machine.mxfp4_call_s * 1e6:.0f} us, other "
          f"load {machine.other_load}", flush=True)
    shapes = {True: F.local_model(a.model, a.trunk), False: F.local_model(a.model)}
    rows = []
    for name in a.plans.split(","):
        args = [x.format(trunk=a.trunk) for x in PLANS[name]]
        streamed = "--trunk" in args
        fc = F.forecast(shapes[streamed], machine, trunk_gb=float(flag(args, "--trunk-gb", 16)),
                        cache_gb=float(flag(args, "--cache-gb", 64)), streamed=streamed,
                        prompt_len=len(IDS.split(",")), gen=a.gen)
        runs = [run_once(a.model, args, a.gen, a.threads) for _ in range(a.runs)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "ids"}
        row = {"plan": name, "args": " ".join(PLANS[name]), "forecast": fc.as_json(),
               "measured_median": med, "runs": runs,
               "ids_identical": all(r["ids"] == runs[0]["ids"] for r in runs)}
        rows.append(row)
        print(f"{name:16} steady {fc.s_per_token:.3f} vs {med['steady_s']:.3f} | ttft "
              f"{fc.ttft_s:.3f} vs {med['ttft_s']:.3f} | run {fc.s_per_token_run:.3f} vs "
              f"{med['run_s']:.3f} | read {fc.bytes_read_per_token / 1e9:.3f} vs "
              f"{med['steady_read_bytes'] / 1e9:.3f} GB | RSS {fc.peak_rss_bytes / 1e9:.2f} vs "
              f"{med['peak_rss_bytes'] / 1e9:.2f} GB", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": machine.to_json(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
