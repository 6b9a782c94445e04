"""The engine: load once, decode many.  Every front end (k3, the chat REPL, K3 Studio's
worker, k3 serve) opens one `Engine` and runs turns on it.

    load_spec_from(...) -> LoadSpec     presets, budgets and defaults applied once
    open_engine(spec, sink) -> Engine   open, plan, refusals, tokenizer, load (as events)
    engine.sequence() / resume(path)    a Sequence (its ids and state; sequence.py)
    engine.generate(seq, GenSpec, ...)  the decode generator (generate.decode)
    engine.check_limits(n, gen)         a request beyond what the engine holds: LimitError

Layering: front ends -> conversation -> engine -> generate/sequence -> loading/model/
residency -> formats/kernels.  Every figure a front end shows is computed here or in
generate.TurnSummary; no front end reads the cache's or the trunk's counters itself.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Sequence as Seq

from . import events as E
from .errors import LimitError, PlanRefused, UsageError
from .generate import Cancel, GenSpec, Sampling, TurnSummary, decode
from .ids import parse_ids, read_ids_file
from .inputfile import InputFileError, read_regular_file
from .loading import load_draft, load_model, open_model, read_config
from .lookahead import enabled as lookahead_enabled
from .memory import (AUTO, DEFAULT_DRAFT_TRUNK_GB, PRESETS, Budgets, PlanRequest,
                     available_memory, kv_check, plan_for, resolve_budgets)
from .sequence import Sequence
from .speculative import MAX_DRAFT
from .telemetry import PeakWindow, peak_rss_bytes, rss_bytes
from .threads import default_threads, set_threads

__all__ = ["LoadSpec", "Prompt", "Draft", "load_spec_from", "memory_flags", "open_engine",
           "Engine", "GenSpec", "Sampling", "Cancel", "TurnSummary", "MAX_GEN",
           "MAX_POSITIONS", "MAX_PROMPT", "chat_controls"]

MAX_PROMPT = 32768
MAX_GEN = 4096
MAX_POSITIONS = 36864
PROMPT_FILE_LIMIT = 1 << 30     # --prompt-file: the file's bytes verbatim, at most 1 GiB


@dataclass(frozen=True)
class Prompt:
    """A batch prompt: exactly one of ids (or their text, as --ids gives it), an ids file,
    text (added tokens recognised), a text file."""
    ids: tuple[int, ...] | None = None
    ids_text: str | None = None
    ids_file: str | None = None
    text: str | None = None
    text_file: str | None = None


@dataclass(frozen=True)
class Draft:
    """Hybrid decode's draft model (--draft-trunk and its options)."""
    trunk_dir: str
    trunk_gb: float = DEFAULT_DRAFT_TRUNK_GB
    topk: int | None = None           # None: min(4, the model's top-k)
    cache_only: bool = False


