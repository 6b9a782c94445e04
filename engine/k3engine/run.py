"""The run API: the one way a front end (k3, the chat REPL, K3 Studio's worker, k3 serve)
runs the engine.

    request_from(...) -> RunRequest      presets, budgets and defaults applied once
    open_run(request, sink) -> Run       open, plan, refusals, tokenizer, load (as events)
    run.generate(cancel)                 batch decode: yields StepDone / TokenOut / Finished
    run.chat(history, ...).turn(...)     one chat turn: yields TokenOut / StepDone / TurnEnded

Layering: front ends -> run -> session/model/residency/text -> formats/kernels.  Every
figure a front end shows is computed here once (measure_step, summary_values); no front end
reads the cache's or the trunk's counters itself.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Iterable, Iterator, Sequence

from . import events as E
from .errors import PlanRefused, StateUnusable, UsageError
from .ids import parse_ids, read_ids_file
from .inputfile import InputFileError, read_regular_file
from .memory import (AUTO, DEFAULT_DRAFT_TRUNK_GB, PRESETS, Budgets, Plan, PlanRequest,
                     available_memory, plan_for, resolve_budgets)
from .session import (MAX_GEN, MAX_POSITIONS, MAX_PROMPT, Cancel, RunResult, default_threads,
                      generate_steps, load_draft, load_model, open_model, read_config,
                      set_threads)
from .speculative import MAX_DRAFT
from .telemetry import peak_rss_bytes, rss_bytes

__all__ = ["RunRequest", "Prompt", "Sampling", "Draft", "request_from", "open_run", "Run",
           "summary_values", "spec_keys", "io_seconds", "tables_read", "chat_controls", "Cancel", "MAX_GEN", "MAX_POSITIONS", "MAX_PROMPT"]


PROMPT_FILE_LIMIT = 1 << 30     # --prompt-file: the file's bytes verbatim, at most 1 GiB


@dataclass(frozen=True)
class Prompt:
    """Exactly one of: ids (or their text, as --ids gives it), an ids file, text (added
    tokens recognised), a text file."""
    ids: tuple[int, ...] | None = None
    ids_text: str | None = None
    ids_file: str | None = None
    text: str | None = None
    text_file: str | None = None


@dataclass(frozen=True)
class Sampling:
    """None = the §9.5 default; any of the four given switches sampling on (--greedy wins)."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    greedy: bool = False

    def sampler(self):
        from .sampler import Sampler
        return Sampler.from_flags(temperature=self.temperature, top_p=self.top_p,
                                  top_k=self.top_k, seed=self.seed, greedy=self.greedy)


@dataclass(frozen=True)
class Draft:
    """Hybrid decode's draft model (--draft-trunk and its options)."""
    trunk_dir: str
    trunk_gb: float = DEFAULT_DRAFT_TRUNK_GB
    topk: int | None = None           # None: min(4, the model's top-k)
    cache_only: bool = False


@dataclass(frozen=True)
class RunRequest:
    """Everything a run asks of the engine.  Built only by `request_from`, so a CLI flag and
    an app setting cannot mean different things."""
    model_dir: str
    budgets: Budgets = Budgets()
    trunk_dir: str | None = None
    tok_dir: str | None = None
    config_path: str | None = None
    trunk_ring: int = 2
    threads: int = 0                  # 0: OMP_NUM_THREADS, else physical cores
    layers: int | None = None         # --layers: bind only the first N
    incremental: bool = False
    chat: bool = False
    gen: int = 8
    stop_ids: tuple[int, ...] = ()
    prompt: Prompt | None = None
    sampling: Sampling = Sampling()
    thinking: bool = True
    effort: str = "max"
    spec: int = 0
    spec_auto: bool = False
    draft: Draft | None = None
    load_state: str | None = None
    save_state: str | None = None
    keep_trace: bool = False          # keep every expert request (--dump-cache-trace)
    trace_window: int = 0             # ...only the latest N of them (the app's session trace)
    cache_policy: str | None = None   # "lru" / "s3fifo"; None: K3_CACHE_POLICY, else LRU
    # the app's process baseline (SYSTEM §5.8) and a fixed availability for tests
    baseline_bytes: int = 0
    baseline_label: str = "python baseline"
    available_override: int | None = None
    total_memory: int = 0

    @property
    def streamed(self) -> bool:
        return bool(self.trunk_dir)

    def plan_request(self, positions: int, layers: int | None = None,
                     draft_sizes: Sequence[int] | None = None) -> PlanRequest:
        return PlanRequest(budgets=self.budgets, trunk_ring=self.trunk_ring,
                           streamed=self.streamed, incremental=self.incremental or self.chat,
                           positions=positions, layers=layers, baseline_bytes=self.baseline_bytes,
                           baseline_label=self.baseline_label, draft_sizes=draft_sizes,
                           draft_gb=self.draft.trunk_gb if self.draft else DEFAULT_DRAFT_TRUNK_GB,
                           spec=min(self.spec, MAX_DRAFT), keep_trace=self.keep_trace,
                           trace_window=self.trace_window)


