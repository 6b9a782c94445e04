"""A/B of two engine source trees or two settings on one budget, runs alternated (a
script, not a test).

    python benchmarks/bench_ab.py MODEL_DIR TRUNK_DIR BASE_ENGINE_DIR [--budget 0]
                                  [--budget-args ARGS] [--pairs 3] [--gen 8] [--prompt 5]
                                  [--threads 1] [--env-a VAR=VALUE]... [--env-b VAR=VALUE]...

BASE_ENGINE_DIR is the `engine` directory of another checkout with its extensions built in
place (e.g. `git archive main | tar -x -C /tmp/base && cd /tmp/base && python setup.py
build_ext --inplace`); it is put first on PYTHONPATH for the A runs, the installed engine
runs the B runs; `-` runs the installed engine on both sides, to compare the environment
variables --env-a / --env-b set for one side only (e.g. K3_CACHE_POLICY=s3fifo).  Each
pair runs A then B (page cache dropped before each run when /proc/sys/vm/drop_caches is
writable) with bench_engine's `run_once`, so a shared machine's load hits both sides
alike.  Reports the medians of the steady decode step's wall and
process CPU seconds, the prefill's s/position (--prompt N > 5), and whether the ids agree.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from bench_engine import (BUDGETS, device_bandwidth, drop_caches, prompt_ids, run_once,
                          vocab_of)
from bench_kernels import loadavg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("trunk")
    ap.add_argument("base_engine")
    ap.add_argument("--budget", type=int, default=0, help="row of bench_engine's budget table")
    ap.add_argument("--budget-args", metavar="ARGS",
                    help="memory flags instead of a table row, e.g. '--trunk {trunk} "
                         "--trunk-gb 8 --cache-gb 1'")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=5, help="prompt length (5 = the tables' ids)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--env-a", action="append", default=[], metavar="VAR=VALUE",
                    help="set for the A runs only (repeatable)")
    ap.add_argument("--env-b", action="append", default=[], metavar="VAR=VALUE",
                    help="set for the B runs only (repeatable)")
    a = ap.parse_args()
    side_env = {"A": dict(v.split("=", 1) for v in a.env_a),
                "B": dict(v.split("=", 1) for v in a.env_b)}
    name, args = (a.budget_args, a.budget_args.split()) if a.budget_args else BUDGETS[a.budget]
    args = [x.format(trunk=a.trunk) for x in args] + ["--threads", str(a.threads)]
    ids = prompt_ids(a.prompt, vocab_of(a.model))
    keep = os.environ.get("PYTHONPATH")
    res: dict[str, list[dict]] = {"A": [], "B": []}
    print(f"{name}, prompt {a.prompt}, gen {a.gen}, threads {a.threads}; A = "
          f"{a.base_engine} {side_env['A'] or ''}, B = the installed engine "
          f"{side_env['B'] or ''}; load average {loadavg()}", flush=True)
    shard = sorted(f for f in os.listdir(a.model) if f.endswith(".safetensors"))[0]
    rates = []                 # the device's QD16 rate (k3 devbw's code) before each pair
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.pairs):
            drop_caches()
            rates.append(device_bandwidth(os.path.join(a.model, shard), depths=(16,))[0][16])
            for side in ("A", "B"):
                if side == "A" and a.base_engine != "-":
                    os.environ["PYTHONPATH"] = os.path.abspath(a.base_engine) + (
                        os.pathsep + keep if keep else "")
                elif keep is None:
                    os.environ.pop("PYTHONPATH", None)
                else:
                    os.environ["PYTHONPATH"] = keep
                saved = {k: os.environ.get(k) for k in side_env[side]}
                os.environ.update(side_env[side])
                drop_caches()
                try:
                    r = run_once(a.model, args, a.gen, tmp, ids)
                finally:
                    for k, v in saved.items():
                        if v is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = v
                res[side].append(r)
                print(f"  pair {i} {side}: steady {r['steady']:.3f} s (CPU {r['steady_cpu']:.3f})"
                      f", ttft {r['ttft']:.2f} s, read {r['steady_read_gb']:.3f} GB a step "
                      f"(floor {r['steady_read_gb'] * 1e3 / rates[-1]:.3f} s at "
                      f"{rates[-1]:.0f} MB/s), lookahead recall {r['la_recall']:.3f} "
                      f"useful {r['la_useful']}/{r['la_predicted']} wasted "
                      f"{r['la_wasted_gb']:.4f} GB a step, load {loadavg()}", flush=True)
    med = {s: {k: statistics.median(r[k] for r in rs)
               for k in ("steady", "steady_cpu", "ttft", "steady_read_gb", "la_recall",
                         "la_wasted_gb")}
           for s, rs in res.items()}
    rate = statistics.median(rates)
    same = len({tuple(r["ids"]) for rs in res.values() for r in rs}) == 1
    for s in ("A", "B"):
        m = med[s]
        floor = m['steady_read_gb'] * 1e3 / rate
        print(f"{s}: steady decode step {m['steady']:.3f} s wall, {m['steady_cpu']:.3f} s CPU, "
              f"{m['steady_read_gb']:.3f} GB read (floor {floor:.3f} s at the median device "
              f"rate {rate:.0f} MB/s: step = {m['steady'] / floor:.2f}x floor); ttft "
              f"{m['ttft']:.2f} s ({m['ttft'] / a.prompt:.4f} s/position); lookahead recall "
              f"{m['la_recall']:.3f}, wasted {m['la_wasted_gb']:.4f} GB a step")
    print(f"B/A: steady wall {med['B']['steady'] / med['A']['steady']:.3f}, CPU "
          f"{med['B']['steady_cpu'] / med['A']['steady_cpu']:.3f}, ttft "
          f"{med['B']['ttft'] / med['A']['ttft']:.3f}; ids identical across all runs: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
