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
from dataclasses import dataclass, field

from . import REFERENCE_VERSION, __version__
from .config import ModelConfig
from .errors import EXIT_DROP, EXIT_INTERRUPTED, EXIT_OK, EXIT_OUT, EXIT_USAGE, describe
from .draft import DEFAULT_DRAFT_TOPK
from .speculative import MAX_DRAFT
from .memory import (DEFAULT_DRAFT_TRUNK_GB, BudgetError, available_memory, human,
                     list_presets_text, plan, resolve_budgets)
from .atomic import write_atomic
from .report import RULE, STEP_HEADER, out_line, step_line
from .session import (MAX_GEN, MAX_POSITIONS, MAX_PROMPT, Cancel, RunResult, Step,
                      default_threads, generate, load_draft, load_model, open_model,
                      read_config, set_threads)
from .telemetry import Events, JsonLinesSink, peak_rss_bytes, rss_bytes

SUBCOMMANDS = {
    "make-checkpoint": "k3engine.tools.make_checkpoint",
    "pack-trunk": "k3engine.tools.pack_trunk",
    "sim-cache": "k3engine.tools.sim_cache",
    "doctor": "k3engine.tools.doctor",
    "devbw": "k3engine.tools.devbw",
    "budget": "k3engine.tools.budget",
    "download": "k3engine.tools.download",
}

USAGE = """\
usage: k3 <model_dir> (--ids LIST | --ids-file PATH | --prompt TEXT | --prompt-file PATH)
          [--tok DIR] [--gen N] [--incremental] [--stop-id N]... [memory] [diagnostics]
       k3 <model_dir> --chat --tok DIR [--system TEXT] [--history PATH] [sampling]
       k3 make-checkpoint | pack-trunk | download | doctor | devbw | budget | sim-cache ...
                                         (each has --help)
       k3 --help | --version | --list-presets
"""

