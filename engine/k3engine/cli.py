"""`k3`: the command line, flag- and exit-code-compatible with the reference (SYSTEM §6).

`k3 <model_dir> [options]` runs the model; a first argument that names a subcommand
(`make-checkpoint`, `pack-trunk`, `sim-cache`) selects that tool instead (a model directory
with such a name is given as ./name).
"""
from __future__ import annotations

import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field, replace

from . import REFERENCE_VERSION, __version__
from .atomic import write_atomic
from .console import Printer
from .errors import (EXIT_DROP, EXIT_INTERRUPTED, EXIT_OK, EXIT_OUT, EXIT_RUNTIME, EXIT_USAGE,
                     EngineError, PlanRefused, UsageError, describe)
from .experts import POLICIES
from .memory import DEFAULT_DRAFT_TRUNK_GB, BudgetError, human, list_presets_text, resolve_budgets
from .report import RULE, out_line
from .engine import (MAX_GEN, Cancel, Draft, Engine, GenSpec, LoadSpec, Prompt, Sampling,
                     load_spec_from, open_engine)
from .generate import Turn, TurnSummary
from .sequence import Sequence
from .telemetry import Events, JsonLinesSink

SUBCOMMANDS = {
    "make-checkpoint": "k3engine.tools.make_checkpoint",
    "pack-trunk": "k3engine.tools.pack_trunk",
    "sim-cache": "k3engine.tools.sim_cache",
    "doctor": "k3engine.tools.doctor",
    "devbw": "k3engine.tools.devbw",
    "budget": "k3engine.tools.budget",
    "download": "k3engine.tools.download",
    "train-demo": "k3engine.tools.train_demo",
    "train-demo-drafter": "k3engine.tools.train_demo_drafter",
    "demo": "k3engine.tools.demo",
    "forecast": "k3engine.tools.forecast",
    "datapoint": "k3engine.tools.datapoint",
    "serve": "k3engine.server.main",
}

USAGE = """\
usage: k3 <model_dir> (--ids LIST | --ids-file PATH | --prompt TEXT | --prompt-file PATH)
          [--tok DIR] [--gen N] [--incremental] [--stop-id N]... [memory] [diagnostics]
       k3 <model_dir> --chat --tok DIR [--system TEXT] [--history PATH] [sampling]
       k3 serve | demo | forecast | datapoint | download | doctor | devbw | budget
       k3 make-checkpoint | pack-trunk | train-demo | train-demo-drafter | sim-cache ...
                                                                  (each has --help)
       k3 --help | --version | --list-presets
"""

