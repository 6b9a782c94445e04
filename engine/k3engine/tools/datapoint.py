"""`k3 datapoint MODEL_DIR [--trunk DIR] [budget flags] [--gen N] [--prompt-len N] [--out
PATH]` (also `k3 doctor --datapoint [PATH] --model DIR [--trunk DIR]`): a shareable benchmark
record -- machine, model, plan, measured s/token, time to first token, expert hit rate,
peak RSS, version -- written as PATH.json and PATH.md, with nothing personal in it.

The measured part comes from a real run of the engine in a child process (so its peak RSS
is the run's own), read back from its --events telemetry; `--from-events FILE` builds the
record from a run already made with `k3 ... --events FILE` instead.

Nothing personal: the record is assembled from numbers and fixed vocabulary only (no path,
host or user name ever enters it), and `check_impersonal` refuses to write a record in
which this machine's user name, home, host name or a given path appears anyway.
"""
from __future__ import annotations

import argparse
import getpass
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile

from .. import REFERENCE_VERSION, __version__
from ..atomic import write_atomic
from ..errors import EXIT_OK, EXIT_OUT, EXIT_RUNTIME, EXIT_USAGE
from ..memory import human

SCHEMA = "k3studio.datapoint/1"
DEFAULT_PATH = "k3-datapoint"
MEMORY_FLAGS = ("--preset", "--trunk-gb", "--cache-gb", "--trunk-ring")


class PersonalDataError(ValueError):
    pass


# ---- the parts of a record -------------------------------------------------------------

def machine_section(device_dir: str | None, threads: int | None = None,
                    figures=None) -> dict:
    """Cores, memory, CPU model, OS and the device's measured read rate (the forecast's
    cached machine figures: measured once per machine; `figures`, a MachineFigures the
    caller already holds -- the app's forecast column -- is used as it is)."""
    from ..forecast import machine_figures
    from ..threads import physical_cores
    out = {"cpu": _cpu(), "logical_cpus": os.cpu_count() or 1,
           "physical_cores": physical_cores(), "memory_bytes": _mem_total(),
           "os": f"{platform.system()} {platform.machine()}",
           "python": platform.python_version()}
    if device_dir or figures is not None:
        m = figures if figures is not None else machine_figures(device_dir, threads)
        out["disk_read_mbs"] = {f"qd{q}": round(v / 1e6, 1) for q, v in
                                sorted(m.read_bps.items(), key=lambda kv: int(kv[0]))}
        out["disk_read_direct"] = m.direct
    return out


def _cpu() -> str:
    from ..machine import _cpu_model
    return _cpu_model()


def _mem_total() -> int:
    from ..machine import _mem_total as total
    return total()


def model_name(cfg) -> str:
    """The released model by its shape, one of our generated sizes by its --dims name, else
    a description of the shape: never the directory's name."""
    from ..config import parse_config
    from ..forecast import RELEASED_K3_CONFIG
    from .make_checkpoint import DIMS
    if _same_shape(cfg, parse_config(RELEASED_K3_CONFIG)):
        return "Kimi K3"
    demo = _shipped_demo_config()
    if demo is not None and _same_shape(cfg, demo):
        return "the K3 Studio demo model (tiny, trained; not Kimi K3)"
    for name, dims in DIMS.items():
        d = dict(dims)
        if d.get("vocab_size") is None:
            d["vocab_size"] = cfg.vocab
        if _same_shape(cfg, parse_config(d)):
            return f"generated '{name}' (k3 make-checkpoint --dims {name})"
    return "custom checkpoint"


def _shipped_demo_config():
    """The shipped trained demo model's config (k3 demo --path), or None without it."""
    from ..config import ConfigError
    from ..loading import read_config
    from .demo import shipped_dir
    try:
        return read_config(shipped_dir(), None)[0]
    except (ConfigError, OSError):
        return None


def _same_shape(a, b) -> bool:
    keys = ("hidden", "n_layers", "vocab", "n_experts", "topk", "latent", "moe_inter",
            "kda_heads", "n_heads", "dense_inter")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def model_section(cfg) -> dict:
    return {"name": model_name(cfg), "hidden": cfg.hidden, "layers": cfg.n_layers,
            "vocab": cfg.vocab, "mla_layers": len(cfg.mla_layers), "experts": cfg.n_experts,
            "topk": cfg.topk, "moe_intermediate": cfg.moe_inter, "latent": cfg.latent}


