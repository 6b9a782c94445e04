"""Engine speed and memory per budget on a generated multi-GB checkpoint (a script, not a
test; figures are reported, never asserted).

    python benchmarks/bench_engine.py MODEL_DIR TRUNK_DIR [--runs 3] [--gen 8] [--json PATH]
                                      [--threads N] [--budgets I,J] [--hybrid DRAFT_TRUNK_DIR]
                                      [--prefill 64,512,2048] [--profile]
    python benchmarks/bench_engine.py --markdown RESULT.json     # the docs' table

For every budget row it runs the real `k3` process `--runs` times (page cache dropped
before each run when /proc/sys/vm/drop_caches is writable), and reports the median
s/token, the steady step (median of steps 1..gen-1), GB read per step, the I/O floor of a
step (its bytes read / the device rate that `k3 devbw`'s code measures here, 4 MiB
O_DIRECT random reads, 16 in flight, just before the row: a shared device's rate moves
within the hour), I/O share, peak RSS next to the plan's TOTAL, and
the load of the machine while the row ran (`uptime`'s load averages and the share of the
CPUs other processes used: timings on a shared machine are only as good as that).
--budgets picks rows of the table by index (0 = resident ... 4 = nothing pinned).
With --hybrid it compares plain decode with hybrid decode (--draft-trunk) at one streamed
budget instead, with the drafts accepted.  With --prefill it times prompts of those
lengths instead, resident and streamed (trunk 0.5 + cache 0.5 GB): time to first token
split into the engine's own step-0 phases (trunk reads, expert reads, the rest =
compute), s/position, and the decode steps that follow (the ratio a position of prefill
is faster than a decode step), and the compute ceiling of that ratio: a position's
multiply-adds (from the checkpoint's headers) at this machine's double-FMA peak
(benchmarks/fma_peak.c, or --fma-gmadds), since every exact product is one double FMA.
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

from bench_kernels import ForeignLoad, loadavg

BUDGETS = [
    ("resident (no --trunk), cache 64 GB", []),
    ("trunk all pinned + cache 8 GB", ["--trunk", "{trunk}", "--trunk-gb", "8", "--cache-gb", "8"]),
    ("trunk 1.0 GB + cache 1.0 GB", ["--trunk", "{trunk}", "--trunk-gb", "1", "--cache-gb", "1"]),
    ("trunk 0.5 GB + cache 0.5 GB", ["--trunk", "{trunk}", "--trunk-gb", "0.5", "--cache-gb", "0.5"]),
    # at --trunk-gb 0 the planner holds the ring at 1 slot (two 0.14 GB slots exceed it)
    ("nothing pinned (ring held at 1) + cache 0.3 GB", ["--trunk", "{trunk}", "--trunk-gb", "0",
                                                        "--cache-gb", "0.3"]),
]

# prefill rows: the resident budget and the streamed one issue 13 quotes (trunk 0.5 + 0.5)
PREFILL_BUDGETS = [BUDGETS[0], BUDGETS[3]]
PREFILL_GEN = 4                      # step 0 = the prefill; steps 1-3 = decode at that context

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


def device_bandwidth(path: str, depths=(1, 4, 16)) -> tuple[dict, bool]:
    """`k3 devbw`'s own measurement on an existing big file (read only, so cold): 4 MiB
    O_DIRECT random reads at these queue depths -- the way the engine reads trunk
    chunks and expert batches.  ({depth: MB/s}, O_DIRECT)."""
    from k3engine.tools import devbw
    res = devbw.measure_file(path, block=4 << 20, depths=depths, reads=48, seconds=4.0)
    return {q.qd: q.mbs for q in res.results}, res.direct


def prompt_ids(n: int, vocab: int = 32768) -> str:
    """The benchmark prompt: the 5 ids of every earlier table, or n ids drawn with a fixed
    seed (a prefill row) -- the same prompt in every run and budget (taken modulo a
    smaller model's vocabulary)."""
    if n == 5:
        return ",".join(str(i % vocab) for i in (1008, 10484, 318, 15383, 387))
    import random
    rng = random.Random(n)
    return ",".join(str(rng.randrange(32768) % vocab) for _ in range(n))


def vocab_of(model: str) -> int:
    cfg = json.load(open(os.path.join(model, "config.json")))
    return int(cfg.get("text_config", cfg)["vocab_size"])


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process, all its threads (/proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def run_once(model: str, args: list[str], gen: int, tmp: str, ids: str) -> dict:
    out, ev = os.path.join(tmp, "o.json"), os.path.join(tmp, "events.jsonl")
    with open(os.path.join(tmp, "ids.txt"), "w") as f:
        f.write(ids)
    cmd = [sys.executable, "-m", "k3engine", model, "--ids-file", os.path.join(tmp, "ids.txt"),
           "--gen", str(gen), "--incremental", "--stream-tokens", "--out", out, "--events", ev,
           *args]
    t0 = time.monotonic()
    cpu_marks, lines = [], []
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        for line in p.stdout:      # the process's CPU seconds (all threads) at each token
            lines.append(line)
            if line.startswith("@K3TOKEN"):
                cpu_marks.append(process_cpu_s(p.pid))
        p.wait()
        wall = time.monotonic() - t0
        err.seek(0)
        stderr = err.read()
    stdout = "".join(lines)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} -> {p.returncode}\n{stderr[-2000:]}")
    j = json.loads(open(out, "rb").read().decode("utf-8", "replace"))
    total = re.search(r"TOTAL\s+([\d.]+) (GB|MB)", stdout)
    plan = float(total.group(1)) * (1e9 if total.group(2) == "GB" else 1e6) if total else 0.0
    io = re.search(r"I/O share of wall clock: ([\d.]+)%", stdout)
    steps = [e for e in map(json.loads, open(ev)) if e.get("ev") == "step"]
    step_s = [e["seconds"] for e in steps]
    dec = steps[1:] or steps
    s0 = steps[0]
    return dict(ids=j["generated_ids"], spt=j["seconds_per_token"],
                accepted=j.get("spec_accepted"), drafted=j.get("spec_drafted"),
                steady=statistics.median(step_s[1:]) if len(step_s) > 1 else step_s[0],
                read_gb=(j["trunk_bytes_read"] + j["expert_bytes_read"]) / 1e9 / max(len(steps), 1),
                steady_read_gb=statistics.median(e["trunk_bytes"] + e["expert_bytes"]
                                                 for e in dec) / 1e9,
                steady_io_s=statistics.median(e["trunk_read_s"] + e["expert_read_s"] for e in dec),
                steady_cpu=statistics.median(b - a for a, b in zip(cpu_marks, cpu_marks[1:]))
                if len(cpu_marks) > 1 else float("nan"),
                ttft=s0["seconds"], ttft_trunk_s=s0["trunk_read_s"],
                ttft_expert_s=s0["expert_read_s"],
                ttft_read_gb=(s0["trunk_bytes"] + s0["expert_bytes"]) / 1e9,
                process_wall=wall,
                peak=j["peak_rss_bytes"], plan=plan, io=float(io.group(1)) if io else 0.0,
                # lookahead expert reads over the decode steps (0 with --no-lookahead)
                la_recall=(sum(e["lookahead_recall"] * e["expert_requests"] for e in dec)
                           / max(sum(e["expert_requests"] for e in dec), 1)),
                la_predicted=sum(e["lookahead_predicted"] for e in dec),
                la_useful=sum(e["lookahead_useful"] for e in dec),
                la_wasted_gb=sum(e["lookahead_wasted_bytes"] for e in dec) / 1e9 / len(dec))


PROFILE_GEN, PROFILE_SKIP = 16, 4     # profile steps PROFILE_SKIP..PROFILE_GEN-1 of a run


def profile_run(model: str, args: list[str], tmp: str, ids: str, rate: int = 250,
                gen: int = PROFILE_GEN, skip: int = PROFILE_SKIP) -> dict:
    """Where a decode step's time goes: one `k3` run of PROFILE_GEN tokens with py-spy
    (--native, so the C kernels are named) attached after token PROFILE_SKIP, so the
    samples are steady decode steps (the prompt, the first touch of the trunk and the
    cache's compulsory fill are excluded).  Each sample of the main thread is charged to
    the deepest frame of the engine's own code (a .py, .pyx or .h of k3engine); samples of
    other threads (expert and trunk readers) are counted apart: they overlap the main one.
    The engine's own per-step timers (trunk and expert read seconds) are reported beside.
    skip = 0, gen = 1 profiles a prefill instead (attached at once; set-up is included,
    seconds against the prefill's minutes)."""
    import shutil
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    raw, ev = os.path.join(tmp, "prof.txt"), os.path.join(tmp, "events.jsonl")
    cmd = [sys.executable, "-m", "k3engine", model, "--ids", ids,
           "--gen", str(gen), "--incremental", "--stream-tokens", "--events", ev,
           "--out", os.path.join(tmp, "o.json"), *args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    seen, spy_p = 0, None

    def attach():
        return subprocess.Popen([spy, "record", "--pid", str(p.pid), "--native", "--threads",
                                 "--rate", str(rate), "--format", "raw", "-o", raw],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if skip == 0:
        spy_p = attach()
    for line in p.stdout:
        if line.startswith("@K3TOKEN"):
            seen += 1
            if seen == skip and spy_p is None:
                spy_p = attach()
    p.wait()
    if spy_p is not None:
        spy_p.wait()
    if p.returncode != 0 or spy_p is None or not os.path.exists(raw):
        raise RuntimeError(f"profile run failed: {' '.join(cmd)} -> {p.returncode}")
    steps = [e for e in map(json.loads, open(ev)) if e.get("ev") == "step"][skip:]
    by_thread: dict[str, dict[str, int]] = {}
    runs_cli: dict[str, int] = {}          # the main thread is the one running k3engine.cli
    cats: dict[str, dict[str, int]] = {}
    for line in open(raw):
        stack, n = line.rstrip("\n").rsplit(" ", 1)
        frames = stack.split(";")
        own = [f.split(" (")[0] for f in frames if "k3engine/" in f]
        leaf = own[-1] if own else f"(outside the engine: {frames[-1].split(' (')[0][:40]})"
        if "k3engine/cli.py" in stack:
            runs_cli[frames[0]] = runs_cli.get(frames[0], 0) + int(n)
        if not own or not own[-1].startswith("k3_"):
            if any(w in frames[-1] for w in ("cond_wait", "cond_timedwait", "sem_wait", "futex")) \
                    or any(w in stack for w in ("_queue_SimpleQueue_get", "Condition.wait",
                                                "Event.wait", "Future.result")):
                leaf = f"(waiting) {leaf}"
        d = by_thread.setdefault(frames[0], {})
        d[leaf] = d.get(leaf, 0) + int(n)
        c = cats.setdefault(frames[0], {})
        c[profile_category(stack, leaf)] = c.get(profile_category(stack, leaf), 0) + int(n)
    main = max(runs_cli, key=runs_cli.get) if runs_cli else max(
        by_thread, key=lambda t: sum(by_thread[t].values()))
    others: dict[str, int] = {}
    for t, d in by_thread.items():
        if t != main:
            for k, v in d.items():
                others[k] = others.get(k, 0) + v
    return {"skip": skip, "gen": gen, "main": by_thread[main], "others": others, "categories": cats[main],
            "step_s": [e["seconds"] for e in steps],
            "trunk_read_s": [e["trunk_read_s"] for e in steps],
            "expert_read_s": [e["expert_read_s"] for e in steps],
            "read_bytes": [e["trunk_bytes"] + e["expert_bytes"] for e in steps]}


def profile_category(stack: str, leaf: str) -> str:
    """A main-thread sample's share of a step: which kernel family, or reading, or the
    Python around them."""
    if leaf.startswith("k3_") or "k3engine/kernels/k3" in stack:
        for fam in ("bf16", "mxfp4", "mla", "kda", "f32", "i8r"):
            if fam in leaf.lower():
                return f"C kernels: {fam}"
        return "C kernels: other"
    if "k3engine/trunk.py" in stack:
        return "trunk: read / wait / bind"
    if "k3engine/experts.py" in stack:
        return "experts: read / wait / cache"
    if "_kernels.pyx" in stack:
        return "Cython wrappers of the kernels"
    return "Python and NumPy around them"


def print_profile(name: str, prof: dict, top: int = 14) -> None:
    main = prof["main"]
    total = sum(main.values()) or 1
    n = len(prof["step_s"])
    st, tr, ex = (sum(prof[k]) / max(n, 1) for k in ("step_s", "trunk_read_s", "expert_read_s"))
    print(f"profile: {name}: steps {prof['skip']}..{prof['gen'] - 1}, mean step {st:.3f} s = "
          f"trunk read {tr:.3f} + expert read {ex:.3f} + the rest {st - tr - ex:.3f} (engine "
          f"timers); {total} main-thread samples", flush=True)
    cats = prof["categories"]
    print("  by kind: " + ", ".join(f"{k} {100 * v / total:.1f}%"
                                   for k, v in sorted(cats.items(), key=lambda kv: -kv[1])))
    for k, v in sorted(main.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {100 * v / total:5.1f}%  {k}")
    if prof["others"]:
        o = sum(prof["others"].values())
        print(f"  other threads ({o} samples, overlapping the main one): " + ", ".join(
            f"{k} {v}" for k, v in sorted(prof["others"].items(), key=lambda kv: -kv[1])[:5]))


# a row's figure -> the run_once key it is the median of
ROW_MEDIANS = {"s_per_token": "spt", "steady_s_per_token": "steady",
               "steady_cpu_s_per_token": "steady_cpu", "gb_read_per_step": "read_gb",
               "steady_gb_read": "steady_read_gb", "steady_io_s": "steady_io_s", "io_share": "io",
               "ttft_s": "ttft", "ttft_trunk_read_s": "ttft_trunk_s",
               "ttft_expert_read_s": "ttft_expert_s", "ttft_read_gb": "ttft_read_gb",
               "process_wall_s": "process_wall", "peak_rss_gb": "peak"}


def madds_per_position(model: str) -> tuple[int, int]:
    """(dense, routed) multiply-adds of one prompt position's projections: every 2-D weight
    once, except the embedding (a row lookup) and the LM head (the last position only), and
    the routed experts' MXFP4 weights once per selected expert (two E2M1 a byte).  Attention
    over the context (grows with the position) is not counted."""
    from k3engine.checkpoint import parse_header
    cfg = json.load(open(os.path.join(model, "config.json")))
    cfg = cfg.get("text_config", cfg)
    dense = routed = 0
    for shard in sorted(f for f in os.listdir(model) if f.endswith(".safetensors")):
        for e in parse_header(os.path.join(model, shard))[0]:
            if len(e.shape) != 2 or "embed_tokens" in e.name or "lm_head" in e.name:
                continue
            if ".experts." in e.name:
                routed += 2 * e.nbytes if e.name.endswith("weight_packed") else 0
            elif e.dtype in ("BF16", "F16", "F32"):
                dense += e.shape[0] * e.shape[1]
    return dense, routed * cfg["num_experts_per_token"] // cfg["num_experts"]


def fma_ceiling(threads: int) -> float | None:
    """G double multiply-adds/s of `threads` threads by benchmarks/fma_peak.c (None without a
    compiler)."""
    import shutil
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        exe = os.path.join(d, "fma_peak")
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fma_peak.c")
        if subprocess.run([cc, "-O3", "-march=native", "-fopenmp", src, "-o", exe]).returncode:
            return None
        out = subprocess.run([exe], capture_output=True, text=True,
                             env=dict(os.environ, OMP_NUM_THREADS=str(threads))).stdout
    found = re.findall(r"(\d+) thread\(s\): ([\d.]+) G", out)
    return next((float(g) for n, g in found if int(n) == threads), None)


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def markdown(path: str) -> str:
    """The docs' tables from a --json result (budgets, prefill or profile rows)."""
    with open(path) as f:
        r = json.load(f)
    load = lambda x: f"{100 * (x['other_load'] or 0):.0f}% / {x['load_average']}"
    if "profiles" in r:
        out = []
        for p in r["profiles"]:
            total = sum(p["categories"].values()) or 1
            n = max(len(p["step_s"]), 1)
            st, tr, ex = (sum(p[k]) / n for k in ("step_s", "trunk_read_s", "expert_read_s"))
            out += [f"**{p['budget']}** (steps {p['skip']}..{p['gen'] - 1}: mean {st:.3f} s = "
                    f"trunk read {tr:.3f} + expert read {ex:.3f} + the rest {st - tr - ex:.3f}; "
                    f"{total} main-thread samples; other load / load avg {load(p)})", "",
                    "| where (main thread) | share |", "|---|---:|"]
            out += [f"| {k} | {100 * v / total:.1f}% |"
                    for k, v in sorted(p["categories"].items(), key=lambda kv: -kv[1])]
            out += ["", "| deepest engine frame | share |", "|---|---:|"]
            out += [f"| `{k}` | {100 * v / total:.1f}% |"
                    for k, v in sorted(p["main"].items(), key=lambda kv: -kv[1])[:12]]
            out.append("")
        return "\n".join(out)
    rows = r["rows"]
    if rows and rows[0]["prompt"] != 5:
        out = ["| positions | budget | runs | TTFT s | = trunk read + expert read + compute | "
               "s/position | decode step s (steps 1-3) | decode step / position | peak RSS GB "
               "| other load / load avg |", "|---:|---|---:|---:|---|---:|---:|---:|---:|---|"]
        for x in rows:
            comp = x["ttft_s"] - x["ttft_trunk_read_s"] - x["ttft_expert_read_s"]
            out.append(f"| {x['prompt']:,} | {x['budget']} | {x['runs']} | {x['ttft_s']:.2f} | "
                       f"{x['ttft_trunk_read_s']:.2f} + {x['ttft_expert_read_s']:.2f} + "
                       f"{comp:.2f} | {x['s_per_position']:.4f} | {x['steady_s_per_token']:.3f} | "
                       f"{x['steady_s_per_token'] / x['s_per_position']:.1f}x | "
                       f"{x['peak_rss_gb']:.2f} | {load(x)} |")
        return "\n".join(out)
    dev = r["device_mb_s"]
    out = [f"device (k3 devbw's code, 4 MiB O_DIRECT): QD1 {dev['1']:.0f}, QD4 {dev['4']:.0f}, "
           f"QD16 {dev['16']:.0f} MB/s at the start; the I/O floor uses QD16 as measured just "
           f"before its row (where the JSON has it)", "",
           "| budget | s/token | steady s/token | GB read per step | I/O floor s (GB / QD16) | "
           "engine's read timers s | I/O share | peak RSS GB | plan GB | other load / load avg |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for x in rows:
        rate = f" ({x['device_qd16_mb_s']:.0f} MB/s)" if "device_qd16_mb_s" in x else ""
        out.append(f"| {x['budget']} | {x['s_per_token']:.3f} | {x['steady_s_per_token']:.3f} | "
                   f"{x['steady_gb_read']:.3f} | {x['io_floor_s']:.3f}{rate} | {x['steady_io_s']:.3f} | "
                   f"{x['io_share']:.1f}% | {x['peak_rss_gb']:.2f} | {x['plan_gb']:.2f} | {load(x)} |")
    return "\n".join(out)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--markdown":
        print(markdown(sys.argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("trunk")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--threads", type=int, help="engine threads (default: the engine's)")
    ap.add_argument("--budgets", help="comma-separated row indices of the budget table")
    ap.add_argument("--prefill", metavar="N,N,...", help="time prompts of these lengths")
    ap.add_argument("--profile", action="store_true",
                    help="profile steady decode steps with py-spy instead (rows: --budgets, "
                         "default resident and trunk 0.5 + cache 0.5); with --prefill N, "
                         "the prefill of N positions")
    ap.add_argument("--ids", help="the prompt of --profile (default: the 5 ids of the tables)")
    ap.add_argument("--json")
    ap.add_argument("--hybrid", metavar="DRAFT_TRUNK_DIR")
    ap.add_argument("--fma-gmadds", type=float,
                    help="with --prefill: the FMA peak (G multiply-adds/s at --threads) "
                         "instead of measuring it with benchmarks/fma_peak.c")
    a = ap.parse_args()
    budgets, topk, gen = BUDGETS, 0, a.gen
    lengths = [5]
    if a.hybrid:
        cfg = json.load(open(os.path.join(a.model, "config.json")))
        topk = cfg.get("text_config", cfg)["num_experts_per_token"]
        budgets = [(name, HYBRID_BASE + args) for name, args in HYBRID]
    if a.prefill:
        budgets, gen = PREFILL_BUDGETS, PREFILL_GEN
        lengths = [int(n) for n in a.prefill.split(",")]
    if a.budgets:
        budgets = [budgets[int(i)] for i in a.budgets.split(",")]
    extra = ["--threads", str(a.threads)] if a.threads else []
    vocab = vocab_of(a.model)
    if a.profile:
        profiles = []
        with tempfile.TemporaryDirectory() as tmp:
            for name, args in (budgets if a.budgets else PREFILL_BUDGETS):
                with ForeignLoad(children=True) as fl:
                    prof = profile_run(a.model, [x.format(trunk=a.trunk) for x in args] + extra,
                                       tmp, prompt_ids(lengths[0], vocab) if a.prefill
                                       else a.ids or prompt_ids(5, vocab),
                                       **(dict(gen=1, skip=0) if a.prefill else {}))
                print_profile(f"{name}, threads {a.threads or 'default'}, other load "
                              f"{100 * (fl.fraction or 0):.0f}%, load avg {fl.load}", prof)
                profiles.append(dict(budget=name, other_load=fl.fraction, load_average=fl.load,
                                     **prof))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(dict(profiles=profiles, argv=sys.argv), f, indent=1)
        return 0
    shard = sorted(f for f in os.listdir(a.model) if f.endswith(".safetensors"))[0]
    with ForeignLoad() as fl_dev:
        dev, direct = device_bandwidth(os.path.join(a.model, shard))
    dropped = drop_caches()
    print(f"machine: {platform.processor() or platform.machine()} | cores {os.cpu_count()} | "
          f"device read (k3 devbw's code, 4 MiB, {'O_DIRECT' if direct else 'buffered'}) QD1 "
          f"{dev[1]:.0f} / QD4 {dev[4]:.0f} / QD16 {dev[16]:.0f} MB/s (other load "
          f"{100 * (fl_dev.fraction or 0):.0f}%) | page cache dropped between runs: {dropped} "
          f"| threads {a.threads or 'engine default'} | load average {loadavg()}", flush=True)
    ceiling_s = None            # a position's projections at the FMA peak
    if a.prefill:
        dense, routed = madds_per_position(a.model)
        peak = a.fma_gmadds or fma_ceiling(a.threads or os.cpu_count())
        if peak:
            ceiling_s = (dense + routed) / (peak * 1e9)
        print(f"a position's projections: {dense / 1e9:.3f} G dense + {routed / 1e9:.3f} G "
              f"routed multiply-adds; FMA peak {peak or 'unknown'} G/s -> at least "
              + (f"{ceiling_s:.4f} s/position" if ceiling_s else "(no compiler: --fma-gmadds)"),
              flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in lengths:
            ids_text = prompt_ids(n, vocab)
            for name, args in budgets:
                args = [x.format(trunk=a.trunk, draft=a.hybrid, topk=topk) for x in args] + extra
                runs = []
                bw = device_bandwidth(os.path.join(a.model, shard), depths=(16,))[0][16]
                with ForeignLoad(children=True) as fl:
                    for _ in range(a.runs):
                        drop_caches()
                        runs.append(run_once(a.model, args, gen, tmp, ids_text))
                ids = {tuple(r["ids"]) for r in runs}
                row = dict(budget=name, prompt=n, runs=a.runs, threads=a.threads,
                           **{out: median_of(runs, key) for out, key in ROW_MEDIANS.items()})
                row.update(device_qd16_mb_s=bw, ceiling_s=ceiling_s,
                           io_floor_s=row["steady_gb_read"] * 1e3 / bw,
                           ttft_io_floor_s=row["ttft_read_gb"] * 1e3 / bw,
                           s_per_position=row["ttft_s"] / n, peak_rss_gb=row["peak_rss_gb"] / 1e9,
                           plan_gb=runs[0]["plan"] / 1e9, ids=list(next(iter(ids))),
                           drafted=runs[0]["drafted"], accepted=runs[0]["accepted"],
                           ids_identical_across_runs=len(ids) == 1,
                           each_run={k: [r[k] for r in runs] for k in ("ttft", "steady", "steady_cpu", "spt")},
                           other_load=fl.fraction, load_average=fl.load)
                rows.append(row)
                load = (f"other load {100 * (fl.fraction or 0):.0f}%, load avg {fl.load}")
                if a.prefill:
                    ttft = row["ttft_s"]
                    comp = ttft - row["ttft_trunk_read_s"] - row["ttft_expert_read_s"]
                    print(f"prefill {n:5d} {name:38s} ttft {ttft:8.2f} s = trunk read "
                          f"{row['ttft_trunk_read_s']:.2f} + expert read "
                          f"{row['ttft_expert_read_s']:.2f} + compute {comp:.2f} | "
                          f"{row['s_per_position']:.4f} s/position | decode step "
                          f"{row['steady_s_per_token']:.3f} s ({row['steady_s_per_token'] / row['s_per_position']:.1f}x"
                          f" a position; at the FMA peak it could be "
                          + (f"{row['steady_s_per_token'] / ceiling_s:.1f}x" if ceiling_s else "?")
                          + f") | peak {row['peak_rss_gb']:.2f} GB | {load}", flush=True)
                    continue
                print(f"{name:40s} {row['s_per_token']:7.3f} s/tok (steady {row['steady_s_per_token']:.3f}"
                      f", CPU {row['steady_cpu_s_per_token']:.3f})"
                      f"  {row['steady_gb_read']:6.3f} GB/step, I/O floor {row['io_floor_s']:.3f} s"
                      f" (device {bw:.0f} MB/s)"
                      f"  I/O {row['io_share']:5.1f}%  "
                      f"peak {row['peak_rss_gb']:5.2f} GB (plan {row['plan_gb']:5.2f})"
                      + (f"  accepted {row['accepted']}/{row['drafted']}" if row["drafted"] else "")
                      + f" | {load}", flush=True)
    same = all(len({tuple(r["ids"]) for r in rows if r["prompt"] == n}) == 1 for n in lengths)
    print(f"ids identical across all budgets (per prompt): {same} ({rows[0]['ids']})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device_mb_s=dev, direct=direct, rows=rows, ids_identical=same,
                           argv=sys.argv), f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
