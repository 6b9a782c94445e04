"""`k3 forecast MODEL_DIR|k3 [--trunk DIR] [--preset NAME] [--trunk-gb X] [--cache-gb Y]
[--trunk-ring N] [--prompt-len N] [--gen N] [--trace FILE] [--json]`: before a run, what it
will cost on this machine -- peak RSS, bytes read per token, s/token, time to first token --
each figure with what it was computed from (k3engine.forecast).

MODEL_DIR `k3` (or `kimi-k3`) forecasts the released Kimi K3 from its published shapes,
without the checkpoint; a packed trunk is assumed (every preset streams it).  The first run
measures the machine (a device read test in --device and a kernel calibration, ~15 s)
and caches the figures under the user cache dir, keyed by the machine's identity.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from ..errors import EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, describe
from ..experts import POLICIES
from ..memory import BudgetError, available_memory, human, resolve_budgets

RELEASED_NAMES = ("k3", "kimi-k3")
MEMORY_FLAGS = ("--preset", "--trunk-gb", "--cache-gb")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="k3 forecast", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        epilog="Exit codes: 0 forecast printed, 1 the model or trunk cannot be opened or "
               "the machine cannot be measured, 2 usage.")
    ap.add_argument("model", metavar="MODEL_DIR|k3")
    ap.add_argument("--trunk", metavar="DIR", help="packed trunk: forecast a streamed run")
    ap.add_argument("--config", metavar="PATH", help="config file (default MODEL_DIR/config.json)")
    for flag in MEMORY_FLAGS:
        ap.add_argument(flag, metavar="X", help="as for k3 (applied in argv order)")
    ap.add_argument("--trunk-ring", type=int, default=2, metavar="N")
    ap.add_argument("--ultra-low-memory", action="store_true")
    ap.add_argument("--prompt-len", type=int, default=16, metavar="N")
    ap.add_argument("--gen", type=int, default=8, metavar="N")
    ap.add_argument("--batch", type=int, default=1, metavar="B",
                    help="also price B sequences decoded together (k3 --batch, serve "
                         "--parallel): one trunk pass per step for all")
    ap.add_argument("--accept", type=float, metavar="A",
                    help="also price block drafting (--draft-model): A accepted drafts a "
                         "verification pass on average (A + 1 tokens a pass)")
    ap.add_argument("--block", type=int, default=None, metavar="N",
                    help="positions a drafter's pass proposes and the target verifies "
                         "(default 16, DFlash's)")
    ap.add_argument("--lookahead-recall", type=float, metavar="R",
                    help="also price lookahead expert reads whose guess names this share "
                         "(0-1) of a layer's routed experts: bytes read early and wasted "
                         "(the misses come from --trace when given)")
    ap.add_argument("--trace", metavar="FILE",
                    help="expert_trace.bin of a run (--dump-cache-trace): its hit rate "
                         "replayed through the cache's policy replaces the uniform-routing "
                         "assumption")
    ap.add_argument("--cache-policy", choices=sorted(POLICIES),
                    help="the policy --trace is replayed with, as for k3 (default lru)")
    ap.add_argument("--device", metavar="DIR",
                    help="where to measure the read rate (default: the trunk, else the model "
                         "directory, else the cache dir)")
    ap.add_argument("--threads", type=int, metavar="N")
    ap.add_argument("--refresh", action="store_true", help="measure the machine again")
    ap.add_argument("--read-gbs", type=float, metavar="X",
                    help="use this device read rate instead of the measured one (another "
                         "machine's published figure)")
    ap.add_argument("--bf16-gbs", type=float, metavar="X")
    ap.add_argument("--mxfp4-gbs", type=float, metavar="X")
    ap.add_argument("--no-expert-pipeline", action="store_true",
                    help="model K3_NO_EXPERT_PIPELINE=1: each layer's expert reads land "
                         "before its experts compute (default: the SYSTEM 4.5 pipeline, "
                         "reads behind compute, as the engine runs)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return ap


def memory_flags(argv: list[str]) -> list[tuple[str, str]]:
    """The budget flags in argv order, as `k3` applies them."""
    out = []
    for i, a in enumerate(argv[:-1]):
        if a in MEMORY_FLAGS:
            out.append((a, argv[i + 1]))
        elif a == "--ultra-low-memory":
            out.append((a, True))
    if argv and argv[-1] == "--ultra-low-memory":
        out.append(("--ultra-low-memory", True))
    return out


def text_lines(fc) -> list[str]:
    p = fc.plan
    tp = p.trunk_plan
    where = (f"trunk streamed: {tp.n_pinned}/{p.layers} layers pinned, ring {tp.ring_slots}"
             if tp is not None else "trunk resident")
    out = [f"k3 forecast: {fc.model}",
           f"  plan: trunk {p.trunk_gb:g} GB / expert cache {p.cache_gb:g} GB "
           f"({p.expert_slots} slots); {where}",
           f"  prompt {fc.prompt_len} positions, {fc.gen} tokens generated",
           "",
           f"  peak RSS          {human(fc.peak_rss_bytes):>10}   (planner's total "
           f"{human(fc.plan_bytes)})",
           f"  read per token    {human(fc.bytes_read_per_token):>10}   (trunk "
           f"{human(fc.trunk_bytes_per_token)} + experts {human(fc.expert_bytes_per_token)}"
           f" at {100 * fc.hit_rate:.1f}% hit)",
           f"  first token reads {human(fc.first_token_bytes):>10}",
           f"  s/token (steady)  {fc.s_per_token:10.3f}   (compute {fc.compute_s:.3f} s, "
           f"I/O {fc.io_s:.3f} s before overlap)",
           f"  time to 1st token {fc.ttft_s:10.3f} s",
           f"  s/token over {fc.gen:<4} {fc.s_per_token_run:10.3f}   (what the run's "
           f"'s/token average' line reports)"]
    la, bd = fc.lookahead, fc.block
    if la:
        out += [f"  lookahead         {la['s_per_token']:10.3f}   s/token at recall "
                f"{100 * la['recall']:.0f}% ({fc.s_per_token:.3f} without): "
                f"{human(la['overlapped_bytes_per_token'])} a token read early, "
                f"{human(la['wasted_bytes_per_token'])} wasted"]
    if bd:
        out += [f"  block drafting    {bd['s_per_token']:10.3f}   s/token at {bd['accept']:g} "
                f"accepted a pass ({bd['tokens_per_pass']:g} tokens per {bd['pass_s']:.3f} s "
                f"pass of {bd['block']} positions), {human(bd['bytes_per_token'])} read per "
                f"token ({bd['expert_union']:g} experts a layer)"]
    if fc.batch > 1:
        out += [f"  batch of {fc.batch:<4}     {fc.batch_step_s:10.3f} s a step, "
                f"{fc.batch_tokens_per_s:.3f} tokens/s in all "
                f"({fc.batch_tokens_per_s * fc.s_per_token:.2f}x one sequence), "
                f"{human(fc.batch_bytes_per_token)} read per token"]
    out += ["", "  computed from:"]
    out += [f"    - {a}" for a in fc.assumptions]
    for r in p.refusals:
        first = r.message.strip().splitlines()[0] if r.message.strip() else r.kind
        out.append(f"  NOTE: this plan would be refused on this machine ({first})")
    return out


def main(argv: list[str]) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    if a.prompt_len < 1 or a.gen < 1 or not 1 <= a.trunk_ring <= 8 or not 1 <= a.batch <= 64:
        ap.error("--prompt-len and --gen must be >= 1, --trunk-ring 1..8, --batch 1..64")
    if a.accept is not None and not 0 <= a.accept < (a.block or 16):
        ap.error("--accept must be >= 0 and below --block (the drafts a pass can accept)")
    if a.block is not None and (a.accept is None or not 1 <= a.block <= 64):
        ap.error("--block N (1..64) goes with --accept")
    if a.lookahead_recall is not None and not 0 <= a.lookahead_recall <= 1:
        ap.error("--lookahead-recall is a share, 0..1")
    try:
        budgets = resolve_budgets(memory_flags(argv))
    except BudgetError as e:
        print(f"k3 forecast: {e}", file=sys.stderr)
        return EXIT_USAGE
    from .. import forecast as F
    try:
        released = a.model in RELEASED_NAMES and not os.path.isdir(a.model)
        if released:
            model = F.released_k3()
        elif not os.path.isdir(a.model):
            print(f"k3 forecast: {a.model}: not a directory (give a checkpoint, or 'k3' for "
                  f"the released Kimi K3)", file=sys.stderr)
            return EXIT_RUNTIME
        else:
            model = F.local_model(a.model, a.trunk, a.config)
        device = a.device or a.trunk or (None if released else a.model)
        if device is None:
            device = os.path.dirname(F.cache_file())
            os.makedirs(device, exist_ok=True)
        machine = F.machine_figures(device, a.threads, a.refresh).with_overrides(
            a.read_gbs, a.bf16_gbs, a.mxfp4_gbs)
        hits = F.TraceRouting.from_file(a.trace, a.cache_policy) if a.trace else None
    except Exception as e:  # noqa: BLE001 - engine failures are reported, bugs propagate
        known = describe(e)
        if known is None and not isinstance(e, (OSError, ValueError)):
            raise
        print(known[2] if known else f"k3 forecast: {e}", file=sys.stderr)
        return known[0] if known else EXIT_RUNTIME
    _, probe = available_memory()
    kw = budgets.plan_kwargs()
    fc = F.forecast(model, machine, preset=kw["preset"], trunk_gb=kw["trunk_gb"],
                    cache_gb=kw["cache_gb"], trunk_ring=a.trunk_ring, ultra=kw["ultra"],
                    prompt_len=a.prompt_len, gen=a.gen, hits=hits, available_bytes=probe,
                    expert_overlap=not a.no_expert_pipeline, batch=a.batch,
                    lookahead_recall=a.lookahead_recall, accept=a.accept,
                    **({"block": a.block} if a.block else {}))
    if a.json:
        print(json.dumps(fc.as_json()))
    else:
        print("\n".join(text_lines(fc)))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