def request_from(model_dir: str, memory: Iterable[tuple[str, object]] = (), **fields
                 ) -> RunRequest:
    """The RunRequest for `model_dir`, with the memory flags applied in argv order
    (`[("--preset", "laptop")]`, `[("--trunk-gb", 3), ("--cache-gb", 1)]`, ...) exactly as
    `k3` applies them (memory.resolve_budgets), and the other fields as given.  Raises
    BudgetError (exit 2) for a budget that cannot run."""
    req = RunRequest(model_dir=model_dir, budgets=resolve_budgets(memory), **fields)
    if req.chat and not req.incremental:
        req = replace(req, incremental=True)          # chat turns always carry state
    return req


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


def _draft_topk(req: RunRequest, cfg) -> int:
    from .draft import DEFAULT_DRAFT_TOPK
    if req.draft is None or req.draft.topk is None:
        return min(DEFAULT_DRAFT_TOPK, cfg.topk)
    return req.draft.topk


def open_run(req: RunRequest, sink: E.Sink | None = None, tok=None) -> "Run":
    """Threads, config, tokenizer, prompt, limits, index, plan (refusals), then the model,
    in the order the reference reports them; each stage is an event to `sink`.  `tok` is a
    tokenizer the caller already loaded from req.tok_dir (the chat REPL needs it before the
    model).  Raises an EngineError (errors.describe gives its exit code and message)."""
    sink = sink or (lambda ev: None)
    threads = req.threads or default_threads()
    set_threads(threads)
    sink(E.ThreadsSet(threads))
    cfg, cfg_path = read_config(req.model_dir, req.config_path)
    nl = cfg.n_layers if req.layers is None else req.layers
    if not 1 <= nl <= cfg.n_layers:
        raise UsageError(f"--layers {nl} is out of range (1..{cfg.n_layers})")
    sink(E.ConfigRead(cfg, cfg_path, nl))
    if tok is None and req.tok_dir:
        from .tokenizer import Tokenizer
        tok = Tokenizer.from_dir(req.tok_dir)             # failures exit 1 (SYSTEM §6.5)
    if tok is not None:
        sink(E.TokenizerLoaded(tok.report_line()))
    ids = read_prompt(req.prompt, tok, sink) if req.prompt is not None else []
    if len(ids) > MAX_PROMPT:
        raise UsageError(f"prompt has {len(ids)} ids; the limit is {MAX_PROMPT} (refused, "
                         f"never truncated)")
    for i in list(ids) + list(req.stop_ids):
        if i >= cfg.vocab:
            raise UsageError(f"token id {i} is outside the vocabulary of {cfg.vocab}")
    draft_topk = _draft_topk(req, cfg)
    if req.draft is not None and draft_topk > cfg.topk:
        raise UsageError(f"--draft-topk {draft_topk} exceeds the model's top-{cfg.topk}")
    n_prior = 0
    if req.load_state:
        from .statefile import peek_state
        n_prior = peek_state(req.load_state).nseq      # sized now, restored after the load
    positions = n_prior + len(ids) + req.gen + 1
    if positions > MAX_POSITIONS:
        raise UsageError(f"prompt {n_prior + len(ids)} + gen {req.gen} + 1 exceeds the "
                         f"{MAX_POSITIONS}-position ceiling")
    sink(E.RunHeader(req.model_dir, None if req.chat else len(ids), req.gen))

    setup = open_model(req.model_dir, cfg, nl, req.trunk_dir,
                       req.draft.trunk_dir if req.draft else None)
    try:
        sink(E.Indexed(len(setup.ck), len(setup.ck.shards), setup.index_seconds,
                       tuple(setup.ck.notes)))
        if req.available_override is not None:
            available, total = int(req.available_override), req.total_memory
        else:
            _, available = available_memory()
            total = req.total_memory
        the_plan = plan_for(setup.figures, req.plan_request(positions, nl, setup.draft_sizes),
                            available, total)
        sink(E.Planned(the_plan, req.trunk_dir,
                       setup.manifest.total_bytes() if setup.manifest else 0))
        if the_plan.refusals:
            raise PlanRefused(the_plan)
        run = Run(req, cfg, nl, tok, ids, setup, the_plan, positions, n_prior, sink, threads)
        run._load(draft_topk)
    except BaseException:
        setup.ck.close()
        raise
    return run


