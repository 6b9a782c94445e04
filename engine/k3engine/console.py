"""The reference's run report (SYSTEM §7.1-§7.3), rendered from the engine's events:
what `k3` and `k3 --chat` print to stdout/stderr, and the `--events` JSON lines.  The
printer computes nothing; every figure comes with its event."""
from __future__ import annotations

import os
import sys

from . import events as E
from .memory import human
from .report import RULE, STEP_HEADER, step_line
from .telemetry import Events


def config_line(cfg, path: str) -> str:
    n_mla = len(cfg.mla_layers)
    return (f"config: {os.path.basename(path)} ({cfg.shape} shape) | hidden={cfg.hidden} "
            f"layers={cfg.n_layers} vocab={cfg.vocab} | {n_mla} MLA + {cfg.n_layers - n_mla} KDA"
            f" | experts {cfg.n_experts} top{cfg.topk} shared{cfg.n_shared} | latent={cfg.latent}")


class Printer:
    """An event sink that prints the report and forwards the JSON lines to `events`.
    `on_step(ev)` is an extra hook for the batch front end (--dump-logits, --stream-tokens)."""

    def __init__(self, events: Events, on_step=None, step_lines: bool = True):
        self.events = events
        self.on_step = on_step
        self.step_lines = step_lines            # the batch table; the REPL has none

    def __call__(self, ev: E.Event) -> None:
        show = getattr(self, "_" + type(ev).__name__, None)
        if show is not None:
            show(ev)
        for kind, fields in ev.json():
            self.events.emit(kind, **fields)
        after = getattr(self, "_after_" + type(ev).__name__, None)
        if after is not None:
            after(ev)

    # -- set-up ---------------------------------------------------------------------
    def _ThreadsSet(self, ev):
        print(f"threads: {ev.threads}")

    def _ConfigRead(self, ev):
        print(config_line(ev.cfg, ev.path))
        if ev.layers < ev.cfg.n_layers:
            print(f"NOTE: binding only the first {ev.layers} of {ev.cfg.n_layers} layers. "
                  f"Output is NOT the full model; use it to test the machinery, not the "
                  f"answers.")

    def _TokenizerLoaded(self, ev):
        print(ev.report, file=sys.stderr)

    def _PromptRead(self, ev):
        print(f"  tokenized: {ev.nbytes} bytes -> {ev.n_ids} ids")

    def _RunHeader(self, ev):
        print("K3 Studio engine (Python + Cython), released checkpoint layout")
        print(f"  model    : {ev.model_dir}")
        if ev.n_prompt is not None:
            print(f"  prompt   : {ev.n_prompt} tokens, generating {ev.gen}")
        print()

    def _Indexed(self, ev):
        print(f"indexed {ev.n_tensors} tensors from {ev.n_shards} shards in "
              f"{ev.seconds:.2f} s")
        for note in ev.notes:
            print(f"note: {note}")

    def _Planned(self, ev):
        p = ev.plan
        if p.preset_line():
            print(p.preset_line())
        if p.auto is not None:
            print(p.auto.line)
        if ev.trunk_dir:
            print(f"trunk on disk : {human(ev.trunk_total_bytes)} total (STREAMED from "
                  f"{ev.trunk_dir}, not held in RAM)")
        print()
        for line in p.lines():
            print(line)

    def _after_Planned(self, ev: E.Planned) -> None:
        """After the plan event: the refusals (stderr), else the trunk plan."""
        p = ev.plan
        if p.refusals:
            for r in p.refusals:
                print(f"k3: {r.message}", file=sys.stderr)
        elif p.trunk_plan is not None:
            for line in p.trunk_plan.lines():
                print(line)

    def _TrunkNotice(self, ev):
        if ev.warning:
            print(f"k3: warning: {ev.message}", file=sys.stderr, flush=True)
        else:
            print(ev.message)

    def _Loaded(self, ev):
        if ev.streamed:
            print(f"trunk streaming enabled from {ev.trunk_dir} in {ev.seconds:.1f} s; reads "
                  f"use {'O_DIRECT (page cache bypassed)' if ev.direct else 'buffered I/O'}")
        else:
            print(f"resident trunk: {human(ev.resident_trunk_bytes)} in RAM (large matrices "
                  f"kept in the checkpoint's bf16, widened inside the matvec)")
        if ev.ultra:
            print(f"final norms: {human(ev.table_bytes)} resident; embedding and lm_head "
                  f"streamed in {ev.bind_seconds:.1f} s")
        else:
            print(f"embedding, final norm and lm_head: {human(ev.table_bytes)} in "
                  f"{ev.bind_seconds:.1f} s")
        print(f"peak RSS after loading weights: {human(ev.peak_rss_bytes)}  (the plan above "
              f"is a forecast, this is measured)")
        print(ev.cache_line)
        print(f"recurrent state: one {human(ev.state_bytes)} slot, cleared and reused across "
              f"{ev.n_layers} layers" if ev.one_recurrent_slot else
              f"recurrent state for {ev.n_layers} layers: {human(ev.state_bytes)}")

    def _DraftLoaded(self, ev):
        kind = f"{ev.bits}-bit derived" if ev.bits else "NOT quantised: exact weights"
        print(f"draft trunk: {human(ev.total_bytes)} ({kind}), pinned {ev.pinned}/"
              f"{ev.n_layers} layers, ring {ev.ring_slots} slots")

    def _DrafterLoaded(self, ev):
        print(f"block drafter: {ev.folder}: {ev.n_layers} layers, block {ev.block_size}, "
              f"reads target layers {list(ev.target_layers)}; {human(ev.weight_bytes)} in "
              f"{ev.seconds:.1f} s")

    # -- batch decode -------------------------------------------------------------------
    def _DecodeStarted(self, ev):
        r = ev.resumed
        if r is not None:
            print(f"resuming from {r.path}: {r.n_prior} prior positions, {r.n_new} new")
        if ev.incremental:                              # the order of SYSTEM §7.1
            print(f"incremental decode: KV cache {human(ev.kv_bytes)} for {ev.n_mla} MLA "
                  f"layers at {ev.positions} positions")
        if r is not None:
            print(f"restored {r.n_prior} positions in {r.seconds:.2f} s: decode continues "
                  f"without re-reading the prior context")
        auto = "; adaptive width" if ev.spec_auto else ""
        d = ev.draft
        if d is not None:
            print(f"hybrid decode: draft trunk {d['trunk']} ({d['gb']:.2f} GB budget) "
                  f"proposes up to {ev.spec} tokens per sweep; the exact model verifies them "
                  f"batched (draft routes top-{d['topk']} "
                  f"{'among cached experts only' if d['cache_only'] else 'through the cache'}"
                  f"{auto})")
        elif ev.drafter is not None:
            print(f"block drafter: proposes up to {ev.spec} tokens per pass from target "
                  f"layers {list(ev.drafter['layers'])}; the exact model verifies them "
                  f"batched{auto}")
        elif ev.spec:
            print(f"speculative decode: up to {ev.spec} drafted tokens per sweep, n-gram "
                  f"lookup, verified batched{auto}")
        print()
        print(STEP_HEADER)
        print(RULE)

    def _StepDone(self, ev):
        if not self.step_lines:
            return
        t = ev.telemetry
        print(step_line(ev.step, ev.ids[-1] if ev.ids else -1, ev.seconds, t.raw_hit_rate,
                        t.expert_bytes), flush=True)
        if self.on_step is not None:
            self.on_step(ev)