@dataclass(frozen=True)
class LoadSpec:
    """What is loaded once: the model, its trunk, the memory budgets, threads, the expert
    cache's policy, the draft.  Built only by `load_spec_from`, so a CLI flag and an app
    setting cannot mean different things.  What changes per turn is a GenSpec."""
    model_dir: str
    budgets: Budgets = Budgets()
    trunk_dir: str | None = None
    tok_dir: str | None = None
    config_path: str | None = None
    trunk_ring: int = 2
    threads: int = 0                  # 0: OMP_NUM_THREADS, else physical cores
    layers: int | None = None         # --layers: bind only the first N
    incremental: bool = False         # carry state between steps (chat and serve always)
    spec: int = 0                     # the widest speculative sweep the plan makes room for
    draft: Draft | None = None
    drafter_dir: str | None = None    # a block drafter's folder (--draft-model, drafter.py)
    keep_trace: bool = False          # keep every expert request (--dump-cache-trace)
    trace_window: int = 0             # ...only the latest N of them (the app's session trace)
    cache_policy: str | None = None   # "lru" / "s3fifo"; None: K3_CACHE_POLICY, else LRU
    lookahead: bool = True            # expert reads from a guess of the router (lookahead.py;
                                      # K3_NOLOOKAHEAD=1 turns it off whatever this says)
    turn_peaks: bool = False          # each turn's peak RSS on its own (the app; VmHWM reset)
    sequences: int = 1                # sequences held at once (a batch, serve --parallel)
    # the app's process baseline (SYSTEM §5.8) and a fixed availability for tests
    baseline_bytes: int = 0
    baseline_label: str = "python baseline"
    available_override: int | None = None
    total_memory: int = 0

    @property
    def streamed(self) -> bool:
        return bool(self.trunk_dir)

    def plan_request(self, positions: int, layers: int | None = None,
                     draft_sizes: Seq[int] | None = None, drafter=None) -> PlanRequest:
        """`drafter`: the block drafter's drafter.DrafterSize, to count."""
        return PlanRequest(budgets=self.budgets, trunk_ring=self.trunk_ring,
                           streamed=self.streamed, incremental=self.incremental,
                           positions=positions, layers=layers, baseline_bytes=self.baseline_bytes,
                           baseline_label=self.baseline_label, draft_sizes=draft_sizes,
                           draft_gb=self.draft.trunk_gb if self.draft else DEFAULT_DRAFT_TRUNK_GB,
                           spec=min(self.spec, MAX_DRAFT), keep_trace=self.keep_trace,
                           trace_window=self.trace_window, sequences=self.sequences,
                           lookahead=lookahead_enabled(self.lookahead),
                           drafter_weights=drafter.weight_bytes if drafter else 0,
                           drafter_per_position=drafter.per_position if drafter else 0)


def load_spec_from(model_dir: str, memory: Iterable[tuple[str, object]] = (), **fields
                   ) -> LoadSpec:
    """The LoadSpec for `model_dir`, with the memory flags applied in argv order
    (`[("--preset", "laptop")]`, `[("--trunk-gb", 3), ("--cache-gb", 1)]`, ...) exactly as
    `k3` applies them (memory.resolve_budgets), and the other fields as given.  Raises
    BudgetError (exit 2) for a budget that cannot run."""
    return LoadSpec(model_dir=model_dir, budgets=resolve_budgets(memory), **fields)


def memory_flags(preset: str, trunk_gb: float, cache_gb: float) -> list[tuple[str, object]]:
    """The app's budget settings as the flags `k3` would be given (`custom`: the sliders)."""
    if preset == AUTO or preset in PRESETS:
        return [("--preset", preset)]
    return [("--trunk-gb", float(trunk_gb)), ("--cache-gb", float(cache_gb))]


# ---------------------------------------------------------------------------- set-up

def read_prompt(p: Prompt, tok, sink) -> list[int]:
    if p.ids is not None:
        return list(p.ids)
    if p.ids_text is not None:
        return parse_ids(p.ids_text, "--ids")
    if p.ids_file is not None:
        return read_ids_file(p.ids_file)               # a regular file, bounded (ids.py)
    if p.text_file is not None:
        try:
            data = read_regular_file(p.text_file, PROMPT_FILE_LIMIT, "--prompt-file")
        except InputFileError as e:
            raise UsageError(f"cannot read --prompt-file {e}") from None
        text = data.decode("utf-8", errors="surrogateescape")
    else:
        text = p.text
    nbytes = len(text.encode("utf-8", errors="surrogateescape"))
    ids = tok.encode(text, True)                   # added tokens recognised in batch prompts
    sink(E.PromptRead(nbytes, len(ids)))
    return ids


def chat_controls(tok):
    """The chat's control ids, or a refusal (exit 2) when the files do not declare them."""
    from .chat import ChatSetupError
    from .tokenizer import TokenizerError, control_ids
    if tok is None:
        raise ChatSetupError("chat needs a tokenizer")
    try:
        return control_ids(tok, None)
    except TokenizerError as e:
        raise ChatSetupError(str(e)) from None