HELP = USAGE + """
Runs Kimi K3 on one CPU from a checkpoint in the released layout; the emitted ids equal
the reference engine's at every memory budget.

prompt (exactly one outside chat)
  --ids LIST            token ids, comma or space separated
  --batch FILE          many prompts decoded together, one trunk pass per step for all
                        (JSON lines: {"ids": [...]} or {"prompt": "..."}, optionally gen,
                        seed, temperature, top_p, top_k, min_p); ids as each run alone
  --ids-file PATH       token ids read from a file
  --prompt TEXT         text, tokenized with --tok (added tokens recognised)
  --prompt-file PATH    the file's bytes verbatim (preferred for non-ASCII)
  --tok DIR             tiktoken.model + tokenizer_config.json
  --config PATH         config file (default <model_dir>/config.json)
memory
  --preset NAME         ultra, laptop, desktop, workstation, server, max, auto
  --ultra-low-memory    stream the embedding rows and lm_head too (needs --trunk)
  --trunk DIR           packed trunk (k3 pack-trunk): stream the trunk from it
  --trunk-gb X|auto     trunk budget, pinned layers + ring (default 16)
  --trunk-ring N        ring slots, 1..8 (default 2)
  --cache-gb X          routed-expert cache budget (default 64)
  --cache-policy NAME   expert replacement: lru (default, the reference's) or s3fifo
                        (more hits in large caches; same ids; also K3_CACHE_POLICY)
  --no-lookahead        no expert reads started from a guess of each layer's
                        router input (same ids either way; also K3_NOLOOKAHEAD=1)
  --threads N           compute threads (default: OMP_NUM_THREADS, else physical cores)
  --list-presets        show the presets and exit
generation
  --gen N               tokens to generate, 0..4096 (default 8; chat 4096)
  --incremental         carry KV cache and recurrent state (same ids, faster)
  --stop-id N           stop after emitting N (repeatable, up to 8)
  --save-state PATH     save the sequence state after the run (needs --incremental)
  --load-state PATH     resume from a saved state (needs --incremental)
  --layers N            bind only the first N layers (NOT the full model)
sampling (greedy by default)
  --temperature X  --top-p P  --top-k K  --seed N  --greedy
  --min-p P             also drop ids below P x the most likely one's probability
chat
  --chat  --system TEXT  --history PATH  --no-think  --thinking-effort low|high|max
  --verbose             the engine's set-up report in chat too (plan, load, trunk)
diagnostics
  --out FILE            one-line JSON result (default k3_run.json)
  --dump-logits PATH    first step's logits as raw little-endian float32
  --dump-cache-trace DIR  expert_hist.json + expert_trace.bin (DIR must exist)
  --events PATH         structured telemetry, one JSON object per line
  --stream-tokens       print @K3TOKEN <id> as each id is committed
  --spec N              n-gram speculative decoding, up to N (<= 8) drafts per sweep;
                        same ids as greedy (needs --incremental)
  --spec-auto           adapt the sweep width to what is accepted (with --spec or
                        --draft-trunk; ids unchanged)
  --tf-check            teacher-forced agreement over the --ids in one pass
hybrid decode (a draft model proposes, the exact model verifies: same ids as greedy)
  --draft-trunk DIR     draft trunk (k3 pack-trunk --draft-bits 8); needs --incremental
                        and --trunk; implies --spec 4
  --draft-trunk-gb X    draft trunk budget, pinned layers + ring (default 6)
  --draft-topk K        experts per token in the draft model (default 4)
  --draft-cache-only    the draft routes only among experts already in the cache and
                        reads no expert bytes
block drafter (DFlash-style: one small pass drafts a block, one sweep verifies it)
  --draft-model DIR     a block drafter folder (config.json + model.safetensors; the
                        demo's: k3 demo --drafter-path); needs --incremental or --chat;
                        width --spec N (default: its block size - 1, at most 8); greedy
                        turns only (a sampled turn decodes plainly, the same stream as
                        without it); not with --draft-trunk

exit codes
  0  success (also --help, --version, --list-presets, chat /exit or end of input)
  1  runtime failure: damaged or partial checkpoint or trunk (the message names the file),
     a tensor that does not bind, plan refused (over 95% of available memory), a state
     file refused, tokenizer files unreadable, a chat turn that fails or does not close
  2  usage or configuration: bad or conflicting options, untrusted config.json, --layers
     or a token id out of range, prompt or generation limits, KV cache refused (90%)
  3  the run completed but --out could not be written (results were printed)
  4  a routed expert failed to load: the affected token was not emitted
  5  interrupted by Ctrl-C: the step in flight completed, state and results were written
"""