def measured_section(events: list[dict]) -> tuple[dict, dict]:
    """(plan, measured) from a run's §7.5 events: the plan event, the steps, the summary."""
    plan_ev = next((e for e in events if e.get("ev") == "plan"), None)
    steps = [e for e in events if e.get("ev") == "step"]
    summary = next((e for e in reversed(events) if e.get("ev") == "summary"), None)
    if plan_ev is None or summary is None or not steps:
        raise ValueError("the events hold no complete run (need its plan, steps and summary)")
    plan = {k: plan_ev.get(k) for k in ("preset", "trunk_gb", "cache_gb", "streamed",
                                        "incremental", "ultra", "layers", "n_pinned",
                                        "ring_slots", "expert_slots", "positions")}
    plan["planned_bytes"] = plan_ev.get("total_bytes")
    decode = steps[1:]
    req = sum(s.get("expert_requests", 0) for s in steps)
    true_hits = [s.get("true_resident_hit") for s in decode if s.get("true_resident_hit") is not None]
    n = len(summary.get("generated_ids") or [])
    prompt = summary.get("prompt_ids") or []
    measured = {
        "tokens": n, "prompt_positions": prompt if isinstance(prompt, int) else len(prompt),
        "s_per_token": round(summary.get("seconds_per_token", 0.0), 4),
        "ttft_s": round(steps[0]["seconds"], 4),
        "decode_s_per_token_median": round(statistics.median(s["seconds"] for s in decode), 4)
        if decode else None,
        "expert_hit_rate": round(statistics.mean(true_hits), 4) if true_hits else None,
        "expert_requests": req,
        "bytes_read_per_decode_token": int(statistics.median(
            s.get("trunk_bytes", 0) + s.get("expert_bytes", 0) for s in decode)) if decode else None,
        "peak_rss_bytes": summary.get("peak_rss_bytes"),
        "io_share": round(summary.get("io_share", 0.0), 4),
        "ids_emitted": n,
    }
    if summary.get("reused_positions") is not None:    # a chat turn: the cached context
        measured["reused_positions"] = summary["reused_positions"]
    return plan, measured


def turn_events(plan_event: dict, steps: list[dict], ids: list[int], prompt_positions: int,
                reused: int, seconds: float, peak_rss_bytes: int | None) -> list[dict]:
    """A chat turn as the §7.5 events `build` reads, from what a front end that watched it
    holds (K3 Studio: the load's plan event, the turn's per-step records, its summary).
    Only the step event's own keys are taken from a record: the token text a record may
    carry never enters.  The I/O share is the steps' trunk + expert read seconds over the
    turn's wall time (the step events hold no model-table seconds)."""
    from ..events import StepTelemetry
    evs = [dict(plan_event, ev="plan")]
    for s in steps:
        evs.append({"ev": "step", "step": s["step"], "seconds": s["seconds"],
                    **{k: s[k] for k in StepTelemetry.EVENT_KEYS}})
    io = sum(s["trunk_read_s"] + s["expert_read_s"] for s in steps)
    evs.append({"ev": "summary", "prompt_ids": int(prompt_positions),
                "generated_ids": list(ids), "reused_positions": int(reused),
                "seconds_per_token": seconds / len(ids) if ids else 0.0,
                "peak_rss_bytes": peak_rss_bytes,
                "io_share": io / seconds if seconds > 0 else 0.0})
    return evs


SOURCE_CLI = "k3 datapoint: one incremental run of a fixed prompt, in a child process"
SOURCE_APP = "K3 Studio: the last chat reply of the session (the app's own process)"


def build(cfg, events: list[dict], machine: dict, threads: int | None,
          source: str = SOURCE_CLI) -> dict:
    plan, measured = measured_section(events)
    return {"schema": SCHEMA,
            "version": {"k3": __version__, "reference_compatible": REFERENCE_VERSION},
            "source": source,
            "machine": machine, "threads": threads, "model": model_section(cfg),
            "plan": plan, "measured": measured,
            "note": "one run; the s/token of a single run can differ by a third from the next "
                    "(SYSTEM §11.5); quote several"}


# ---- nothing personal ------------------------------------------------------------------