def open_engine(spec: LoadSpec, sink: E.Sink | None = None, tok=None, *,
                prompt: Prompt | None = None, gen: int = MAX_GEN,
                stop_ids: Seq[int] = (), load_state: str | None = None,
                plan_only: bool = False) -> "Engine":
    """Threads, config, tokenizer, the first request's prompt, limits, index, plan
    (refusals), then the model, in the order the reference reports them; each stage is an
    event to `sink`.  The plan's KV cache is sized for the first request: `prompt` (a
    batch run's; `engine.prompt_ids` after this), `gen` ids and a resumed `load_state`
    (a chat or a server sizes for `gen` alone and checks each turn, check_limits).  `tok`
    is a tokenizer the caller already loaded from spec.tok_dir (the chat REPL needs it
    before the model).  Raises an EngineError (errors.describe gives its exit code).
    `plan_only`: stop after the plan and return it (nothing is loaded)."""
    sink = sink or (lambda ev: None)
    threads = spec.threads or default_threads()
    set_threads(threads)
    sink(E.ThreadsSet(threads))
    cfg, cfg_path = read_config(spec.model_dir, spec.config_path)
    nl = cfg.n_layers if spec.layers is None else spec.layers
    if not 1 <= nl <= cfg.n_layers:
        raise UsageError(f"--layers {nl} is out of range (1..{cfg.n_layers})")
    sink(E.ConfigRead(cfg, cfg_path, nl))
    if tok is None and spec.tok_dir:
        from .tokenizer import Tokenizer
        tok = Tokenizer.from_dir(spec.tok_dir)            # failures exit 1 (SYSTEM §6.5)
    if tok is not None:
        sink(E.TokenizerLoaded(tok.report_line()))
    ids = read_prompt(prompt, tok, sink) if prompt is not None else []
    if len(ids) > MAX_PROMPT:
        raise LimitError(f"prompt has {len(ids)} ids; the limit is {MAX_PROMPT} (refused, "
                         f"never truncated)", "prompt")
    check_vocab(list(ids) + list(stop_ids), cfg.vocab)
    draft_topk = _draft_topk(spec, cfg)
    if spec.draft is not None and draft_topk > cfg.topk:
        raise UsageError(f"--draft-topk {draft_topk} exceeds the model's top-{cfg.topk}")
    n_prior = 0
    if load_state:
        from .statefile import peek_state
        n_prior = peek_state(load_state).nseq          # sized now, restored after the load
    positions = n_prior + len(ids) + gen + 1
    if positions > MAX_POSITIONS:
        raise LimitError(f"prompt {n_prior + len(ids)} + gen {gen} + 1 exceeds the "
                         f"{MAX_POSITIONS}-position ceiling", "positions")
    sink(E.RunHeader(spec.model_dir, None if prompt is None else len(ids), gen))

    setup = open_model(spec.model_dir, cfg, nl, spec.trunk_dir,
                       spec.draft.trunk_dir if spec.draft else None)
    drafter = None
    try:
        if spec.drafter_dir:
            from .drafter import open_drafter
            drafter = open_drafter(spec.drafter_dir, cfg, nl)   # checked before the plan
        sink(E.Indexed(len(setup.ck), len(setup.ck.shards), setup.index_seconds,
                       tuple(setup.ck.notes)))
        if spec.available_override is not None:
            available = int(spec.available_override)
        else:
            _, available = available_memory()
        the_plan = plan_for(setup.figures, spec.plan_request(
                                positions, nl, setup.draft_sizes, drafter and drafter.size),
                            available, spec.total_memory)
        sink(E.Planned(the_plan, spec.trunk_dir,
                       setup.manifest.total_bytes() if setup.manifest else 0))
        if the_plan.refusals:
            raise PlanRefused(the_plan)
        if plan_only:
            setup.ck.close()
            if drafter is not None:
                drafter.close()
            return the_plan
        engine = Engine(spec, cfg, nl, tok, setup, the_plan, positions, sink, threads,
                        available)
        engine.prompt_ids, engine.n_prior = ids, n_prior
        engine._load(draft_topk, drafter)
    except BaseException:
        setup.ck.close()
        if drafter is not None:
            drafter.close()
        raise
    return engine


def check_vocab(ids: Iterable[int], vocab: int) -> None:
    for i in ids:
        if i >= vocab:
            raise LimitError(f"token id {i} is outside the vocabulary of {vocab}", "vocab")