# flag -> (attribute, takes a value, repeatable)
FLAGS = {
    "--ids": ("ids", True), "--ids-file": ("ids_file", True), "--prompt": ("prompt", True),
    "--prompt-file": ("prompt_file", True), "--tok": ("tok", True), "--config": ("config", True),
    "--preset": ("preset", True), "--trunk": ("trunk", True), "--trunk-gb": ("trunk_gb", True),
    "--trunk-ring": ("trunk_ring", True), "--cache-gb": ("cache_gb", True),
    "--cache-policy": ("cache_policy", True), "--no-lookahead": ("no_lookahead", False),
    "--threads": ("threads", True), "--gen": ("gen", True), "--incremental": ("incremental", False),
    "--stop-id": ("stop_id", True), "--save-state": ("save_state", True),
    "--load-state": ("load_state", True), "--layers": ("layers", True),
    "--temperature": ("temperature", True), "--top-p": ("top_p", True),
    "--top-k": ("top_k", True), "--min-p": ("min_p", True), "--seed": ("seed", True),
    "--greedy": ("greedy", False), "--verbose": ("verbose", False),
    "--chat": ("chat", False), "--system": ("system", True), "--history": ("history", True),
    "--no-think": ("no_think", False), "--thinking-effort": ("effort", True),
    "--out": ("out", True), "--dump-logits": ("dump_logits", True),
    "--dump-cache-trace": ("dump_cache_trace", True), "--events": ("events", True),
    "--stream-tokens": ("stream_tokens", False), "--spec": ("spec", True),
    "--tf-check": ("tf_check", False), "--ultra-low-memory": ("ultra", False),
    "--draft-trunk": ("draft_trunk", True), "--draft-trunk-gb": ("draft_trunk_gb", True),
    "--draft-topk": ("draft_topk", True), "--draft-cache-only": ("draft_cache_only", False),
    "--spec-auto": ("spec_auto", False), "--batch": ("batch", True),
    "--draft-model": ("draft_model", True),
}
DRAFT_OPTIONS = ("--draft-trunk-gb", "--draft-topk", "--draft-cache-only")
MEMORY_FLAGS = ("--preset", "--trunk-gb", "--cache-gb")
CHAT_ONLY = ("--system", "--history", "--no-think", "--thinking-effort")
# --spec and --draft-trunk work in chat too (ours: the reference refuses them there)
NOT_IN_CHAT = ("--load-state", "--save-state", "--dump-logits", "--dump-cache-trace", "--out",
               "--tf-check")
MAX_STOP_IDS = 8
NOT_IN_BATCH = ("--load-state", "--save-state", "--dump-logits", "--spec", "--spec-auto",
                "--draft-trunk", "--draft-model", "--tf-check", "--stream-tokens",
                "--ultra-low-memory")


@dataclass
class Options:
    model_dir: str = ""
    given: list[str] = field(default_factory=list)          # flags in argv order
    memory: list[tuple[str, str]] = field(default_factory=list)
    stop_ids: list[int] = field(default_factory=list)
    ids: str | None = None
    ids_file: str | None = None
    prompt: str | None = None
    prompt_file: str | None = None
    tok: str | None = None
    config: str | None = None
    preset: str | None = None
    trunk: str | None = None
    trunk_gb: str | None = None
    trunk_ring: str = "2"
    cache_gb: str | None = None
    cache_policy: str | None = None
    no_lookahead: bool = False
    threads: str | None = None
    gen: str | None = None
    incremental: bool = False
    stop_id: str | None = None
    save_state: str | None = None
    load_state: str | None = None
    layers: str | None = None
    temperature: str | None = None
    top_p: str | None = None
    top_k: str | None = None
    min_p: str | None = None
    seed: str | None = None
    verbose: bool = False
    greedy: bool = False
    chat: bool = False
    system: str | None = None
    history: str | None = None
    no_think: bool = False
    effort: str | None = None
    out: str = "k3_run.json"
    dump_logits: str | None = None
    dump_cache_trace: str | None = None
    events: str | None = None
    stream_tokens: bool = False
    spec: str = "0"
    tf_check: bool = False
    ultra: bool = False
    draft_trunk: str | None = None
    draft_trunk_gb: str | None = None
    draft_topk: str | None = None
    draft_cache_only: bool = False
    spec_auto: bool = False
    batch: str | None = None
    draft_model: str | None = None

    @property
    def gen_n(self) -> int:
        return int(self.gen) if self.gen is not None else (MAX_GEN if self.chat else 8)