HELP = USAGE + """
Runs Kimi K3 on one CPU from a checkpoint in the released layout; the emitted ids equal
the reference engine's at every memory budget.

prompt (exactly one outside chat)
  --ids LIST            token ids, comma or space separated
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
chat
  --chat  --system TEXT  --history PATH  --no-think  --thinking-effort low|high|max
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


class UsageError(Exception):
    pass


# flag -> (attribute, takes a value, repeatable)
FLAGS = {
    "--ids": ("ids", True), "--ids-file": ("ids_file", True), "--prompt": ("prompt", True),
    "--prompt-file": ("prompt_file", True), "--tok": ("tok", True), "--config": ("config", True),
    "--preset": ("preset", True), "--trunk": ("trunk", True), "--trunk-gb": ("trunk_gb", True),
    "--trunk-ring": ("trunk_ring", True), "--cache-gb": ("cache_gb", True),
    "--threads": ("threads", True), "--gen": ("gen", True), "--incremental": ("incremental", False),
    "--stop-id": ("stop_id", True), "--save-state": ("save_state", True),
    "--load-state": ("load_state", True), "--layers": ("layers", True),
    "--temperature": ("temperature", True), "--top-p": ("top_p", True),
    "--top-k": ("top_k", True), "--seed": ("seed", True), "--greedy": ("greedy", False),
    "--chat": ("chat", False), "--system": ("system", True), "--history": ("history", True),
    "--no-think": ("no_think", False), "--thinking-effort": ("effort", True),
    "--out": ("out", True), "--dump-logits": ("dump_logits", True),
    "--dump-cache-trace": ("dump_cache_trace", True), "--events": ("events", True),
    "--stream-tokens": ("stream_tokens", False), "--spec": ("spec", True),
    "--tf-check": ("tf_check", False), "--ultra-low-memory": ("ultra", False),
    "--draft-trunk": ("draft_trunk", True), "--draft-trunk-gb": ("draft_trunk_gb", True),
    "--draft-topk": ("draft_topk", True), "--draft-cache-only": ("draft_cache_only", False),
    "--spec-auto": ("spec_auto", False),
}
DRAFT_OPTIONS = ("--draft-trunk-gb", "--draft-topk", "--draft-cache-only")
MEMORY_FLAGS = ("--preset", "--trunk-gb", "--cache-gb")
CHAT_ONLY = ("--system", "--history", "--no-think", "--thinking-effort")
NOT_IN_CHAT = ("--load-state", "--save-state", "--dump-logits", "--dump-cache-trace", "--out",
               "--spec", "--tf-check", "--draft-trunk")
MAX_STOP_IDS = 8


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
    seed: str | None = None
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

    @property
    def gen_n(self) -> int:
        return int(self.gen) if self.gen is not None else (MAX_GEN if self.chat else 8)


def strict_int(flag: str, text: str, lo: int, hi: int | None = None) -> int:
    t = text.strip()
    if not (t.isdigit() or (t[:1] == "-" and t[1:].isdigit())):
        raise UsageError(f"bad {flag} value '{text}': expected a whole number")
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


def parse_ids(text: str, what: str) -> list[int]:
    pieces = text.replace(",", " ").split()
    if not pieces:
        raise UsageError(f"bad {what}: no ids")
    for p in pieces:
        if not p.isdigit():
            raise UsageError(f"bad {what}: '{p}' is not a non-negative whole number")
    return [int(p) for p in pieces]


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
    if strict_int("--spec", o.spec, 0) and not o.incremental:
        ignored("--spec needs --incremental")
        o.spec = "0"
    validate_draft(o)
    if o.temperature is not None and not strict_float("--temperature", o.temperature) > 0:
        raise UsageError("--temperature must be > 0")
    if o.top_p is not None and not 0 < strict_float("--top-p", o.top_p) <= 1:
        raise UsageError("--top-p must be in (0, 1]")
    if o.top_k is not None:
        strict_int("--top-k", o.top_k, 1)
    if o.seed is not None:
        strict_int("--seed", o.seed, 0, 2**64 - 1)
    if o.dump_cache_trace and not os.path.isdir(o.dump_cache_trace):
        raise UsageError(f"--dump-cache-trace {o.dump_cache_trace}: directory does not exist")
    try:
        budgets = resolve_budgets(o.memory)
    except BudgetError as e:
        raise UsageError(str(e)) from None
    if budgets.ultra and o.draft_trunk:                 # (it implies --spec: say which)
        raise UsageError("--ultra-low-memory cannot be combined with --draft-trunk")
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
    if o.draft_trunk and not (o.incremental and o.trunk):
        ignored("--draft-trunk needs --incremental and --trunk")
        o.draft_trunk = None
    if not o.draft_trunk:
        for f in DRAFT_OPTIONS:
            if f in o.given:
                ignored(f"{f} needs --draft-trunk")
    elif not int(o.spec):
        o.spec = "4"
    if o.spec_auto and not int(o.spec):
        ignored("--spec-auto needs --spec or --draft-trunk")
        o.spec_auto = False


def make_sampler(o: Options):
    from .sampler import Sampler
    return Sampler.from_flags(
        temperature=None if o.temperature is None else float(o.temperature),
        top_p=None if o.top_p is None else float(o.top_p),
        top_k=None if o.top_k is None else int(o.top_k),
        seed=None if o.seed is None else int(o.seed), greedy=o.greedy)


def config_line(cfg: ModelConfig, path: str) -> str:
    n_mla = len(cfg.mla_layers)
    return (f"config: {os.path.basename(path)} ({cfg.shape} shape) | hidden={cfg.hidden} "
            f"layers={cfg.n_layers} vocab={cfg.vocab} | {n_mla} MLA + {cfg.n_layers - n_mla} KDA"
            f" | experts {cfg.n_experts} top{cfg.topk} shared{cfg.n_shared} | latent={cfg.latent}")


def load_tokenizer(tok_dir: str):
    """Tokenizer load failures exit 1 (SYSTEM §6.5)."""
    from .tokenizer import Tokenizer
    tok = Tokenizer.from_dir(tok_dir)
    print(tok.report_line(), file=sys.stderr)
    return tok


def prompt_ids(o: Options, tok) -> list[int]:
    if o.ids is not None:
        return parse_ids(o.ids, "--ids")
    if o.ids_file is not None:
        try:
            with open(o.ids_file) as f:
                return parse_ids(f.read(), f"--ids-file {o.ids_file}")
        except OSError as e:
            raise UsageError(f"cannot read --ids-file {o.ids_file}: {e.strerror}") from None
    if o.prompt_file is not None:
        try:
            with open(o.prompt_file, "rb") as f:
                text = f.read(1 << 30 | 1)
        except OSError as e:
            raise UsageError(f"cannot read --prompt-file {o.prompt_file}: {e.strerror}") from None
        if len(text) > 1 << 30:
            raise UsageError(f"--prompt-file {o.prompt_file} is larger than 1 GiB")
        text = text.decode("utf-8", errors="surrogateescape")
        nbytes = len(text.encode("utf-8", errors="surrogateescape"))
    else:
        text = o.prompt
        nbytes = len(text.encode("utf-8", errors="surrogateescape"))
    ids = tok.encode(text, True)                   # added tokens recognised in batch prompts
    print(f"  tokenized: {nbytes} bytes -> {len(ids)} ids")
    return ids


class Interrupts:
    """Ctrl-C (SYSTEM §6.6): the first SIGINT asks the loop to stop after the step in
    flight and says so at once; the second ends the process (default action)."""

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


@dataclass
class Prepared:
    """What a run needs after the checks that come before any large allocation."""
    cfg: ModelConfig
    nl: int
    tok: object
    ids: list[int]
    lm: object
    draft: object = None            # hybrid decode's DraftModel


def prepare(o: Options, events: Events, positions_extra: int = 0) -> Prepared:
    """Threads, config, tokenizer, prompt, index, plan (refusals), then the model."""
    threads = int(o.threads) if o.threads is not None else default_threads()
    set_threads(threads)
    print(f"threads: {threads}")
    cfg, cfg_path = read_config(o.model_dir, o.config)
    print(config_line(cfg, cfg_path))
    nl = cfg.n_layers if o.layers is None else strict_int("--layers", o.layers, 1, cfg.n_layers)
    if nl < cfg.n_layers:
        print(f"NOTE: binding only the first {nl} of {cfg.n_layers} layers. Output is NOT the "
              f"full model; use it to test the machinery, not the answers.")
    tok = load_tokenizer(o.tok) if o.tok else None
    ids = [] if o.chat else prompt_ids(o, tok)
    if len(ids) > MAX_PROMPT:
        raise UsageError(f"prompt has {len(ids)} ids; the limit is {MAX_PROMPT} (refused, "
                         f"never truncated)")
    for i in ids + o.stop_ids:
        if i >= cfg.vocab:
            raise UsageError(f"token id {i} is outside the vocabulary of {cfg.vocab}")
    draft_topk = min(DEFAULT_DRAFT_TOPK, cfg.topk) if o.draft_topk is None else int(o.draft_topk)
    if o.draft_trunk and draft_topk > cfg.topk:
        raise UsageError(f"--draft-topk {draft_topk} exceeds the model's top-{cfg.topk}")
    gen = o.gen_n
    positions = positions_extra + len(ids) + gen + 1
    if positions > MAX_POSITIONS:
        raise UsageError(f"prompt {positions_extra + len(ids)} + gen {gen} + 1 exceeds the "
                         f"{MAX_POSITIONS}-position ceiling")
    print("K3 Studio engine (Python + Cython), released checkpoint layout")
    print(f"  model    : {o.model_dir}")
    if not o.chat:
        print(f"  prompt   : {len(ids)} tokens, generating {gen}")
    budgets = resolve_budgets(o.memory)
    print()

    setup = open_model(o.model_dir, cfg, nl, o.trunk, o.draft_trunk)
    print(f"indexed {len(setup.ck)} tensors from {len(setup.ck.shards)} shards in "
          f"{setup.index_seconds:.2f} s")
    for note in setup.ck.notes:
        print(f"note: {note}")
    avail, probe = available_memory()
    from .memory import AUTO
    the_plan = plan(setup.figures, preset=AUTO if budgets.auto else budgets.preset,
                    trunk_gb=AUTO if budgets.auto else budgets.trunk_gb,
                    cache_gb=budgets.cache_gb, trunk_ring=int(o.trunk_ring), ultra=budgets.ultra,
                    streamed=bool(o.trunk), incremental=o.incremental or o.chat,
                    positions=positions, available_bytes=probe, layers=nl,
                    draft_sizes=setup.draft_sizes, draft_gb=draft_gb(o),
                    spec=min(int(o.spec), MAX_DRAFT))
    if the_plan.preset_line():
        print(the_plan.preset_line())
    if the_plan.auto is not None:
        print(the_plan.auto.line)
    if o.trunk:
        print(f"trunk on disk : {human(setup.manifest.total_bytes())} total (STREAMED from "
              f"{o.trunk}, not held in RAM)")
    print()
    for line in the_plan.lines():
        print(line)
    events.emit("plan", **the_plan.as_event())
    if the_plan.refusals:
        for r in the_plan.refusals:
            print(f"k3: {r.message}", file=sys.stderr)
        raise PlanRefused(the_plan.exit_code)
    if the_plan.trunk_plan is not None:
        for line in the_plan.trunk_plan.lines():
            print(line)

    tp_plan = the_plan.trunk_plan
    pinned = set(tp_plan.pinned) if tp_plan is not None else set()
    pinned_total = sum(setup.manifest.layers[L].nbytes for L in pinned) if pinned else 0
    first_touch = {"done": 0, "seen": set()}

    def on_read(L, nbytes, seconds):
        """Token 0 reads every pinned layer once (SYSTEM §3.7): report it as progress so
        a slow first token never looks like a hang."""
        if L in pinned and L not in first_touch["seen"]:
            first_touch["seen"].add(L)
            first_touch["done"] += nbytes
            events.emit("load", phase="pinned_first_touch", layer=L,
                        done_bytes=first_touch["done"], total_bytes=pinned_total)
    t0 = time.monotonic()
    lm = load_model(setup, plan=the_plan, on_trunk_read=on_read,
                    cache_bytes=int(the_plan.expert_cache_bytes), ultra=the_plan.ultra)
    if lm.trunk is not None:
        tp = lm.trunk
        events.emit("trunk_open", n_pinned=len(tp.pinned), pinned_layers=sorted(tp.pinned),
                    ring_slots=tp.nslot, slot_bytes=tp.slot_bytes, direct=tp.direct,
                    split_first=False)
        print(f"trunk streaming enabled from {o.trunk} in {time.monotonic() - t0:.1f} s; "
              f"reads use {'O_DIRECT (page cache bypassed)' if tp.direct else 'buffered I/O'}")
    else:
        print(f"resident trunk: {human(lm.trunk_bytes)} in RAM (large matrices kept in the "
              f"checkpoint's bf16, widened inside the matvec)")
    if lm.ultra:
        print(f"final norms: {human(lm.table_bytes)} resident; embedding and lm_head streamed "
              f"in {lm.bind_seconds:.1f} s")
    else:
        print(f"embedding, final norm and lm_head: {human(lm.table_bytes)} in "
              f"{lm.bind_seconds:.1f} s")
    print(f"peak RSS after loading weights: {human(peak_rss_bytes())}  (the plan above is a "
          f"forecast, this is measured)")
    print(lm.experts.init_line())
    events.emit("cache_open", nslot=lm.experts.nslot, slot_bytes=lm.experts.slot_bytes)
    one_slot = lm.ultra and not o.incremental
    print(f"recurrent state: one {human(lm.model.new_state(0, True).nbytes())} slot, cleared "
          f"and reused across {nl} layers" if one_slot else
          f"recurrent state for {nl} layers: {human(lm.model.new_state(0).nbytes())}")
    draft = None
    if o.draft_trunk:
        draft = load_draft(lm, setup, the_plan, positions, draft_topk, o.draft_cache_only)
        dm, dt = setup.draft_manifest, draft.trunk
        kind = f"{dm.draft['bits']}-bit derived" if dm.draft else "NOT quantised: exact weights"
        print(f"draft trunk: {human(dm.total_bytes())} ({kind}), pinned {len(dt.pinned)}/{nl} "
              f"layers, ring {dt.nslot} slots")
    return Prepared(cfg, nl, tok, ids, lm, draft)


def draft_gb(o: Options) -> float:
    return DEFAULT_DRAFT_TRUNK_GB if o.draft_trunk_gb is None else float(o.draft_trunk_gb)


class PlanRefused(Exception):
    def __init__(self, code: int):
        self.code = code


def tables_read(lm) -> tuple[int, int, int, float]:
    """(total, embedding, lm_head) bytes and seconds the streamed model tables read."""
    st = lm.table_stream
    if st is None:
        return 0, 0, 0, 0.0
    return st.embedding_bytes + st.lm_head_bytes, st.embedding_bytes, st.lm_head_bytes, \
        st.read_seconds


def step_event(lm, s: Step, trunk_before: tuple) -> dict:
    ex = lm.experts.step
    tr = lm.trunk
    t_bytes = (tr.bytes_read - trunk_before[0]) if tr else 0
    t_s = (tr.read_seconds - trunk_before[1]) if tr else 0.0
    req = ex.requests
    return dict(step=s.step, ids=s.ids, seconds=s.seconds, rss_bytes=rss_bytes(),
                peak_rss_bytes=peak_rss_bytes(), trunk_bytes=t_bytes, trunk_read_s=t_s,
                trunk_hits=tr.hits if tr else 0, trunk_binds=tr.binds if tr else 0,
                expert_requests=req, expert_hits=ex.hits, expert_misses=ex.misses,
                expert_evictions=ex.evictions, expert_prefetch_reads=ex.prefetch_reads,
                expert_bytes=ex.bytes_read, expert_read_s=ex.load_seconds,
                model_table_bytes=tables_read(lm)[0] - trunk_before[2],
                true_resident_hit=ex.true_hit_rate / 100.0,
                io_share_step=((t_s + ex.load_seconds) / s.seconds) if s.seconds > 0 else 0.0,
                resident_experts=lm.experts.policy.resident, pinned_experts=lm.experts.policy.pinned)


def run(o: Options, events: Events) -> int:
    prior: list[int] = []
    hdr = None
    if o.load_state:
        from .statefile import peek_state
        hdr = peek_state(o.load_state)
        prior = [0] * hdr.nseq                     # sized now, restored after the model loads
    p = prepare(o, events, positions_extra=len(prior))
    lm, cfg, tok = p.lm, p.cfg, p.tok
    gen = o.gen_n
    if o.tf_check:
        return tf_check(o, p)
    state = None
    if o.load_state:
        from .statefile import load_state
        t0 = time.monotonic()
        state = lm.model.new_state(len(prior) + len(p.ids) + gen + 1)
        prior = load_state(o.load_state, state)
        restored = (f"restored {state.n_cached} positions in {time.monotonic() - t0:.2f} s: "
                    f"decode continues without re-reading the prior context")
        print(f"resuming from {o.load_state}: {state.n_cached} prior positions, {len(p.ids)} new")
    if o.incremental:                              # the order of SYSTEM §7.1
        positions = len(prior) + len(p.ids) + gen + 1
        per_pos = 4 * sum(cfg.n_heads * (cfg.qk_nope + cfg.v_head) + cfg.qk_rope
                          for L in range(p.nl) if cfg.is_mla(L))
        print(f"incremental decode: KV cache {human(per_pos * positions)}"
              f" for {sum(cfg.is_mla(L) for L in range(p.nl))} MLA layers at {positions} positions")
    if o.load_state:
        print(restored)
    if p.draft is not None:
        print(f"hybrid decode: draft trunk {o.draft_trunk} ({draft_gb(o):.2f} GB budget) "
              f"proposes up to {min(int(o.spec), MAX_DRAFT)} tokens per sweep; the exact model "
              f"verifies them batched (draft routes top-{p.draft.model.router.k} "
              f"{'among cached experts only' if o.draft_cache_only else 'through the cache'}"
              f"{'; adaptive width' if o.spec_auto else ''})")
    elif int(o.spec):
        print(f"speculative decode: up to {min(int(o.spec), MAX_DRAFT)} drafted tokens per sweep, "
              f"n-gram lookup, verified batched{'; adaptive width' if o.spec_auto else ''}")
    print()
    print(STEP_HEADER)
    print(RULE)
    cancel = Cancel()
    trunk_before = [(0, 0.0, 0)]

    def on_step(s: Step) -> None:
        ex = lm.experts.step
        tok_id = s.ids[-1] if s.ids else -1
        print(step_line(s.step, tok_id, s.seconds, ex.raw_hit_rate, ex.bytes_read), flush=True)
        if s.logits is not None and o.dump_logits:
            write_atomic(o.dump_logits, s.logits.astype("<f4").tobytes())
            print(f"wrote {o.dump_logits} ({s.logits.shape[0]} float32 logits)")
        if o.stream_tokens:
            for i in s.ids:
                print(f"@K3TOKEN {i}", flush=True)
        events.emit("step", **step_event(lm, s, trunk_before[0]))
        for i in s.ids:
            events.emit("token", id=i, text_delta=stream.push(i) if stream else "")
        tr = lm.trunk
        trunk_before[0] = ((tr.bytes_read, tr.read_seconds) if tr else (0, 0.0)) + \
            (tables_read(lm)[0],)

    from .tokenizer import StreamDecoder
    stream = StreamDecoder(tok) if tok else None
    sampler = make_sampler(o)
    sampler.new_turn(1)                      # batch mode: one stream, turn 1
    with Interrupts(cancel):
        res = generate(lm, p.ids, gen, o.incremental, on_step, o.stop_ids, sampler, cancel,
                       state, prior, on_step_start=lambda g: lm.experts.reset_step(),
                       spec=int(o.spec), proposer=p.draft, spec_auto=o.spec_auto)
    return finish(o, lm, p, res, events)


def tf_check(o: Options, p: Prepared) -> int:
    """--tf-check (SYSTEM §6.11): one teacher-forced pass, per-position agreement."""
    ids = p.ids
    if len(ids) < 2:
        raise UsageError("--tf-check needs at least 2 ids")
    t0 = time.monotonic()
    from .model import greedy
    logits = p.lm.model.forward(ids, p.lm.model.new_state(len(ids)), all_logits=True)
    pred = [greedy(row) for row in logits[:-1]]
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
    p.lm.close()
    return EXIT_OK


def finish(o: Options, lm, p: Prepared, res: RunResult, events: Events) -> int:
    gen = o.gen_n
    n = len(res.generated_ids)
    if res.stopped_at >= 0:
        print(f"stop id {res.stopped_at} reached after {n} of {gen} tokens")
    if res.interrupted:
        print(f"interrupted: {n} of {gen} tokens generated; state, results and reports follow "
              f"as for a finished run")
    if o.save_state:
        if not o.incremental:
            print("k3: --save-state needs --incremental; nothing written", file=sys.stderr)
        else:
            from .statefile import StateFileError, save_state
            t0 = time.monotonic()
            try:
                size = save_state(o.save_state, res.state, res.full_ids)
                print(f"wrote {o.save_state} ({human(size)}, {res.state.n_cached} positions) in "
                      f"{time.monotonic() - t0:.2f} s")
            except StateFileError as e:
                print(f"k3: {e}", file=sys.stderr)
    sp = res.spec
    if p.draft is not None:
        print(f"hybrid decode: {sp.rounds} rounds, {sp.drafted} drafted, {sp.accepted} accepted "
              f"({sp.accepted_pct:.1f}%), mean accepted run "
              f"{sp.mean_run:.2f}")
        print(f"  draft model: {p.draft.seconds:.1f} s of {res.wall_seconds:.1f} s wall in "
              f"{p.draft.steps} forward calls; draft trunk read "
              f"{p.draft.trunk.bytes_read / 1e9:.2f} GB")
    print(RULE)
    if n:
        print(f"{n} tokens in {res.wall_seconds:.1f} s, {res.wall_seconds / n:.2f} s/token average")
    else:
        print(f"prefill only: {res.state.n_cached if res.state else 0} positions cached, "
              f"0 tokens generated")
    print(f"generated ids: {','.join(str(i) for i in res.generated_ids)}")
    if sp.rounds and p.draft is None:
        print(f"speculative decode: {sp.rounds} sweeps, {sp.drafted} drafted, {sp.accepted} "
              f"accepted ({sp.accepted_pct:.1f}%)")
    text = None
    if p.tok is not None and n:
        text = p.tok.decode(res.generated_ids)
        print()
        print("--- generated text ---")
        sys.stdout.flush()
        sys.stdout.buffer.write(text + b"\n")
        sys.stdout.flush()
        print("-" * 22)
    print()
    peak = peak_rss_bytes()
    drops = lm.experts.drops
    print(f"PEAK RSS for the whole run: {human(peak)}   <- quote this, not the plan")
    print(f"layers completed: {res.layers_completed}/{p.nl}; routed expert drops: {drops}")
    print()
    for line in lm.experts.report_lines():
        print(line)
    tr = lm.trunk
    _, embed_bytes, head_bytes, table_s = tables_read(lm)
    spt = res.wall_seconds / n if n else 0.0
    values = dict(prompt_ids=res.prompt_ids, generated_ids=res.generated_ids,
                  full_ids=res.full_ids, layers=p.nl, layers_requested=p.nl,
                  layers_completed=res.layers_completed, expert_drops=drops, peak_rss_bytes=peak,
                  wall_seconds=res.wall_seconds, seconds_per_token=spt,
                  expert_bytes_read=lm.experts.total.bytes_read,
                  trunk_bytes_read=tr.bytes_read if tr else 0,
                  embedding_bytes_read=embed_bytes, lm_head_bytes_read=head_bytes,
                  ultra_low_memory=lm.ultra, stopped_at=res.stopped_at,
                  interrupted=res.interrupted, generated_text=text)
    code = EXIT_OK
    extra = spec_keys(o, p, res)
    try:
        write_atomic(o.out, out_line(values, extra))
        print(f"wrote {o.out}")
    except OSError as e:
        print(f"cannot write {o.out}: {e.strerror}", file=sys.stderr)
        code = EXIT_OUT
    if o.dump_cache_trace:
        for path in lm.experts.dump_trace(o.dump_cache_trace):
            print(f"wrote {path}")
    io_s = (tr.read_seconds if tr else 0.0) + lm.experts.total.load_seconds + table_s
    if res.wall_seconds > 0:
        print(f"I/O share of wall clock: {100 * io_s / res.wall_seconds:.1f}%  (trunk "
              f"{tr.read_seconds if tr else 0.0:.1f} s + experts "
              f"{lm.experts.total.load_seconds:.1f} s + model tables {table_s:.1f} s of "
              f"{res.wall_seconds:.1f} s)")
        print(f"  both figures are WHOLE-RUN totals over {len(res.steps)} steps")
    if tr is not None:
        print()
        print("trunk [final]")
        print(f"  pinned {len(tr.pinned)}/{p.nl} layers, ring {tr.nslot} slots")
        print(f"  binds {tr.binds}, hits {tr.hits} ({100 * tr.hits / max(tr.binds, 1):.1f}%), "
              f"reads {tr.misses}")
        rate = tr.bytes_read / tr.read_seconds / 1e6 if tr.read_seconds > 0 else 0.0
        print(f"  read {tr.bytes_read / 1e9:.2f} GB in {tr.read_seconds:.2f} s ({rate:.0f} MB/s)")
    summary = dict(values, **extra, generated_text=None if text is None else
                   text.decode("utf-8", errors="replace"), io_share=io_s / res.wall_seconds
                   if res.wall_seconds > 0 else 0.0)
    events.emit("summary", **summary)
    if p.draft is not None:
        p.draft.close()
    lm.close()
    if res.expert_drop is not None:              # 4 > 3 > 5 > 0 (SYSTEM §6.5)
        print(f"RUN INVALID: {res.expert_drop}; the affected token was not emitted",
              file=sys.stderr)
        return EXIT_DROP
    if code == EXIT_OK and res.interrupted:
        code = EXIT_INTERRUPTED
    return code


def spec_keys(o: Options, p: Prepared, res: RunResult) -> dict:
    """The SF extension keys of --out for speculative and hybrid decode (readers ignore
    unknown keys, SYSTEM §6.7)."""
    if not int(o.spec):
        return {}
    sp = res.spec
    keys = dict(spec_rounds=sp.rounds, spec_drafted=sp.drafted, spec_accepted=sp.accepted)
    if p.draft is not None:
        keys.update(draft_trunk=o.draft_trunk, draft_trunk_gb=draft_gb(o),
                    draft_topk=p.draft.model.router.k, draft_cache_only=o.draft_cache_only,
                    draft_seconds=round(p.draft.seconds, 4), draft_forwards=p.draft.steps,
                    draft_trunk_bytes_read=p.draft.trunk.bytes_read)
    if o.spec_auto:
        keys.update(spec_auto=True, spec_auto_final_width=sp.width,
                    spec_auto_mean_width=round(sp.width_sum / max(sp.rounds, 1), 4))
    return keys


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
            sink = JsonLinesSink(o.events)
            events.sinks.append(sink)
        if o.chat:
            from .chat_repl import chat_main
            return chat_main(o, events)
        return run(o, events)
    except UsageError as e:
        msg = str(e)
        if msg:
            print(f"k3: {msg}", file=sys.stderr)
        if not msg or msg.startswith("unknown option"):
            print(USAGE, end="", file=sys.stderr)
        events.emit("error", code=EXIT_USAGE, kind="UsageError", message=msg)
        return EXIT_USAGE
    except PlanRefused as e:
        events.emit("error", code=e.code, kind="PlanRefused", message="memory plan refused")
        return e.code
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