def _draft_topk(spec: LoadSpec, cfg) -> int:
    from .draft import DEFAULT_DRAFT_TOPK
    if spec.draft is None or spec.draft.topk is None:
        return min(DEFAULT_DRAFT_TOPK, cfg.topk)
    return spec.draft.topk


def _eta(t0: float, done: int, total: int) -> tuple[float, float | None]:
    """(elapsed, seconds left at the rate so far) of a phase that started at t0."""
    elapsed = time.monotonic() - t0
    frac = done / total if total else 1.0
    return elapsed, (elapsed * (1 - frac) / frac if frac > 0 else None)


# ---------------------------------------------------------------------------- the engine

class Engine:
    """A loaded model with its plan, ready to run turns on its sequences; `close()`
    releases it."""

    def __init__(self, spec: LoadSpec, cfg, nl: int, tok, setup, the_plan, positions: int,
                 sink: E.Sink, threads: int, available):
        self.spec, self.cfg, self.nl, self.tok = spec, cfg, nl, tok
        self.setup, self.plan, self.positions = setup, the_plan, positions
        self.sink, self.threads, self.available = sink, threads, available
        self.prompt_ids: list[int] = []   # the first request's prompt (a batch run's)
        self.n_prior = 0
        self.lm = None
        self.draft = None
        self.drafter = None               # a block drafter (drafter.BlockDrafter)
        self._ctl = None
        self._trunk_mark = (0, 0.0, 0)
        self._peak = PeakWindow() if spec.turn_peaks else None

    @classmethod
    def around(cls, lm, tok=None, *, incremental: bool = True, spec: int = 0, draft=None,
               setup=None, drafter=None) -> "Engine":
        """An engine over a model loaded by loading.load_model (tests, benchmarks, the
        training tools): the same decode, no plan, no limits beyond the model's."""
        e = cls(LoadSpec(model_dir="", incremental=incremental, spec=spec), lm.cfg,
                lm.model.n_layers, tok, setup, None, 0, lambda ev: None, 0, None)
        e.lm, e.draft, e.drafter = lm, draft, drafter
        return e

    @property
    def incremental(self) -> bool:
        return self.spec.incremental

    @property
    def spec_max(self) -> int:
        return min(self.spec.spec, MAX_DRAFT) if self.spec.incremental else 0

    @property
    def ctl(self):
        """The chat's control ids (refused, exit 2, when the tokenizer lacks them)."""
        if self._ctl is None:
            self._ctl = chat_controls(self.tok)
        return self._ctl

    # -- loading -------------------------------------------------------------------
    def _load(self, draft_topk: int, drafter=None) -> None:
        spec, setup, the_plan, sink = self.spec, self.setup, self.plan, self.sink
        tp = the_plan.trunk_plan
        pinned = set(tp.pinned) if tp is not None else set()
        pinned_total = sum(setup.manifest.layers[L].nbytes for L in pinned) if pinned else 0
        seen: set[int] = set()
        done = [0]
        started = [0.0]

        def on_read(L, nbytes, seconds):
            """Token 0 reads every pinned layer once (SYSTEM §3.7): report it as progress
            (bytes, elapsed, an ETA at the rate so far) so a slow first token never looks
            like a hang."""
            if L in pinned and L not in seen:
                if not seen:
                    started[0] = time.monotonic() - seconds
                seen.add(L)
                done[0] += nbytes
                sink(E.LoadProgress("pinned_first_touch", L, done[0], pinned_total,
                                    *_eta(started[0], done[0], pinned_total)))
        t0 = time.monotonic()
        lm = load_model(setup, plan=the_plan, on_trunk_read=on_read,
                        cache_bytes=int(the_plan.expert_cache_bytes), ultra=the_plan.ultra,
                        keep_trace=spec.keep_trace, trace_window=spec.trace_window,
                        cache_policy=spec.cache_policy, lookahead=lookahead_enabled(spec.lookahead))
        self.lm = lm
        tr = lm.trunk
        one_slot = lm.ultra and not spec.incremental
        sink(E.Loaded(
            streamed=tr is not None, trunk_dir=spec.trunk_dir, direct=bool(tr and tr.direct),
            pinned_layers=tuple(sorted(tr.pinned)) if tr else tuple(range(self.nl)),
            ring_slots=tr.nslot if tr else 0, slot_bytes=tr.slot_bytes if tr else 0,
            seconds=time.monotonic() - t0, resident_trunk_bytes=lm.trunk_bytes,
            table_bytes=lm.table_bytes, bind_seconds=lm.bind_seconds, ultra=lm.ultra,
            peak_rss_bytes=peak_rss_bytes(), cache_line=lm.experts.init_line(),
            expert_slots=lm.experts.nslot, expert_slot_bytes=lm.experts.slot_bytes,
            state_bytes=lm.model.new_state(0, one_slot).nbytes(), one_recurrent_slot=one_slot,
            n_layers=self.nl))
        for ev in self.trunk_notices():
            sink(ev)
        if spec.draft is not None:
            self.draft = load_draft(lm, setup, the_plan, self.positions, draft_topk,
                                    spec.draft.cache_only)
            dm, dt = setup.draft_manifest, self.draft.trunk
            sink(E.DraftLoaded(dm.total_bytes(), dm.draft["bits"] if dm.draft else None,
                               len(dt.pinned), self.nl, dt.nslot))
        if drafter is not None:
            from .drafter import load_drafter
            t0 = time.monotonic()
            nbytes = drafter.size.weight_bytes
            self.drafter = load_drafter(drafter, lm.model.weights.tables)
            dc = self.drafter.config
            sink(E.DrafterLoaded(spec.drafter_dir, dc.n_layers, dc.block_size,
                                 dc.target_layers, nbytes, time.monotonic() - t0))

    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()
            self.draft = None
        if self.lm is not None:
            self.lm.close()
            self.lm = None

    # -- sequences -----------------------------------------------------------------
    def sequence(self) -> Sequence:
        """A new, empty sequence on this engine's model."""
        return Sequence(self.lm.model, shared_recurrent=self.lm.ultra and not self.incremental,
                        features=self.drafter)

    def resume(self, path: str, room: int, n_new: int = 0) -> tuple[Sequence, E.Resumed]:
        """A sequence restored from a state file (v2), with room for `room` more positions
        than it holds (`n_new` of them a new prompt, for the report); refused
        (StateFileError, exit 1) before anything changes."""
        from .statefile import load_state, peek_state
        t0 = time.monotonic()
        seq = self.sequence()
        seq.state = self.lm.model.new_state(peek_state(path).nseq + room)
        seq.ids = load_state(path, seq.state)
        return seq, E.Resumed(path, seq.state.n_cached, n_new, time.monotonic() - t0)

    def proposer(self, seq: Sequence):
        """What drafts for a speculative sweep on `seq`: the block drafter (it follows the
        sequence through the features its passes hand it), the draft model (made to follow
        this sequence from its start when it followed another) or n-gram lookup (None)."""
        if self.drafter is not None:
            return self.drafter
        if self.draft is not None:
            self.draft.follow(seq.ids, len(seq.ids) + MAX_DRAFT + 1)
        return self.draft

    # -- limits --------------------------------------------------------------------
    def check_limits(self, n_prompt: int, gen: int, ids: Iterable[int] = (),
                     max_prompt: int = MAX_PROMPT) -> None:
        """Refuse a request the engine cannot hold, before any work: the prompt limit, the
        position ceiling, ids outside the vocabulary, and the KV cache the request needs
        against the memory available at load (SYSTEM §5.5.1).  Raises LimitError (exit 2;
        the server answers 400 with its `kind`)."""
        if n_prompt > max_prompt:
            raise LimitError(f"the prompt is {n_prompt} tokens; the limit is {max_prompt} "
                             f"(refused, never truncated)", "prompt")
        if n_prompt + gen + 1 > MAX_POSITIONS:
            raise LimitError(f"prompt {n_prompt} + gen {gen} + 1 exceeds the "
                             f"{MAX_POSITIONS}-position ceiling", "positions")
        check_vocab(ids, self.cfg.vocab)
        if self.setup is None:                  # Engine.around: no figures to check against
            return
        kv = kv_check(self.setup.figures, n_prompt + gen + 1, self.available)
        if kv.refusal is not None:
            raise LimitError(kv.refusal.message, "kv_cache")

    # -- turns -----------------------------------------------------------------------
    def generate(self, seq: Sequence, spec: GenSpec, sampler=None, cancel: Cancel | None = None,
                 **how):
        """The decode generator (generate.decode) on `seq` with this engine."""
        sampler = sampler or spec.sampling.sampler()
        return decode(self, seq, spec, sampler, cancel, **how)

    def batch(self, ids, spec: GenSpec, cancel: Cancel | None = None, seq: Sequence | None = None,
              **how):
        """A batch run (SYSTEM §6.4): `ids` appended to `seq` (a resumed one, or a new
        sequence), one sampler stream (turn 1), the decode generator over them."""
        seq = seq if seq is not None else self.sequence()
        seq.extend(ids, spec.gen + 1)
        sampler = spec.sampling.sampler()
        sampler.new_turn(1)
        return self.generate(seq, spec, sampler, cancel, **how)

    def teacher_forced(self, ids: list[int]) -> list[int]:
        """--tf-check (SYSTEM §6.11): the model's greedy prediction after each prefix of
        `ids`, from one pass over all of them."""
        from .model import greedy
        model = self.lm.model
        logits = model.forward(ids, model.new_state(len(ids)), all_logits=True)
        return [greedy(row) for row in logits[:-1]]

    # -- figures -------------------------------------------------------------------
    def measure_step(self, seconds: float) -> E.StepTelemetry:
        """The step's telemetry from the counters of the step just done; starts the next
        step's trunk window."""
        lm = self.lm
        ex = lm.experts.step
        tr = lm.trunk
        mark = self._io_counters()
        t_bytes, t_s, tables = (now - then for now, then in zip(mark, self._trunk_mark))
        tel = E.StepTelemetry(
            rss_bytes=rss_bytes(), peak_rss_bytes=peak_rss_bytes(), trunk_bytes=t_bytes,
            trunk_read_s=t_s, trunk_hits=tr.hits if tr else 0,
            trunk_binds=tr.binds if tr else 0, expert_requests=ex.requests,
            expert_hits=ex.hits, expert_misses=ex.misses, expert_evictions=ex.evictions,
            expert_prefetch_reads=ex.prefetch_reads, expert_bytes=ex.bytes_read,
            expert_read_s=ex.load_seconds, model_table_bytes=tables,
            true_resident_hit=ex.true_hit_rate / 100.0,
            io_share_step=((t_s + ex.load_seconds) / seconds) if seconds > 0 else 0.0,
            resident_experts=lm.experts.policy.resident, pinned_experts=lm.experts.policy.pinned,
            raw_hit_rate=ex.raw_hit_rate, retention_rate=ex.retention,
            io_trunk_share=t_s / seconds if seconds > 0 else 0.0,
            io_expert_share=ex.load_seconds / seconds if seconds > 0 else 0.0,
            lookahead_predicted=ex.la_predicted, lookahead_useful=ex.la_useful,
            lookahead_wasted=ex.la_wasted, lookahead_bytes=ex.la_bytes,
            lookahead_wasted_bytes=ex.la_wasted_bytes, lookahead_recall=ex.la_recall)
        self._trunk_mark = mark
        return tel

    def _io_counters(self) -> tuple[int, float, int]:
        """(trunk bytes from the disk, trunk read seconds, model-table bytes) so far: a
        compressed trunk counts its stored bytes, not the layers decoded from them."""
        tr = self.lm.trunk
        return ((tr.stored_bytes_read, tr.read_seconds) if tr else (0, 0.0)) \
            + (self.tables_read()[0],)

    def _turn_counters(self) -> tuple[int, ...]:
        t = self.lm.experts.total
        trunk, _, tables = self._io_counters()
        return (trunk, t.bytes_read, tables, t.requests, t.hits, t.la_predicted, t.la_useful,
                t.la_wasted_bytes)

    def turn_window(self):
        """Open the decode loop's figures: counters now, the peak from here."""
        self._trunk_mark = self._io_counters()
        if self._peak is not None:
            self._peak.reset()
        return self._turn_counters()

    def counters(self):
        """The counters a run's figures are deltas of (close_window): its window."""
        return self._turn_counters()

    def close_window(self, window, res: TurnSummary) -> None:
        """`res`'s figures at its end: counter deltas since `window` (None: keep the
        shares the loop gave it), the peak RSS since turn_window, the end id's name."""
        if window is not None:
            (res.trunk_bytes, res.expert_bytes, res.table_bytes, res.expert_requests,
             res.expert_hits, res.lookahead_predicted, res.lookahead_useful,
             res.lookahead_wasted_bytes) = (now - then for now, then in
                                            zip(self._turn_counters(), window))
        res.peak_rss_bytes = self._peak.sample() if self._peak is not None \
            else peak_rss_bytes()
        if res.end_id is not None and self.tok is not None:
            res.end_name = self.tok.added.get(res.end_id, str(res.end_id)) \
                if hasattr(self.tok, "added") else str(res.end_id)

    def session_figures(self) -> dict:
        """Whole-session figures beside a turn's (the app's panels): the expert cache's
        retention and true resident hit rate, expert and trunk bytes read so far."""
        t, tr = self.lm.experts.total, self.lm.trunk
        return dict(retention=t.retention / 100.0, true_resident_hit=t.true_hit_rate / 100.0,
                    expert_bytes_read=t.bytes_read,
                    trunk_bytes_read=tr.stored_bytes_read if tr else 0)

    @property
    def peak_measured(self) -> str:
        """How a turn's peak RSS is measured ('VmHWM' or 'samples', telemetry.PeakWindow)."""
        return self._peak.measured if self._peak is not None else "VmHWM"

    def prefill_progress(self, positions: int):
        """Progress of a turn's prompt pass over `positions` positions, to the sink after
        each layer as LoadProgress('prefill'): layer bytes x positions done (a pass split
        at a fork point counts on), elapsed, and an ETA at the rate so far.  None without
        the model's figures (Engine.around)."""
        if self.setup is None:
            return None
        sizes = list(self.setup.figures.layer_sizes[:self.nl])
        total = sum(sizes) * positions
        state = {"t0": time.monotonic(), "done": 0}

        def on_layer(L: int, T: int):
            state["done"] += (sizes[L] if L < len(sizes) else 0) * T
            self.sink(E.LoadProgress("prefill", L, state["done"], total,
                                     *_eta(state["t0"], state["done"], total)))
        return on_layer

    def trunk_notices(self) -> list[E.TrunkNotice]:
        """The streamed trunk's notes since the last call (drained on the thread that runs
        the model, so a sink is never called from a reader thread)."""
        tr = self.lm.trunk if self.lm is not None else None
        return [E.TrunkNotice(m, w) for m, w in tr.drain_notes()] if tr is not None else []

    def expert_heat(self):
        """Requests per (layer, expert) so far, [layers, experts] (running counts)."""
        trace = getattr(self.lm.experts, "trace", None)
        return None if trace is None else trace.counts_grid()

    def kept_trace(self) -> tuple[list, int] | None:
        """(the kept expert requests as (layer, expert) pairs in order, requests made in
        all) of a trace this engine keeps (LoadSpec.keep_trace / trace_window), or None."""
        trace = getattr(self.lm.experts, "trace", None) if self.lm is not None else None
        if trace is None or not trace.kept:
            return None
        return trace.kept_pairs(), trace.requests

    def tables_read(self) -> tuple[int, int, int, float]:
        """(total, embedding, lm_head) bytes and seconds the streamed model tables read."""
        st = self.lm.table_stream
        if st is None:
            return 0, 0, 0, 0.0
        return st.embedding_bytes + st.lm_head_bytes, st.embedding_bytes, st.lm_head_bytes, \
            st.read_seconds

    def io_seconds(self) -> tuple[float, float, float]:
        """Whole-run (trunk, experts, model tables) read seconds."""
        lm = self.lm
        return (lm.trunk.read_seconds if lm.trunk else 0.0, lm.experts.total.load_seconds,
                self.tables_read()[3])

    def out_values(self, res: TurnSummary, seq: Sequence, prompt_ids: list[int],
                   text: bytes | None) -> dict:
        """A batch run's result figures in the reference's --out order (SYSTEM §6.7)."""
        lm = self.lm
        tr = lm.trunk
        _, embed_bytes, head_bytes, _ = self.tables_read()
        n = len(res.ids)
        prior = seq.ids[:len(seq.ids) - len(prompt_ids) - n]
        return dict(prompt_ids=prompt_ids, generated_ids=res.ids,
                    full_ids=prior + prompt_ids + res.ids, layers=self.nl,
                    layers_requested=self.nl, layers_completed=res.layers_completed,
                    expert_drops=lm.experts.drops, peak_rss_bytes=peak_rss_bytes(),
                    wall_seconds=res.seconds,
                    seconds_per_token=res.seconds / n if n else 0.0,
                    expert_bytes_read=lm.experts.total.bytes_read,
                    trunk_bytes_read=tr.stored_bytes_read if tr else 0,
                    embedding_bytes_read=embed_bytes, lm_head_bytes_read=head_bytes,
                    ultra_low_memory=lm.ultra,
                    stopped_at=res.end_id if res.end_id is not None else -1,
                    interrupted=res.interrupted, generated_text=text)

    def lookahead_keys(self) -> dict:
        """The SF extension keys of --out for lookahead expert reads (whole run), when they
        ran: reads started, taken by a real miss, wasted, their bytes, the guess's recall."""
        ahead = getattr(self.lm.experts, "ahead", None)
        if ahead is None:
            return {}
        t = self.lm.experts.total
        return dict(lookahead_predicted=t.la_predicted, lookahead_useful=t.la_useful,
                    lookahead_wasted=t.la_wasted, lookahead_bytes=t.la_bytes,
                    lookahead_wasted_bytes=t.la_wasted_bytes,
                    lookahead_recall=round(t.la_recall, 4))

    def spec_keys(self, spec: GenSpec, res: TurnSummary) -> dict:
        """The SF extension keys of --out for speculative and hybrid decode (readers ignore
        unknown keys, SYSTEM §6.7)."""
        if not spec.spec:
            return {}
        sp = res.spec
        keys = dict(spec_rounds=sp.rounds, spec_drafted=sp.drafted, spec_accepted=sp.accepted)
        if self.drafter is not None:          # accepted drafts per verification pass
            keys.update(spec_mean_accepted=round(sp.mean_run, 4),
                        draft_model=self.spec.drafter_dir,
                        drafter_seconds=round(self.drafter.seconds, 4),
                        drafter_passes=self.drafter.passes)
        d = self.spec.draft
        if self.draft is not None:
            keys.update(draft_trunk=d.trunk_dir, draft_trunk_gb=d.trunk_gb,
                        draft_topk=self.draft.model.router.k, draft_cache_only=d.cache_only,
                        draft_seconds=round(self.draft.seconds, 4),
                        draft_forwards=self.draft.steps,
                        draft_trunk_bytes_read=self.draft.trunk.bytes_read)
        if spec.spec_auto:
            keys.update(spec_auto=True, spec_auto_final_width=sp.width,
                        spec_auto_mean_width=round(sp.width_sum / max(sp.rounds, 1), 4))
        return keys

    def decode_started(self, spec: GenSpec, positions: int, resumed=None) -> E.DecodeStarted:
        """The batch report's decode header (KV size, speculation, the draft)."""
        cfg = self.cfg
        n_mla = sum(cfg.is_mla(L) for L in range(self.nl))
        per_pos = 4 * sum(cfg.n_heads * (cfg.qk_nope + cfg.v_head) + cfg.qk_rope
                          for L in range(self.nl) if cfg.is_mla(L))
        d = self.spec.draft
        return E.DecodeStarted(self.incremental, per_pos * positions, n_mla, positions,
                               resumed, min(spec.spec, MAX_DRAFT), spec.spec_auto,
                               None if self.draft is None else dict(
                                   trunk=d.trunk_dir, gb=d.trunk_gb,
                                   topk=self.draft.model.router.k, cache_only=d.cache_only),
                               None if self.drafter is None else dict(
                                   folder=self.spec.drafter_dir,
                                   block=self.drafter.config.block_size,
                                   layers=self.drafter.config.target_layers))

