#!/usr/bin/env python
"""Forecast against measurement (a script, not a test; figures reported, never asserted).

    python benchmarks/bench_forecast.py MODEL_DIR TRUNK_DIR [--runs 3] [--gen 8]
                                        [--plans NAME,...] [--json PATH]
    python benchmarks/bench_forecast.py --markdown RESULT.json [MODEL_DIR TRUNK_DIR]

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
DEMO_IDS = "1008,1484,318,3383,387"        # within the demo's 4,256-id vocabulary

# name -> k3 flags; {trunk} is the packed trunk.  Resident to nothing pinned.
PLANS = {
    "resident": ["--cache-gb", "2"],
    "all-pinned": ["--trunk", "{trunk}", "--trunk-gb", "2", "--cache-gb", "2"],
    "t1.0+c1.0": ["--trunk", "{trunk}", "--trunk-gb", "1", "--cache-gb", "1"],
    "t0.5+c0.5": ["--trunk", "{trunk}", "--trunk-gb", "0.5", "--cache-gb", "0.5"],
    "nothing-pinned": ["--trunk", "{trunk}", "--trunk-gb", "0", "--cache-gb", "0.3"],
}


# the same ladder for the demo model (9 MB: a 2.65 MB trunk of 8 layers of ~0.33 MB, 224
# experts in ~16 KB slots): all pinned, 3 and 2 of 8 layers pinned, none pinned (ring 2)
DEMO_PLANS = {
    "resident": ["--cache-gb", "0.05"],
    "all-pinned": ["--trunk", "{trunk}", "--trunk-gb", "0.05", "--cache-gb", "0.05"],
    "t0.002+c0.001": ["--trunk", "{trunk}", "--trunk-gb", "0.002", "--cache-gb", "0.001"],
    "t0.0015+c0.0005": ["--trunk", "{trunk}", "--trunk-gb", "0.0015", "--cache-gb", "0.0005"],
    "nothing-pinned": ["--trunk", "{trunk}", "--trunk-gb", "0.001", "--cache-gb", "0.0003"],
}


def flag(args: list[str], name: str, default=None):
    return args[args.index(name) + 1] if name in args else default


def child(cpu_path: str, argv: list[str]) -> int:
    """Run `k3 argv` in this process, recording the main thread's CPU seconds per step.
    With --threads 1 the kernels run in the main thread, so this is the step's compute,
    whatever else shares the cores (its wall time is what the user waits)."""
    import time
    from k3engine import cli, telemetry
    cpu: list[float] = []
    wait: list[float] = []

    def runq_wait() -> float:
        """Seconds this thread has been runnable but waiting for a CPU (Linux schedstat:
        on-CPU ns, run-queue ns, slices): the time other processes took from it."""
        try:
            with open("/proc/thread-self/schedstat") as f:
                return int(f.read().split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return 0.0

    class Timed(telemetry.Events):
        def __init__(self, *sinks):
            super().__init__(*sinks)
            self.sinks.append(self._tick)
            self._last, self._wait = time.thread_time(), runq_wait()

        def _tick(self, e):
            now, w = time.thread_time(), runq_wait()
            if e.get("ev") == "step":
                cpu.append(now - self._last)
                wait.append(w - self._wait)
            self._last, self._wait = now, w

    cli.Events = Timed
    code = cli.main(argv)
    from k3engine.tools.datapoint import own_peak_rss
    with open(cpu_path, "w") as f:
        json.dump({"cpu": cpu, "wait": wait, "peak": own_peak_rss()}, f)
    return code


def run_once(model: str, args: list[str], gen: int, threads: int, ids: str = IDS) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out, ev = os.path.join(tmp, "out.json"), os.path.join(tmp, "events.jsonl")
        cpu_path = os.path.join(tmp, "cpu.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", cpu_path, model, "--ids",
               ids, "--gen", str(gen), "--incremental", "--out", out, "--events", ev,
               "--threads", str(threads), "--dump-cache-trace", tmp] + args
        import resource
        before, kids0 = F._cpu_busy(), resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        after, kids1 = F._cpu_busy(), resource.getrusage(resource.RUSAGE_CHILDREN)
        other = None
        if before and after and after[1] > before[1]:
            own = (kids1.ru_utime + kids1.ru_stime - kids0.ru_utime - kids0.ru_stime)
            other = max(0.0, ((after[0] - before[0]) - own * os.sysconf("SC_CLK_TCK"))
                        / (after[1] - before[1]))
        with open(out) as f:
            res = json.loads(f.read())
        with open(cpu_path) as f:
            got = json.load(f)
        cpu = got["cpu"]
        if got["peak"]:      # getrusage's figure carries this process's peak across exec
            res["peak_rss_bytes"] = got["peak"]
        steps = []
        with open(ev) as f:
            for line in f:
                e = json.loads(line)
                if e.get("ev") == "step":
                    steps.append(e)
        from k3engine.tools.sim_cache import read_trace, trace_keys
        keys = trace_keys(read_trace(os.path.join(tmp, "expert_trace.bin")))
    decode = steps[1:]
    wait = got.get("wait") or [0.0] * len(steps)
    return {"keys": keys, "decode_runq_wait_s": statistics.median(wait[1:]) if decode else 0.0,
            "steady_unstarved_s": statistics.median(s["seconds"] - w for s, w in
                                                    zip(decode, wait[1:])) if decode else 0.0,
            "ttft_unstarved_s": steps[0]["seconds"] - wait[0], "other_load": other, "ttft_s": steps[0]["seconds"], "ttft_cpu_s": cpu[0],
            "decode_cpu_s": statistics.median(cpu[1:]) if len(cpu) > 1 else 0.0,
            "decode_io_s": statistics.median(s["trunk_read_s"] + s["expert_read_s"]
                                             for s in decode) if decode else 0.0,
            "steady_s": statistics.median(s["seconds"] for s in decode) if decode else 0.0,
            "run_s": res["seconds_per_token"], "peak_rss_bytes": res["peak_rss_bytes"],
            "steady_read_bytes": statistics.median(s["trunk_bytes"] + s["expert_bytes"]
                                                   for s in decode) if decode else 0,
            "ids": res["generated_ids"]}


def pct(pred: float, meas: float) -> str:
    return f"{100 * (pred / meas - 1):+.0f}%" if meas else "n/a"


def reforecast(r: dict, model: str, trunk: str) -> None:
    """Replace each row's forecasts by the current model's, from the machine figures the
    run recorded (after a fix of the model: the measurements do not change)."""
    machine = F.MachineFigures.from_json(r["machine"], "recorded with the measurement")
    shapes = {True: F.local_model(model, trunk), False: F.local_model(model)}
    demo = r.get("plan_set") == "demo" or any(row["plan"] not in PLANS for row in r["rows"])
    plans = DEMO_PLANS if demo else PLANS
    for row in r["rows"]:
        args = [x.format(trunk=trunk) for x in plans[row["plan"]]]
        streamed = "--trunk" in args
        kw = dict(trunk_gb=float(flag(args, "--trunk-gb", 16)), streamed=streamed,
                  cache_gb=float(flag(args, "--cache-gb", 64)), prompt_len=5, gen=8)
        row["forecast"] = F.forecast(shapes[streamed], machine, **kw).as_json()
        # (the trace column keeps the run's own forecast: the trace itself is not stored)


def markdown(path: str, model: str | None = None, trunk: str | None = None) -> str:
    """The tables of docs/forecast.md from a --json result (forecast again by the current
    model when MODEL_DIR and TRUNK_DIR are given)."""
    with open(path) as f:
        r = json.load(f)
    if model:
        reforecast(r, model, trunk)
    out = ["| plan | decode s/token: forecast / measured (miss) | measured less the main "
           "thread's run-queue wait (miss) | compute s: forecast / "
           "measured CPU (miss) | reads s: forecast / measured | ttft s: forecast / measured"
           " | GB read per step: forecast (trace) / measured | peak RSS GB: forecast (trace) / "
           "measured (miss) | other load |",
           "|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        f, t, m = row["forecast"], row["forecast_with_trace"], row["measured_median"]
        out.append(
            f"| {row['plan']} | {f['decode_s_per_token_run']:.3f} / {m['steady_s']:.3f} "
            f"({pct(f['decode_s_per_token_run'], m['steady_s'])}) | "
            + (f"{m['steady_unstarved_s']:.3f} ({pct(f['decode_s_per_token_run'], m['steady_unstarved_s'])})"
               if "steady_unstarved_s" in m else "–") + " | "
            f"{f['compute_s_per_token']:.3f} / {m['decode_cpu_s']:.3f} "
            f"({pct(f['compute_s_per_token'], m['decode_cpu_s'])}) | "
            f"{f.get('decode_io_s_per_token_run', f['io_s_per_token']):.3f} / "
            f"{m['decode_io_s']:.3f} | "
            f"{f['ttft_s']:.2f} / {m['ttft_s']:.2f} | "
            f"{f['bytes_read_per_token'] / 1e9:.3f} ({t['bytes_read_per_token'] / 1e9:.3f}) / "
            f"{m['steady_read_bytes'] / 1e9:.3f} | "
            f"{f['peak_rss_bytes'] / 1e9:.3f} ({t['peak_rss_bytes'] / 1e9:.3f}) / "
            f"{m['peak_rss_bytes'] / 1e9:.3f} "
            f"({pct(f['peak_rss_bytes'], m['peak_rss_bytes'])}) | "
            f"{m.get('other_load', 0):.2f} |")
    return "\n".join(out)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[3:])
    if len(sys.argv) > 2 and sys.argv[1] == "--markdown":
        print(markdown(*sys.argv[2:5]))
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("trunk")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--plans", default=None, help="names from the plan set (default: all)")
    ap.add_argument("--plan-set", choices=("mid", "demo"), default="mid")
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
    plans = PLANS if a.plan_set == "mid" else DEMO_PLANS
    ids = IDS if a.plan_set == "mid" else DEMO_IDS
    for name in (a.plans.split(",") if a.plans else plans):
        args = [x.format(trunk=a.trunk) for x in plans[name]]
        streamed = "--trunk" in args
        fc = F.forecast(shapes[streamed], machine, trunk_gb=float(flag(args, "--trunk-gb", 16)),
                        cache_gb=float(flag(args, "--cache-gb", 64)), streamed=streamed,
                        prompt_len=len(ids.split(",")), gen=a.gen)
        runs, failed = [], 0
        while len(runs) < a.runs and failed < a.runs:
            try:
                runs.append(run_once(a.model, args, a.gen, a.threads, ids))
            except subprocess.CalledProcessError:    # e.g. refused: others hold the memory
                failed += 1
        if not runs:
            print(f"{name:16} every run failed", flush=True)
            continue
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]
               if k not in ("ids", "keys") and all(r[k] is not None for r in runs)}
        # the same forecast with the first run's recorded trace instead of uniform routing
        ft = F.forecast(shapes[streamed], machine, trunk_gb=float(flag(args, "--trunk-gb", 16)),
                        cache_gb=float(flag(args, "--cache-gb", 64)), streamed=streamed,
                        prompt_len=len(ids.split(",")), gen=a.gen,
                        hits=F.TraceRouting(runs[0]["keys"], "run 1's trace"))
        for r in runs:
            r.pop("keys")
        row = {"plan": name, "args": " ".join(plans[name]), "forecast": fc.as_json(),
               "forecast_with_trace": ft.as_json(),
               "measured_median": med, "runs": runs,
               "ids_identical": all(r["ids"] == runs[0]["ids"] for r in runs)}
        rows.append(row)
        print(f"{name:16} decode {fc.decode_s_run:.3f} vs {med['steady_s']:.3f} (steady "
              f"{fc.s_per_token:.3f}; less run-queue wait {med.get('steady_unstarved_s', 0):.3f}) | compute {fc.decode_compute_s:.3f} vs cpu "
              f"{med['decode_cpu_s']:.3f} | io {fc.decode_io_s:.3f} vs {med['decode_io_s']:.3f} | ttft "
              f"{fc.ttft_s:.3f} vs {med['ttft_s']:.3f} | run {fc.s_per_token_run:.3f} vs "
              f"{med['run_s']:.3f} | read {fc.bytes_read_per_token / 1e9:.3f} vs "
              f"{med['steady_read_bytes'] / 1e9:.3f} GB | RSS {fc.peak_rss_bytes / 1e9:.2f} vs "
              f"{med['peak_rss_bytes'] / 1e9:.2f} GB | other load {med.get('other_load', -1):.2f}",
              flush=True)
        print(f"{'  with trace':16} decode {ft.decode_s_run:.3f} | io {ft.decode_io_s:.3f} | "
              f"read {ft.bytes_read_per_token / 1e9:.3f} GB | RSS {ft.peak_rss_bytes / 1e9:.2f} GB"
              f" | hit {100 * ft.hit_rate:.1f}%", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": machine.to_json(), "rows": rows, "plan_set": a.plan_set},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
