"""What one run asks of the engine, in one place: the memory plan it will be admitted
under and the `k3` command line that does the same thing.

The memory panel calls `make_plan` on every slider move and the worker calls it again
just before loading, with the same inputs, so the plan a person sees is the plan the run
gets.  `command_line` is shown for every run so a result in the app can be reproduced
(and compared) with the CLI.
"""
from __future__ import annotations

import os
import shlex
from dataclasses import dataclass

from k3engine.memory import AUTO, PRESETS, Plan, plan_for, trace_window
from k3engine.engine import GenSpec, LoadSpec, Sampling, load_spec_from, memory_flags

CUSTOM = "custom"
# The app renders this label on the plan's baseline line (SYSTEM §5.8).
BASELINE_LABEL = "app baseline"


@dataclass(frozen=True)
class RunSpec:
    model_dir: str
    trunk_dir: str = ""
    tok_dir: str = ""
    preset: str = "laptop"            # a PRESETS name, "auto" or "custom"
    trunk_gb: float = 3.0
    cache_gb: float = 1.0
    trunk_ring: int = 2
    cache_policy: str = "lru"         # expert replacement (--cache-policy)
    lookahead: bool = True            # expert reads from a guess of the router (--no-lookahead)
    threads: int = 0                  # 0 = engine default
    draft_model: str = ""             # a block drafter folder (--draft-model); "" = none
    gen: int = 256
    thinking: bool = True
    effort: str = "low"
    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 0
    seed: int = 0
    system_prompt: str = ""
    history_path: str = ""

    @property
    def tokenizer_dir(self) -> str:
        return self.tok_dir or self.model_dir

    @property
    def streamed(self) -> bool:
        return bool(self.trunk_dir)

    @property
    def spec_width(self) -> int:
        """The speculative width with a block drafter (its block less the anchor), else 0.
        A folder that cannot be read raises its ConfigError here, as the load would."""
        if not self.draft_model:
            return 0
        from k3engine.drafter import default_width
        return default_width(self.draft_model)

    def drafter_size(self):
        """The plan's figures of the block drafter (drafter.size_of), or None."""
        if not self.draft_model:
            return None
        from k3engine.drafter import size_of
        return size_of(self.draft_model)

    @property
    def positions(self) -> int:
        """What the CLI's chat plans for: no batch prompt, so gen + 1 (cli.prepare)."""
        return self.gen + 1

    def load_spec(self, available_override: int | None = None, baseline_bytes: int = 0,
                  total_memory: int = 0) -> LoadSpec:
        """What the engine loads for these settings, through the same function that turns
        `k3`'s flags into one (presets and defaults applied once)."""
        return load_spec_from(
            self.model_dir, memory_flags(self.preset, self.trunk_gb, self.cache_gb),
            trunk_dir=self.trunk_dir or None, tok_dir=self.tokenizer_dir,
            trunk_ring=int(self.trunk_ring), threads=int(self.threads), incremental=True,
            baseline_bytes=int(baseline_bytes), baseline_label=BASELINE_LABEL,
            available_override=available_override, total_memory=int(total_memory),
            # the What-if tab replays this session's expert requests: the latest window of
            # them (a long session's trace would grow without bound), counted in the plan
            keep_trace=True, trace_window=trace_window(), cache_policy=self.cache_policy,
            lookahead=self.lookahead, turn_peaks=True, drafter_dir=self.draft_model or None,
            spec=self.spec_width)

    def gen_spec(self) -> GenSpec:
        """What every turn asks with these settings."""
        sampling = Sampling(greedy=True) if self.greedy else Sampling(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k or None,
            seed=self.seed or None)
        return GenSpec(gen=int(self.gen), sampling=sampling, thinking=self.thinking,
                       effort=self.effort, spec=self.spec_width)


def make_plan(figures, spec: RunSpec, available, baseline_bytes: int = 0,
              total_memory: int = 0) -> Plan:
    """The whole-run plan for a chat run (incremental, like `k3 --chat`): the plan
    open_engine admits the load under."""
    ls = spec.load_spec(baseline_bytes=baseline_bytes, total_memory=total_memory)
    return plan_for(figures, ls.plan_request(spec.positions, drafter=spec.drafter_size()),
                    available, total_memory)


def _fmt_gb(x: float) -> str:
    return f"{x:.3f}".rstrip("0").rstrip(".") if x != int(x) else str(int(x))


def model_flags(spec: RunSpec) -> list[str]:
    """The tokenizer, trunk and memory flags of this run: the same for `k3 --chat` and for
    `k3 serve` (the app's local server)."""
    argv = ["--tok", spec.tokenizer_dir]
    if spec.trunk_dir:
        argv += ["--trunk", spec.trunk_dir]
    if spec.preset in PRESETS or spec.preset == AUTO:
        argv += ["--preset", spec.preset]
    else:
        argv += ["--trunk-gb", _fmt_gb(spec.trunk_gb), "--cache-gb", _fmt_gb(spec.cache_gb)]
    if spec.trunk_ring != 2:
        argv += ["--trunk-ring", str(spec.trunk_ring)]
    if spec.cache_policy != "lru":
        argv += ["--cache-policy", spec.cache_policy]
    if not spec.lookahead:
        argv.append("--no-lookahead")
    if spec.threads:
        argv += ["--threads", str(spec.threads)]
    if spec.draft_model:
        argv += ["--draft-model", spec.draft_model]
    return argv


def command_line(spec: RunSpec) -> str:
    """The `k3` invocation equivalent to this run (chat mode)."""
    argv = ["k3", spec.model_dir, "--chat", *model_flags(spec)]
    argv += ["--gen", str(spec.gen)]
    if not spec.thinking:
        argv.append("--no-think")
    elif spec.effort != "max":
        argv += ["--thinking-effort", spec.effort]
    if not spec.greedy:
        argv += ["--temperature", f"{spec.temperature:g}", "--top-p", f"{spec.top_p:g}"]
        if spec.top_k:
            argv += ["--top-k", str(spec.top_k)]
        if spec.seed:
            argv += ["--seed", str(spec.seed)]
    if spec.system_prompt:
        argv += ["--system", spec.system_prompt]
    if spec.history_path:
        argv += ["--history", spec.history_path]
    return shlex.join(argv)


def from_settings(s, history_path: str = "") -> RunSpec:
    return RunSpec(model_dir=os.path.expanduser(s.model_dir),
                   trunk_dir=os.path.expanduser(s.trunk_dir),
                   tok_dir=os.path.expanduser(s.tok_dir), preset=s.preset,
                   trunk_gb=s.trunk_gb, cache_gb=s.cache_gb, trunk_ring=s.trunk_ring,
                   cache_policy=s.cache_policy, lookahead=s.lookahead, threads=s.threads,
                   draft_model=os.path.expanduser(s.draft_model), gen=s.gen,
                   thinking=s.thinking, effort=s.effort,
                   greedy=s.greedy, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                   seed=s.seed, system_prompt=s.system_prompt,
                   history_path=history_path or s.conversation_path)