def personal_strings(paths=()) -> list[str]:
    """What must never appear in a shared record: the user's name, home directory, the
    host's name, and every path the record was made from (absolute and as given)."""
    out = set()
    for get in (getpass.getuser, lambda: os.path.expanduser("~"), socket.gethostname):
        try:
            v = get()
        except Exception:  # noqa: BLE001 - a name that cannot be read cannot leak either
            continue
        if v and len(v) >= 3 and v not in ("/", "root"):
            out.add(v)
    for p in paths:
        if p:
            out.update({str(p), os.path.abspath(str(p))})
    return sorted(out, key=len, reverse=True)


def check_impersonal(text: str, paths=()) -> None:
    """Refuse (PersonalDataError) a record that names the user, home, host or a path.
    The trap: a model's directory name or the CPU string echoing the host's name would
    otherwise slip into a file meant to be posted (test_datapoint checks it)."""
    low = text.lower()
    for s in personal_strings(paths):
        if s.lower() in low:
            raise PersonalDataError("the record would contain a personal string (a path, the "
                                    "user, home or host name); nothing was written")


def markdown(rec: dict) -> str:
    m, mo, p, r = rec["machine"], rec["model"], rec["plan"], rec["measured"]
    # by queue depth, not key order: the JSON is written with sorted keys ("qd16" < "qd4"),
    # so a record read back would otherwise render differently from the one written
    disk = ", ".join(f"{k.upper()} {v:g} MB/s" for k, v in
                     sorted(m.get("disk_read_mbs", {}).items(), key=lambda kv: int(kv[0][2:])))
    rows = [
        ("version", f"k3 {rec['version']['k3']} (reference-compatible with kimi-k3-in-c "
                    f"{rec['version']['reference_compatible']})"),
        ("machine", f"{m['cpu']}, {m['physical_cores']} cores ({m['logical_cpus']} logical), "
                    f"{human(m['memory_bytes'])} RAM, {m['os']}"),
        ("disk read", disk or "not measured"),
        ("threads", str(rec["threads"])),
        ("model", f"{mo['name']}: hidden {mo['hidden']}, {mo['layers']} layers, "
                  f"{mo['experts']} experts top-{mo['topk']}"),
        ("plan", (f"preset {p['preset']}; " if p.get("preset") else "")
         + f"trunk {p['trunk_gb']:g} GB / cache {p['cache_gb']:g} GB; "
         + (f"streamed, {p['n_pinned']}/{p['layers']} layers pinned, ring {p['ring_slots']}"
            if p.get("streamed") else "trunk resident")
         + f"; {p['expert_slots']} expert slots; planned {human(p['planned_bytes'] or 0)}"),
        ("s/token", f"{r['s_per_token']:.3f} over {r['tokens']} tokens (decode median "
                    f"{r['decode_s_per_token_median']} s)"),
        ("measured by", rec.get("source", SOURCE_CLI)),
        ("time to first token", f"{r['ttft_s']:.3f} s for {r['prompt_positions']} prompt positions"
         + (f" ({r['reused_positions']} of them reused from the turn before)"
            if r.get("reused_positions") else "")),
        ("expert hit rate", "n/a" if r["expert_hit_rate"] is None
         else f"{100 * r['expert_hit_rate']:.1f}% (true resident, decode steps)"),
        ("read per decode token", "n/a" if r["bytes_read_per_decode_token"] is None
         else human(r["bytes_read_per_decode_token"])),
        ("peak RSS", human(r["peak_rss_bytes"] or 0)),
    ]
    out = ["# K3 Studio benchmark datapoint", "", "| | figure |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in rows]
    out += ["", f"_{rec['note']}._", ""]
    return "\n".join(out)


def write(rec: dict, path: str, paths=()) -> tuple[str, str]:
    """PATH.json and PATH.md (PATH without a .json/.md suffix), atomically, after the
    personal-data check of both."""
    base = path[:-5] if path.endswith(".json") else path[:-3] if path.endswith(".md") else path
    js = json.dumps(rec, indent=1, sort_keys=True) + "\n"
    md = markdown(rec)
    check_impersonal(js + md, paths)
    write_atomic(base + ".json", js.encode())
    write_atomic(base + ".md", md.encode())
    return base + ".json", base + ".md"


# ---- making the measurement ------------------------------------------------------------

def prompt_ids(n: int, vocab: int) -> list[int]:
    """A fixed prompt within any vocabulary (datapoints compare like with like)."""
    return [(1000 + 7919 * i) % vocab for i in range(n)]


def own_peak_rss() -> int | None:
    """This process's own peak RSS (telemetry.vm_hwm_bytes: not the parent's)."""
    from ..telemetry import vm_hwm_bytes
    return vm_hwm_bytes()


def child_main(argv: list[str]) -> int:
    """`python -m k3engine.tools.datapoint --child HWM_PATH K3_ARGS...`: the run itself,
    then its own peak RSS written to HWM_PATH."""
    from ..cli import main as k3_main
    code = k3_main(argv[1:])
    peak = own_peak_rss()
    with open(argv[0], "w") as f:
        f.write(json.dumps(peak))
    return code


def run_events(model_dir: str, flags: list[str], ids: list[int], gen: int,
               threads: int | None) -> list[dict]:
    """One real, incremental run of the engine in a child process; its events, the
    summary's peak RSS replaced by the child's own (see own_peak_rss)."""
    with tempfile.TemporaryDirectory(prefix="k3-datapoint-") as tmp:
        ev, out = os.path.join(tmp, "events.jsonl"), os.path.join(tmp, "out.json")
        hwm = os.path.join(tmp, "hwm.json")
        cmd = [sys.executable, "-m", "k3engine.tools.datapoint", "--child", hwm, model_dir,
               "--ids", ",".join(map(str, ids)), "--gen", str(gen), "--incremental",
               "--events", ev, "--out", out] + flags \
            + (["--threads", str(threads)] if threads else [])
        r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            tail = r.stderr.strip().splitlines()[-1:] or [f"exit {r.returncode}"]
            raise RuntimeError(f"the run failed (exit {r.returncode}): {tail[0]}")
        events = read_events(ev)
        with open(hwm) as f:
            peak = json.load(f)
        if peak:
            for e in events:
                if e.get("ev") == "summary":
                    e["peak_rss_bytes"] = peak
        return events


def read_events(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="k3 datapoint", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", metavar="MODEL_DIR")
    ap.add_argument("--trunk", metavar="DIR")
    for f in MEMORY_FLAGS:
        ap.add_argument(f, metavar="X")
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--from-events", metavar="FILE",
                    help="build from a finished run's --events file instead of running")
    ap.add_argument("--out", default=DEFAULT_PATH, metavar="PATH",
                    help="writes PATH.json and PATH.md (default %(default)s)")
    return ap


def main(argv: list[str]) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    if a.gen < 1 or a.prompt_len < 1:
        ap.error("--gen and --prompt-len must be >= 1")
    out_dir = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        # checked before the run, which can take minutes
        print(f"k3 datapoint: --out {a.out}: the directory does not exist or is not writable",
              file=sys.stderr)
        return EXIT_OUT
    from ..config import ConfigError
    from ..loading import read_config
    try:
        cfg, _ = read_config(a.model, None)
    except (ConfigError, OSError) as e:
        print(f"k3 datapoint: {e}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, ConfigError) else EXIT_RUNTIME
    flags = (["--trunk", a.trunk] if a.trunk else [])
    i = 0                                      # budget flags in argv order, as k3 applies them
    while i < len(argv) - 1:
        if argv[i] in MEMORY_FLAGS:
            flags += [argv[i], argv[i + 1]]
            i += 2
        else:
            i += 1
    try:
        events = (read_events(a.from_events) if a.from_events else
                  run_events(a.model, flags, prompt_ids(a.prompt_len, cfg.vocab), a.gen,
                             a.threads))
        # the threads the child ran with (it inherits OMP_NUM_THREADS): never "None"
        from ..threads import default_threads
        threads = a.threads or default_threads()
        rec = build(cfg, events, machine_section(a.trunk or a.model, threads), threads)
        paths = write(rec, a.out, [a.model, a.trunk, a.from_events])
    except (OSError, ValueError, RuntimeError) as e:
        print(f"k3 datapoint: {e}", file=sys.stderr)
        return EXIT_RUNTIME
    for p in paths:
        print(f"wrote {p}")
    return EXIT_OK


def doctor_hook(path: str, model: str | None, trunk: str | None) -> int:
    """`k3 doctor --datapoint [PATH]`: the datapoint of the doctor's --model/--trunk at
    the engine's default budgets (`k3 datapoint` takes explicit ones)."""
    if not model:
        print("k3 doctor: --datapoint needs --model DIR", file=sys.stderr)
        return EXIT_USAGE
    return main([model, "--out", path] + (["--trunk", trunk] if trunk else []))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.exit(child_main(sys.argv[2:]))
    sys.exit(main(sys.argv[1:]))