# ---------------------------------------------------------------------------- the run

class Run:
    """A loaded model with its plan, ready to generate; `close()` releases it."""

    def __init__(self, req: RunRequest, cfg, nl: int, tok, ids: list[int], setup,
                 the_plan: Plan, positions: int, n_prior: int, sink: E.Sink, threads: int):
        self.req, self.cfg, self.nl, self.tok, self.ids = req, cfg, nl, tok, ids
        self.setup, self.plan, self.positions, self.n_prior = setup, the_plan, positions, n_prior
        self.sink = sink
        self.lm = None
        self.draft = None
        self.ctl = None
        self.threads = threads
        self._trunk_mark = (0, 0.0, 0)

    # -- loading -------------------------------------------------------------------
    def _load(self, draft_topk: int) -> None:
        req, setup, the_plan, sink = self.req, self.setup, self.plan, self.sink
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
                        keep_trace=req.keep_trace, trace_window=req.trace_window,
                        cache_policy=req.cache_policy)
        self.lm = lm
        tr = lm.trunk
        one_slot = lm.ultra and not req.incremental
        sink(E.Loaded(
            streamed=tr is not None, trunk_dir=req.trunk_dir, direct=bool(tr and tr.direct),
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
        if req.draft is not None:
            self.draft = load_draft(lm, setup, the_plan, self.positions, draft_topk,
                                    req.draft.cache_only)
            dm, dt = setup.draft_manifest, self.draft.trunk
            sink(E.DraftLoaded(dm.total_bytes(), dm.draft["bits"] if dm.draft else None,
                               len(dt.pinned), self.nl, dt.nslot))

    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()
            self.draft = None
        if self.lm is not None:
            self.lm.close()
            self.lm = None

    def trunk_notices(self) -> list[E.TrunkNotice]:
        """The streamed trunk's notes since the last call (drained on the thread that runs
        the model, so a sink is never called from a reader thread)."""
        tr = self.lm.trunk if self.lm is not None else None
        return [E.TrunkNotice(m, w) for m, w in tr.drain_notes()] if tr is not None else []

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
            io_expert_share=ex.load_seconds / seconds if seconds > 0 else 0.0)
        self._trunk_mark = mark
        return tel

    def _io_counters(self) -> tuple[int, float, int]:
        """(trunk bytes from the disk, trunk read seconds, model-table bytes) so far: a
        compressed trunk counts its stored bytes, not the layers decoded from them."""
        tr = self.lm.trunk
        return ((tr.stored_bytes_read, tr.read_seconds) if tr else (0, 0.0)) \
            + (tables_read(self.lm)[0],)

    def expert_heat(self):
        """Requests per (layer, expert) so far, [layers, experts] (running counts)."""
        trace = getattr(self.lm.experts, "trace", None)
        return None if trace is None else trace.counts_grid()

    # -- batch generation ------------------------------------------------------------
    def generate(self, cancel: Cancel | None = None, stop_in_pass: bool = False, *,
                 ids: list[int] | None = None, gen: int | None = None, sampler=None,
                 stop_ids: tuple[int, ...] | None = None, carried=None
                 ) -> Iterator[E.Event]:
        """The batch decode loop (SYSTEM §6.4) as events: DecodeStarted, then per step
        StepDone and one TokenOut per id, then Finished(RunResult).  `stop_in_pass` also
        honours `cancel` between the layers of the prompt pass (session.generate_steps).

        A caller serving many prompts on one run (k3 serve) overrides the request's `ids`,
        `gen`, `sampler` and `stop_ids`, and continues a kept state with
        `carried=(state, ids it was fed)` (the state grown for the new positions)."""
        req, lm = self.req, self.lm
        ids = self.ids if ids is None else ids
        gen = req.gen if gen is None else gen
        stop_ids = req.stop_ids if stop_ids is None else stop_ids
        state, prior, resumed = None, [], None
        if carried is not None:
            state, prior = carried
        elif req.load_state:
            from .statefile import load_state
            t0 = time.monotonic()
            state = lm.model.new_state(self.n_prior + len(ids) + gen + 1)
            prior = load_state(req.load_state, state)
            resumed = E.Resumed(req.load_state, state.n_cached, len(ids),
                                time.monotonic() - t0)
        cfg = self.cfg
        n_mla = sum(cfg.is_mla(L) for L in range(self.nl))
        per_pos = 4 * sum(cfg.n_heads * (cfg.qk_nope + cfg.v_head) + cfg.qk_rope
                          for L in range(self.nl) if cfg.is_mla(L))
        positions = len(prior) + len(ids) + gen + 1
        d = req.draft
        yield E.DecodeStarted(req.incremental, per_pos * positions, n_mla, positions, resumed,
                              min(req.spec, MAX_DRAFT), req.spec_auto,
                              None if self.draft is None else dict(
                                  trunk=d.trunk_dir, gb=d.trunk_gb,
                                  topk=self.draft.model.router.k, cache_only=d.cache_only))
        from .tokenizer import StreamDecoder
        stream = StreamDecoder(self.tok) if self.tok else None
        sampler = sampler or req.sampling.sampler()
        sampler.new_turn(1)                      # batch mode: one stream, turn 1
        steps = generate_steps(lm, ids, gen, req.incremental, stop_ids, sampler,
                               cancel, state, prior,
                               on_step_start=lambda g: lm.experts.reset_step(),
                               spec=req.spec, proposer=self.draft, spec_auto=req.spec_auto,
                               stop_in_pass=stop_in_pass)
        while True:
            try:
                s = next(steps)
            except StopIteration as stop:
                res = stop.value
                break
            yield E.StepDone(s.step, tuple(s.ids), s.seconds, self.measure_step(s.seconds),
                             s.logits)
            yield from self.trunk_notices()
            for i in s.ids:
                yield E.TokenOut(i, stream.push(i) if stream else "", "text")
        yield E.Finished(res)

    def save_state(self, path: str, res: RunResult) -> int:
        """--save-state: refused for a state a failed or stopped pass left half advanced
        (SYSTEM §4.9: nothing is saved after exit 4)."""
        from .statefile import save_state
        if res.state is None or res.state.poisoned:
            raise StateUnusable(f"{path}: not written: "
                                f"{res.state.poisoned if res.state else 'no state'}")
        return save_state(path, res.state, res.full_ids)

    # -- chat ---------------------------------------------------------------------------
    def chat(self, history, sampler=None):
        """A ChatSession on this run's model (refuses when the tokenizer lacks the chat's
        control tokens: exit 2)."""
        from .chat import ChatOptions
        from .session import ChatSession
        self.ctl = self.ctl or chat_controls(self.tok)
        opts = ChatOptions(thinking=self.req.thinking, effort=self.req.effort)
        return ChatSession(self.lm, self.tok, self.ctl, history, opts,
                           sampler or self.req.sampling.sampler(), incremental=True)

    def turn(self, chat, gen: int | None = None, cancel: Cancel | None = None,
             resume: bool = False) -> Iterator[E.Event]:
        """One chat turn as events: TurnStarted, LoadProgress('prefill') per layer of the
        prompt pass, then per token StepDone and TokenOut (phase from the streaming reply
        parser), then TurnEnded(TurnResult).  A stop during the prefill ends the turn with
        no tokens (the state it left is not reused).  resume=True continues the session's
        incomplete reply (ChatSession.continue_steps) for up to `gen` more ids: no prefill,
        steps numbered on from the reply's ids."""
        from .chat import ReplyStream
        gen = self.req.gen if gen is None else gen
        lm = self.lm
        parser = ReplyStream(self.tok, chat.ctl, chat.opts.thinking)
        if resume and chat.pending is not None:
            for tok_id in chat.pending.ids:     # the parser picks up the reply's phase
                parser.push(tok_id)
        self._trunk_mark = self._io_counters()
        lm.experts.reset_step()
        t_last = [time.monotonic()]
        progress = self._prefill_layer_cb()
        turn = (chat.continue_steps(gen, cancel) if resume else
                chat.turn_steps(gen, cancel, on_layer=lambda L, T: self.sink(progress(L, T))))
        while True:
            try:
                kind, value = next(turn)
            except StopIteration as stop:
                res = stop.value
                break
            if kind == "prefill":
                yield E.TurnStarted(value, -1, gen)
                continue
            i, tok_id = value
            now = time.monotonic()
            secs, t_last[0] = now - t_last[0], now
            yield E.StepDone(i - 1, (tok_id,), secs, self.measure_step(secs))
            yield from self.trunk_notices()
            lm.experts.reset_step()
            phase, text = parser.push(tok_id)
            yield E.TokenOut(tok_id, text, phase)
        tail = parser.flush()
        if tail:
            yield E.TokenOut(-1, tail, parser.phase)
        yield E.TurnEnded(res)

    def _prefill_layer_cb(self):
        """Per-layer progress of a prompt pass (elapsed and an ETA from the layers done)."""
        fig = self.setup.figures
        sizes = list(fig.layer_sizes[:self.nl])
        total = sum(sizes)
        state = {"t0": None, "done": 0}

        def on_layer(L: int, T: int):
            if state["t0"] is None:
                state["t0"] = time.monotonic()
                state["done"] = 0
            state["done"] += sizes[L] if L < len(sizes) else 0
            progress = E.LoadProgress("prefill", L, state["done"], total,
                                      *_eta(state["t0"], state["done"], total))
            if L == self.nl - 1:
                state["t0"] = None
            return progress
        return on_layer


def _eta(t0: float, done: int, total: int) -> tuple[float, float | None]:
    """(elapsed, seconds left at the rate so far) of a phase that started at t0."""
    elapsed = time.monotonic() - t0
    frac = done / total if total else 1.0
    return elapsed, (elapsed * (1 - frac) / frac if frac > 0 else None)


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


def tables_read(lm) -> tuple[int, int, int, float]:
    """(total, embedding, lm_head) bytes and seconds the streamed model tables read."""
    st = lm.table_stream
    if st is None:
        return 0, 0, 0, 0.0
    return st.embedding_bytes + st.lm_head_bytes, st.embedding_bytes, st.lm_head_bytes, \
        st.read_seconds


def summary_values(run: Run, res: RunResult, text: bytes | None) -> dict:
    """The batch run's result figures in the reference's --out order (SYSTEM §6.7)."""
    lm = run.lm
    tr = lm.trunk
    _, embed_bytes, head_bytes, _ = tables_read(lm)
    n = len(res.generated_ids)
    return dict(prompt_ids=res.prompt_ids, generated_ids=res.generated_ids,
                full_ids=res.full_ids, layers=run.nl, layers_requested=run.nl,
                layers_completed=res.layers_completed, expert_drops=lm.experts.drops,
                peak_rss_bytes=peak_rss_bytes(), wall_seconds=res.wall_seconds,
                seconds_per_token=res.wall_seconds / n if n else 0.0,
                expert_bytes_read=lm.experts.total.bytes_read,
                trunk_bytes_read=tr.stored_bytes_read if tr else 0,
                embedding_bytes_read=embed_bytes, lm_head_bytes_read=head_bytes,
                ultra_low_memory=lm.ultra, stopped_at=res.stopped_at,
                interrupted=res.interrupted, generated_text=text)


def io_seconds(run: Run) -> tuple[float, float, float]:
    """Whole-run (trunk, experts, model tables) read seconds."""
    lm = run.lm
    return (lm.trunk.read_seconds if lm.trunk else 0.0, lm.experts.total.load_seconds,
            tables_read(lm)[3])


def spec_keys(run: Run, res: RunResult) -> dict:
    """The SF extension keys of --out for speculative and hybrid decode (readers ignore
    unknown keys, SYSTEM §6.7)."""
    req = run.req
    if not req.spec:
        return {}
    sp = res.spec
    keys = dict(spec_rounds=sp.rounds, spec_drafted=sp.drafted, spec_accepted=sp.accepted)
    if run.draft is not None:
        keys.update(draft_trunk=req.draft.trunk_dir, draft_trunk_gb=req.draft.trunk_gb,
                    draft_topk=run.draft.model.router.k, draft_cache_only=req.draft.cache_only,
                    draft_seconds=round(run.draft.seconds, 4), draft_forwards=run.draft.steps,
                    draft_trunk_bytes_read=run.draft.trunk.bytes_read)
    if req.spec_auto:
        keys.update(spec_auto=True, spec_auto_final_width=sp.width,
                    spec_auto_mean_width=round(sp.width_sum / max(sp.rounds, 1), 4))
    return keys