def strict_int(flag: str, text: str, lo: int, hi: int | None = None) -> int:
    t = text.strip()
    digits = t[1:] if t[:1] == "-" else t
    # ASCII only and bounded: str.isdigit() accepts '²' and '١', int() refuses 4,300+ digits
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 20):
        raise UsageError(f"bad {flag} value '{text[:40]}': expected a whole number")
    v = int(t)
    if v < lo or (hi is not None and v > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise UsageError(f"{flag} {v} is out of range ({rng})")
    return v


def strict_float(flag: str, text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise UsageError(f"bad {flag} value '{text}': expected a number") from None
    if not math.isfinite(v):
        raise UsageError(f"bad {flag} value '{text}': expected a finite number")
    return v


def parse_args(argv: list[str]) -> Options:
    if not argv:
        raise UsageError("")
    if argv[0].startswith("-"):
        raise UsageError(f"the first argument must be the model directory, got '{argv[0]}'")
    o = Options(model_dir=argv[0])
    i = 1
    while i < len(argv):
        a = argv[i]
        spec = FLAGS.get(a)
        if spec is None or (spec[1] and i + 1 >= len(argv)):
            raise UsageError(f"unknown option {a}")
        attr, takes = spec
        o.given.append(a)
        if takes:
            v = argv[i + 1]
            setattr(o, attr, v)
            if a in MEMORY_FLAGS:
                o.memory.append((a, v))
            if a == "--stop-id":
                if len(o.stop_ids) == MAX_STOP_IDS:
                    raise UsageError(f"--stop-id may be given at most {MAX_STOP_IDS} times")
                o.stop_ids.append(strict_int("--stop-id", v, 0))
            i += 2
        else:
            setattr(o, attr, True)
            if a == "--ultra-low-memory":
                o.memory.append((a, True))
            i += 1
    validate(o)
    return o


def validate(o: Options) -> None:
    """Flag conflicts and limits of SYSTEM §6.2-§6.3 (all exit 2)."""
    sources = [f for f in ("--ids", "--ids-file", "--prompt", "--prompt-file") if f in o.given]
    if o.batch is not None:
        bad = sources + [f for f in NOT_IN_BATCH + ("--chat",) + CHAT_ONLY if f in o.given]
        if bad:
            raise UsageError(f"--batch cannot be combined with {bad[0]}")
        sources = ["--batch"]
    if o.chat:
        bad = sources + [f for f in NOT_IN_CHAT if f in o.given]
        if bad:
            raise UsageError(f"--chat cannot be combined with {bad[0]}")
        if not o.tok:
            raise UsageError("--chat needs --tok DIR")
    else:
        bad = [f for f in CHAT_ONLY if f in o.given]
        if bad:
            raise UsageError(f"{bad[0]} needs --chat")
        if not sources:
            raise UsageError("one of --ids, --prompt or --prompt-file is required")
        if len(set(sources)) > 1:
            raise UsageError(f"{sources[0]} and {sources[1]} are mutually exclusive")
        if o.prompt is not None or o.prompt_file is not None:
            if not o.tok:
                raise UsageError("--prompt and --prompt-file need --tok DIR")
    if o.no_think and o.effort is not None:
        raise UsageError("--no-think conflicts with --thinking-effort")
    if o.effort is not None and o.effort not in ("low", "high", "max"):
        raise UsageError(f"--thinking-effort must be low, high or max, got '{o.effort}'")
    gen = strict_int("--gen", o.gen, 0, MAX_GEN) if o.gen is not None else o.gen_n
    if o.chat and gen == 0:
        raise UsageError("--chat needs --gen > 0")
    if o.load_state and not o.incremental:
        raise UsageError("--load-state needs --incremental")
    if o.threads is not None:
        strict_int("--threads", o.threads, 1)
    strict_int("--trunk-ring", o.trunk_ring, 1, 8)
    if o.cache_policy is not None and o.cache_policy not in POLICIES:
        raise UsageError(f"--cache-policy must be {' or '.join(POLICIES)}, "
                         f"got '{o.cache_policy}'")
    if strict_int("--spec", o.spec, 0) and not (o.incremental or o.chat):
        ignored("--spec needs --incremental")
        o.spec = "0"
    validate_draft(o)
    if o.temperature is not None and not strict_float("--temperature", o.temperature) > 0:
        raise UsageError("--temperature must be > 0")
    if o.top_p is not None and not 0 < strict_float("--top-p", o.top_p) <= 1:
        raise UsageError("--top-p must be in (0, 1]")
    if o.top_k is not None:
        strict_int("--top-k", o.top_k, 1)
    if o.min_p is not None and not 0 <= strict_float("--min-p", o.min_p) < 1:
        raise UsageError("--min-p must be in [0, 1)")
    if o.seed is not None:
        strict_int("--seed", o.seed, 0, 2**64 - 1)
    if o.dump_cache_trace and not os.path.isdir(o.dump_cache_trace):
        raise UsageError(f"--dump-cache-trace {o.dump_cache_trace}: directory does not exist")
    try:
        budgets = resolve_budgets(o.memory)
    except BudgetError as e:
        raise UsageError(str(e)) from None
    for implies in ("draft_trunk", "draft_model"):      # (they imply --spec: say which)
        if budgets.ultra and getattr(o, implies):
            raise UsageError(f"--ultra-low-memory cannot be combined with "
                             f"--{implies.replace('_', '-')}")
    if budgets.ultra and int(o.spec):
        raise UsageError("--ultra-low-memory cannot be combined with --spec")


def ignored(why: str) -> None:
    print(f"k3: {why}; ignored", file=sys.stderr)


def validate_draft(o: Options) -> None:
    """Hybrid decode's options: values are checked even when the option ends up ignored
    (a typo is an error, not a silent no-op); --draft-trunk without --incremental and
    --trunk is ignored with a warning, as the reference does, and implies --spec 4."""
    if o.draft_trunk_gb is not None and strict_float("--draft-trunk-gb", o.draft_trunk_gb) < 0:
        raise UsageError("--draft-trunk-gb must be >= 0")
    if o.draft_topk is not None:
        strict_int("--draft-topk", o.draft_topk, 1)
    if o.draft_model and o.draft_trunk:
        raise UsageError("--draft-model and --draft-trunk are mutually exclusive (one "
                         "proposer per run)")
    if o.draft_model and not (o.incremental or o.chat):
        ignored("--draft-model needs --incremental")
        o.draft_model = None
    if o.draft_model and not int(o.spec):                # the drafter's own block
        from .drafter import default_width
        o.spec = str(default_width(o.draft_model))
    if o.draft_trunk and not ((o.incremental or o.chat) and o.trunk):
        ignored("--draft-trunk needs --incremental and --trunk")
        o.draft_trunk = None
    if not o.draft_trunk:
        for f in DRAFT_OPTIONS:
            if f in o.given:
                ignored(f"{f} needs --draft-trunk")
    elif not int(o.spec):
        o.spec = "4"
    if o.spec_auto and not int(o.spec):
        ignored("--spec-auto needs --spec, --draft-trunk or --draft-model")
        o.spec_auto = False


def build_load(o: Options) -> LoadSpec:
    """The LoadSpec for these flags (engine.load_spec_from applies presets and defaults)."""
    draft = None
    if o.draft_trunk:
        draft = Draft(o.draft_trunk, draft_gb(o),
                      None if o.draft_topk is None else int(o.draft_topk), o.draft_cache_only)
    return load_spec_from(
        o.model_dir, o.memory, trunk_dir=o.trunk, tok_dir=o.tok, config_path=o.config,
        trunk_ring=int(o.trunk_ring), threads=int(o.threads) if o.threads is not None else 0,
        layers=None if o.layers is None else strict_int("--layers", o.layers, 1),
        incremental=o.incremental or o.chat, spec=int(o.spec), draft=draft,
        drafter_dir=o.draft_model, keep_trace=bool(o.dump_cache_trace),
        cache_policy=o.cache_policy, lookahead=not o.no_lookahead)


def build_gen(o: Options) -> GenSpec:
    """The GenSpec of every turn these flags run."""
    sampling = Sampling(temperature=None if o.temperature is None else float(o.temperature),
                        top_p=None if o.top_p is None else float(o.top_p),
                        top_k=None if o.top_k is None else int(o.top_k),
                        min_p=None if o.min_p is None else float(o.min_p),
                        seed=None if o.seed is None else int(o.seed), greedy=o.greedy)
    return GenSpec(gen=o.gen_n, sampling=sampling, stop_ids=tuple(o.stop_ids),
                   thinking=not o.no_think, effort=o.effort or "max", spec=int(o.spec),
                   spec_auto=o.spec_auto)


def build_prompt(o: Options) -> Prompt:
    return Prompt(ids_text=o.ids, ids_file=o.ids_file, text=o.prompt, text_file=o.prompt_file)


def draft_gb(o: Options) -> float:
    return DEFAULT_DRAFT_TRUNK_GB if o.draft_trunk_gb is None else float(o.draft_trunk_gb)


class Interrupts:
    """Ctrl-C (SYSTEM §6.6): the first SIGINT asks the loop to stop after the step in
    flight and says so at once; the second ends the process (default action).  Installed
    before loading starts, whatever disposition the process inherited (a shell that
    started it with SIGINT ignored included)."""

    MESSAGE = (b"\ninterrupt: the step in flight will complete, then state and results are "
               b"written and the run exits 5.\n           Press Ctrl-C again to kill it now.\n")

    def __init__(self, cancel: Cancel):
        self.cancel = cancel
        self.old = None

    def _handler(self, signum, frame) -> None:
        self.cancel.set()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.write(2, self.MESSAGE)

    def __enter__(self):
        if hasattr(signal, "SIGINT"):
            self.old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        # After a first Ctrl-C the default action stays: a second one while the state,
        # --out and the reports are written must still end the process at once (not
        # raise KeyboardInterrupt into a half-written report).
        if self.old is not None and not self.cancel:
            signal.signal(signal.SIGINT, self.old)


def run(o: Options, events: Events) -> int:
    """A batch run: the engine's events printed as the reference's report."""
    unwritten: list[str] = []           # outputs that could not be written: exit 3

    def on_step(ev) -> None:
        if ev.logits is not None and o.dump_logits:
            if write_output(o.dump_logits, ev.logits.astype("<f4").tobytes(), unwritten):
                print(f"wrote {o.dump_logits} ({ev.logits.shape[0]} float32 logits)")
        if o.stream_tokens:
            for i in ev.ids:
                print(f"@K3TOKEN {i}", flush=True)
    printer = Printer(events, on_step)
    cancel = Cancel()
    spec = build_gen(o)
    with Interrupts(cancel):
        eng = open_engine(build_load(o), printer, prompt=build_prompt(o), gen=spec.gen,
                          stop_ids=spec.stop_ids, load_state=o.load_state)
        try:
            if o.tf_check:
                return tf_check(o, eng)
            ids = eng.prompt_ids
            resumed = None
            if o.load_state:
                seq, resumed = eng.resume(o.load_state, len(ids) + spec.gen + 1, len(ids))
            else:
                seq = eng.sequence()
            printer(eng.decode_started(spec, len(seq.ids) + len(ids) + spec.gen + 1, resumed))
            turn = Turn(eng.batch(ids, spec, cancel, seq))
            for ev in turn:
                printer(ev)
            return finish(o, eng, spec, seq, turn.summary, events, unwritten)
        finally:
            eng.close()


def tf_check(o: Options, eng: Engine) -> int:
    """--tf-check (SYSTEM §6.11): one teacher-forced pass, per-position agreement."""
    ids = eng.prompt_ids
    if len(ids) < 2:
        raise UsageError("--tf-check needs at least 2 ids")
    t0 = time.monotonic()
    pred = eng.teacher_forced(ids)
    n, m = len(pred), sum(a == b for a, b in zip(pred, ids[1:]))
    print(f"teacher-forced agreement: {m}/{n} positions ({100 * m / n:.1f}%) in "
          f"{time.monotonic() - t0:.1f} s")
    bad = [f"[{i} p={a} a={b}]" for i, (a, b) in enumerate(zip(pred, ids[1:])) if a != b]
    if bad:
        print("mismatches: " + " ".join(bad))
    try:
        write_atomic(o.out, (f'{{"tf_positions":{n},"tf_matches":{m},'
                             f'"tf_agreement":{m / n:.4f}}}\n').encode())
    except OSError:
        pass                                   # silently skipped, as the reference does
    return EXIT_OK


def write_output(path: str, data: bytes, unwritten: list[str]) -> bool:
    """Write one of the run's output files whole; a failure is reported and remembered
    (the run still completes and exits 3, SYSTEM §6.5)."""
    try:
        write_atomic(path, data)
        return True
    except OSError as e:
        print(f"cannot write {path}: {e.strerror or e}", file=sys.stderr)
        unwritten.append(path)
        return False


def finish(o: Options, eng: Engine, spec: GenSpec, seq: Sequence, res: TurnSummary,
           events: Events, unwritten: list[str]) -> int:
    lm = eng.lm
    gen = o.gen_n
    n = len(res.ids)
    if res.end_id is not None:
        print(f"stop id {res.end_id} reached after {n} of {gen} tokens")
    if res.interrupted:
        print(f"interrupted: {n} of {gen} tokens generated; state, results and reports follow "
              f"as for a finished run")
    if o.save_state:
        if not o.incremental:
            print("k3: --save-state needs --incremental; nothing written", file=sys.stderr)
        else:
            t0 = time.monotonic()
            try:
                size = seq.save(o.save_state)
                print(f"wrote {o.save_state} ({human(size)}, {seq.position} positions) in "
                      f"{time.monotonic() - t0:.2f} s")
            except EngineError as e:      # StateFileError, StateUnusable (SYSTEM §4.9)
                # reported, but the run's own exit code stands (SYSTEM §6.5, §6.9);
                # test_cli_system.py::test_failed_save_state_keeps_the_exit_code
                print(e.report(), file=sys.stderr)
    sp = res.spec
    if eng.draft is not None:
        print(f"hybrid decode: {sp.rounds} rounds, {sp.drafted} drafted, {sp.accepted} accepted "
              f"({sp.accepted_pct:.1f}%), mean accepted run "
              f"{sp.mean_run:.2f}")
        print(f"  draft model: {eng.draft.seconds:.1f} s of {res.seconds:.1f} s wall in "
              f"{eng.draft.steps} forward calls; draft trunk read "
              f"{eng.draft.trunk.bytes_read / 1e9:.2f} GB")
    if eng.drafter is not None:
        dr = eng.drafter
        print(f"block drafter: {sp.rounds} passes, {sp.drafted} drafted, {sp.accepted} "
              f"accepted ({sp.accepted_pct:.1f}%), mean accepted per pass {sp.mean_run:.2f} "
              f"({sp.mean_run + 1:.2f} tokens per verification pass)" if sp.rounds else
              "block drafter: no pass drafted")
        print(f"  drafter: {dr.seconds:.2f} s of {res.seconds:.1f} s wall in {dr.passes} "
              f"proposals")
    print(RULE)
    if n:
        print(f"{n} tokens in {res.seconds:.1f} s, {res.seconds / n:.2f} s/token average")
    else:
        print(f"prefill only: {seq.position} positions cached, "
              f"0 tokens generated")
    print(f"generated ids: {','.join(str(i) for i in res.ids)}")
    if sp.rounds and eng.draft is None and eng.drafter is None:
        print(f"speculative decode: {sp.rounds} sweeps, {sp.drafted} drafted, {sp.accepted} "
              f"accepted ({sp.accepted_pct:.1f}%)")
    text = None
    if eng.tok is not None and n:
        text = eng.tok.decode(res.ids)
        print()
        print("--- generated text ---")
        sys.stdout.flush()
        sys.stdout.buffer.write(text + b"\n")
        sys.stdout.flush()
        print("-" * 22)
    print()
    values = eng.out_values(res, seq, eng.prompt_ids, text)
    print(f"PEAK RSS for the whole run: {human(values['peak_rss_bytes'])}   <- quote this, "
          f"not the plan")
    print(f"layers completed: {res.layers_completed}/{eng.nl}; routed expert drops: "
          f"{values['expert_drops']}")
    print()
    for line in lm.experts.report_lines():
        print(line)
    tr = lm.trunk
    code = EXIT_OK
    extra = {**eng.spec_keys(spec, res), **eng.lookahead_keys()}
    if write_output(o.out, out_line(values, extra), unwritten):
        print(f"wrote {o.out}")
    if o.dump_cache_trace:
        try:
            for line in lm.experts.dump_trace(o.dump_cache_trace):   # "wrote PATH: ..."
                print(line)
        except OSError as e:
            print(f"cannot write the cache trace in {o.dump_cache_trace}: "
                  f"{e.strerror or e}", file=sys.stderr)
            unwritten.append(o.dump_cache_trace)
    if unwritten:
        code = EXIT_OUT
    trunk_s, expert_s, table_s = eng.io_seconds()
    io_s = trunk_s + expert_s + table_s
    if res.seconds > 0:
        print(f"I/O share of wall clock: {100 * io_s / res.seconds:.1f}%  (trunk "
              f"{trunk_s:.1f} s + experts {expert_s:.1f} s + model tables {table_s:.1f} s of "
              f"{res.seconds:.1f} s)")
        print(f"  both figures are WHOLE-RUN totals over {res.steps} steps")
    if tr is not None:
        print()
        print("trunk [final]")
        print(f"  pinned {len(tr.pinned)}/{eng.nl} layers, ring {tr.nslot} slots")
        print(f"  binds {tr.binds}, hits {tr.hits} ({100 * tr.hits / max(tr.binds, 1):.1f}%), "
              f"reads {tr.misses}")
        rate = tr.bytes_read / tr.read_seconds / 1e6 if tr.read_seconds > 0 else 0.0
        print(f"  read {tr.bytes_read / 1e9:.2f} GB in {tr.read_seconds:.2f} s ({rate:.0f} MB/s)")
    summary = dict(values, **extra, generated_text=None if text is None else
                   text.decode("utf-8", errors="replace"), io_share=io_s / res.seconds
                   if res.seconds > 0 else 0.0)
    events.emit("summary", **summary)
    if res.expert_drop is not None:              # 4 > 3 > 5 > 0
        print(f"RUN INVALID: {res.expert_drop}; the affected token was not emitted",
              file=sys.stderr)
        return EXIT_DROP
    if code == EXIT_OK and res.interrupted:
        code = EXIT_INTERRUPTED
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SUBCOMMANDS:
        import importlib
        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    if any(a in ("--help", "-h") for a in argv):
        print(HELP, end="")
        return EXIT_OK
    if "--version" in argv:
        print(f"k3 {__version__} (Kimi K3 engine, reference-compatible with kimi-k3-in-c "
              f"{REFERENCE_VERSION})")
        return EXIT_OK
    if "--list-presets" in argv:
        print(list_presets_text())
        return EXIT_OK
    events = Events()
    sink = None
    try:
        o = parse_args(argv)
        if o.events:
            try:
                sink = JsonLinesSink(o.events)
            except OSError as e:             # refused before any work is done
                raise UsageError(f"cannot write --events {o.events}: {e.strerror or e}") \
                    from None
            events.sinks.append(sink)
        if o.batch is not None:
            from .batch_file import run_batch
            code = run_batch(o, replace(build_load(o), incremental=True), build_gen(o),
                             Printer(events), events, write_output, Interrupts)
        elif o.chat:
            from .chat_repl import chat_main
            code = chat_main(build_load(o), build_gen(o), o.history, o.system, events,
                             verbose=o.verbose)
        else:
            code = run(o, events)
        if sink is not None:
            sink.close()
            if sink.error is not None and code in (EXIT_OK, EXIT_INTERRUPTED, EXIT_RUNTIME):
                print(f"cannot write --events {o.events}: {sink.error.strerror or sink.error}",
                      file=sys.stderr)
                code = EXIT_OUT              # 4 > 3 > 1 > 5 > 0
        return code
    except UsageError as e:
        msg = str(e)
        if msg:
            print(f"k3: {msg}", file=sys.stderr)
        if not msg or msg.startswith("unknown option"):
            print(USAGE, end="", file=sys.stderr)
        events.emit("error", code=EXIT_USAGE, kind="UsageError", message=msg)
        return EXIT_USAGE
    except PlanRefused as e:                   # its refusals were printed with the plan
        events.emit("error", code=e.exit_code, kind="PlanRefused",
                    message="memory plan refused")
        return e.exit_code
    except Exception as e:
        known = describe(e)
        if known is None:
            raise
        code, kind, message = known
        print(message, file=sys.stderr)
        events.emit("error", code=code, kind=kind, message=str(e))
        return code
    finally:
        if sink is not None:
            sink.close()


if __name__ == "__main__":
    sys.exit(main())
