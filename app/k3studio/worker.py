"""The engine on ONE QThread (SYSTEM §12.1; GPT4All's model-on-its-worker).

`EngineWorker` lives on the engine thread and owns everything of the engine: the loaded
`Engine` and the `Conversation` on it (history, the sequence whose state the next turn
reuses, the incomplete reply) -- both Qt-free, in the engine package.  Widgets never touch these; they send requests through `EngineHost` (which
lives on the GUI thread) and observe plain-value signals.

Telemetry is coalesced, never queued without bound: per-token records go into a mailbox and
the GUI is notified only when the mailbox goes from empty to non-empty; it drains everything
in one go.  A slow GUI therefore gets fewer, larger batches, while the engine never waits on
it.  Progress and the expert heat map are "latest value wins" mailboxes.

Stop is the engine's `Cancel` flag, set directly from the GUI thread and honoured after the
token in flight (a safe point).  Errors become an `errored` signal carrying the exit code,
the error class and the same message text the CLI prints; the worker then returns to its
idle state, so the app stays usable.
"""
from __future__ import annotations

import threading
import time
import traceback

from PySide6.QtCore import QMetaObject, QObject, Qt, QThread, Signal, Slot

from k3engine.conversation import Conversation
from k3engine.errors import EXIT_MEANING, EXIT_RUNTIME, EXIT_USAGE, EngineError

from .runspec import RunSpec, command_line

HEAT_EVERY = 8                # tokens between expert heat-map refreshes


# --------------------------------------------------------------------------- mailboxes

class Mailbox:
    """Thread-safe hand-off from the engine thread to the GUI.  `put` returns True when
    the consumer should be woken (the box was empty); `take` drains it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._items: list = []

    def put(self, item) -> bool:
        with self._lock:
            self._items.append(item)
            return len(self._items) == 1

    def take(self) -> list:
        with self._lock:
            items, self._items = self._items, []
            return items


class Latest:
    """Holds only the newest value: stale progress and heat maps are dropped."""

    def __init__(self):
        self._lock = threading.Lock()
        self._value = None
        self._fresh = False

    def put(self, value) -> bool:
        with self._lock:
            wake = not self._fresh
            self._value, self._fresh = value, True
            return wake

    def take(self):
        with self._lock:
            v, self._fresh = self._value, False
            self._value = None
            return v


# --------------------------------------------------------------------------- errors

def describe_error(e: BaseException) -> dict:
    """(code, kind, message) exactly as `k3` reports the same failure (errors.describe).
    Unknown exceptions are reported as runtime failures with their class."""
    from k3engine.errors import describe
    known = describe(e)
    if known is not None:
        code, kind, message = known
        return dict(code=code, kind=kind, message=message)
    kind = type(e).__name__
    return dict(code=EXIT_RUNTIME, kind=kind, message=f"k3: internal error: {kind}: {e}")


class ChatRefusal(EngineError):
    """A chat refusal with the exit code the CLI would use."""
    prefix = "chat"

    def __init__(self, message: str, code: int = EXIT_RUNTIME):
        super().__init__(message)
        self.exit_code = code


# --------------------------------------------------------------------------- the worker

class EngineWorker(QObject):
    """Runs on the engine thread: a thin Qt shell around the engine's Qt-free objects (the
    Engine and a Conversation on it).  Every slot catches its own errors."""

    busyChanged = Signal(bool)
    status = Signal(str)
    planned = Signal(object)          # the plan event (memory.Plan.as_event()) of a load
    loaded = Signal(object)           # dict: what was loaded and how (trunk map, slots, RSS)
    unloaded = Signal()
    conversation = Signal(object)     # list of {"role","content","reasoning","incomplete"}
    turnStarted = Signal(object)      # dict: prompt size, limit, command line
    recordsReady = Signal()           # per-token records waiting in `records`
    progressReady = Signal()          # newest first-token progress waiting in `progress`
    heatReady = Signal()              # newest expert heat map waiting in `heat`
    turnFinished = Signal(object)     # dict: the turn summary's figures as plain values
    errored = Signal(object)          # dict: code, kind, message, during
    pendingChanged = Signal(object)   # the incomplete last reply (dict) or None

    def __init__(self):
        super().__init__()
        self.records, self.progress, self.heat = Mailbox(), Latest(), Latest()
        self.engine = None                # k3engine.engine.Engine: the loaded model, its plan
        self.spec: RunSpec | None = None
        # the conversation (history, state, incomplete reply), with or without a model
        self.conv = Conversation(None)
        self._in_turn = False             # prefill progress is posted only during a turn
        self._prompt_ids = 0
        self._loaded_event = None
        from k3engine.telemetry import PeakWindow
        self.peak = PeakWindow()          # this model's peak RSS (a reply's: its summary)

    @property
    def history(self):
        return self.conv.history

    # -- helpers ------------------------------------------------------------------
    def _fail(self, e: BaseException, during: str) -> None:
        info = describe_error(e)
        if info["message"].startswith("k3: internal error"):
            traceback.print_exception(e)      # not an engine refusal: keep the traceback
        info["during"] = during
        info["meaning"] = EXIT_MEANING.get(info["code"], "")
        self.errored.emit(info)

    def _emit_conversation(self) -> None:
        self.conversation.emit(self.conv.messages())
        p = self.conv.pending
        self.pendingChanged.emit(p.as_dict() if p is not None else None)

    def _refuse_turn(self, e: BaseException, during: str) -> None:
        """A turn refused before it started: reported, the transcript re-sent as it is,
        and the turn ends (the panel leaves its generating state)."""
        if type(e).__name__ == "ChatError":
            e = ChatRefusal(str(e), EXIT_USAGE)
        self._fail(e, during)
        self._emit_conversation()
        self.turnFinished.emit({"failed": True, "n": 0})

    # -- model ----------------------------------------------------------------------
    @Slot(object, object, int)
    def load(self, spec: RunSpec, available_override, baseline_bytes: int) -> None:
        """plan -> refusals -> tokenizer -> load, in the CLI's order (open_engine)."""
        self.busyChanged.emit(True)
        try:
            self._unload()
            self._load(spec, available_override, baseline_bytes)
        except BaseException as e:  # noqa: BLE001 - reported, never lost
            self._unload()
            self._fail(e, "load")
        finally:
            self.busyChanged.emit(False)

    def _load(self, spec: RunSpec, available_override, baseline_bytes: int) -> None:
        """open_engine: the same set-up, plan, refusals and load as `k3 --chat`."""
        from k3engine.engine import open_engine
        from k3engine.memory import available_memory, human
        t0 = time.monotonic()
        if available_override is not None:
            available, total = int(available_override), 0
        else:
            _, probe = available_memory()
            available, total = probe.bytes, probe.total or 0
        self.status.emit(f"opening {spec.model_dir}" + (" and checking the packed trunk"
                                                        if spec.trunk_dir else ""))
        self._loaded_event = None
        self.peak.reset()                 # this model's peak, not the previous one's
        eng = open_engine(spec.load_spec(available, baseline_bytes, total), self._on_event,
                          gen=spec.gen)
        try:
            eng.ctl                       # no control tokens: refused (exit 2)
        except BaseException:
            eng.close()
            raise
        self.engine, self.spec = eng, spec
        self._rebind()
        lm, cfg, ev = eng.lm, eng.cfg, self._loaded_event
        info = dict(
            command=command_line(spec), model_dir=spec.model_dir, trunk_dir=spec.trunk_dir,
            n_layers=eng.nl, n_experts=cfg.n_experts,
            moe_layers=[L for L in range(eng.nl) if not cfg.is_dense(L)],
            layer_kinds=["MLA" if cfg.is_mla(L) else "KDA" for L in range(eng.nl)],
            streamed=ev.streamed, pinned_layers=list(ev.pinned_layers),
            ring_slots=ev.ring_slots, slot_bytes=ev.slot_bytes,
            trunk_total_bytes=sum(eng.setup.figures.layer_sizes[:eng.nl]),
            expert_slots=ev.expert_slots, expert_slot_bytes=ev.expert_slot_bytes,
            cache_line=ev.cache_line, plan_lines=eng.plan.lines(),
            plan_total=eng.plan.total_bytes, available=eng.plan.available_bytes,
            peak_rss_after_load=self.peak.sample(), peak_measured=self.peak.measured,
            threads=eng.threads,
            seconds=time.monotonic() - t0, vocab=cfg.vocab, ultra=lm.ultra,
            streamed_tables=lm.table_stream is not None)
        self.status.emit(f"loaded in {info['seconds']:.1f} s; peak RSS after loading weights "
                         f"{human(info['peak_rss_after_load'])}")
        self.loaded.emit(info)

    def _on_event(self, ev) -> None:
        """The engine's set-up and progress events (engine thread)."""
        from k3engine import events as E
        if isinstance(ev, E.Planned):
            self.planned.emit(ev.plan.as_event())
        elif isinstance(ev, E.Loaded):
            self._loaded_event = ev
        elif isinstance(ev, E.Indexed):
            self.status.emit("planning memory")
        elif isinstance(ev, E.TrunkNotice):   # which trunk file is read; damage -> plain reads
            self.status.emit(("warning: " if ev.warning else "") + ev.message)
        elif isinstance(ev, E.LoadProgress) and ev.phase == "prefill" and self._in_turn:
            if self.progress.put(dict(phase="prefill", layers=ev.layer + 1,
                                      n_layers=self.engine.nl if self.engine else 0,
                                      done_bytes=ev.done_bytes, total_bytes=ev.total_bytes,
                                      elapsed_s=ev.elapsed_s, eta_s=ev.eta_s,
                                      prompt_ids=self._prompt_ids)):
                self.progressReady.emit()

    def _unload(self) -> None:
        had = self.engine is not None
        if self.engine is not None:
            try:
                self.engine.close()
            finally:
                self.engine = None
        self._rebind()
        if had:
            self.unloaded.emit()

    @Slot()
    def unload(self) -> None:
        try:
            self._unload()
        except BaseException as e:  # noqa: BLE001
            self._fail(e, "unload")

    # -- conversation (works with or without a model) ----------------------------------
    def _edit_conversation(self, during: str, change) -> None:
        """Apply one change to the conversation; a refusal is reported, the transcript
        re-sent either way."""
        try:
            change(self.conv)
        except BaseException as e:  # noqa: BLE001
            if type(e).__name__ == "ChatError":
                e = ChatRefusal(str(e), EXIT_USAGE)
            self._fail(e, during)
        self._emit_conversation()

    @Slot(object)
    def new_conversation(self, system_prompt: str) -> None:
        from k3engine.chat import History, Message
        self._edit_conversation("new conversation", lambda c: self._fresh(
            History([Message("system", system_prompt)] if system_prompt else [])))

    def _rebind(self) -> None:
        """The same transcript on the engine now loaded (or none): a new sequence; an
        incomplete reply stays answerable, and Continue resumes it by one pass over the
        transcript and the reply so far (Conversation.continue_turn)."""
        self._fresh(self.conv.history, self.conv.incomplete, self.conv.pending)

    def _fresh(self, history, incomplete=(), pending=None) -> None:
        """Another transcript: a fresh sequence (the next turn prefills from scratch)."""
        self.conv = Conversation(self.engine, history, incomplete=incomplete)
        self.conv.pending = pending

    @Slot(str, object)
    def open_conversation(self, path: str, extra=None) -> None:
        """`extra`: what the sidecar holds ({"incomplete": last reply or None,
        "incomplete_messages": [indices]}); the engine state of a reply from an earlier
        session (or a crash) is gone: it is shown, answerable, and continued by one pass
        over the transcript and the reply so far when its ids are known."""
        from .conversations import restored
        self._edit_conversation("open conversation",
                                lambda _: self._fresh(*restored(path, extra)))

    @Slot(str)
    def save_conversation(self, path: str) -> None:
        try:
            self.history.save(path)
            self.status.emit(f"saved {len(self.history)} messages to {path}")
        except BaseException as e:  # noqa: BLE001
            self._fail(e, "save conversation")

    @Slot(str)
    def set_system(self, text: str) -> None:
        """Replace (or drop) the system message; the rest of the transcript is kept."""
        self._edit_conversation("system prompt", lambda c: c.set_system(text))

    @Slot()
    def take_back(self) -> None:
        """Remove the last exchange so it can be edited and sent again."""
        self._edit_conversation("edit", lambda c: c.take_back())

    # -- turns ------------------------------------------------------------------------
    @Slot(str, object, object)
    def send(self, text: str, spec: RunSpec, cancel) -> None:
        """Add a user message and answer it.  An incomplete reply it answers joins the
        transcript (marked incomplete); an unanswered user message is replaced."""
        try:
            self.conv.add_user(text)
        except BaseException as e:  # noqa: BLE001
            self._refuse_turn(e, "send")
            return
        self._emit_conversation()
        self._turn(spec, cancel)

    @Slot(object, object)
    def regenerate(self, spec: RunSpec, cancel) -> None:
        """Answer the last user message again (dropping the previous reply, if any)."""
        self.conv.drop_reply()
        self._emit_conversation()
        if not self.history.ends_with_user:
            self._refuse_turn(ChatRefusal("there is no user message to answer", EXIT_USAGE),
                              "regenerate")
            return
        self._turn(spec, cancel)

    @Slot(int, str, object, object)
    def edit(self, index: int, text: str, spec: RunSpec, cancel) -> None:
        """Replace the user message at `index` and answer it: the conversation forks there
        (what came after is dropped) and the state is reused up to it."""
        try:
            self.conv.edit(index, text)
        except BaseException as e:  # noqa: BLE001
            self._refuse_turn(e, "edit")
            return
        self._emit_conversation()
        self._turn(spec, cancel)

    @Slot(object, object)
    def continue_reply(self, spec: RunSpec, cancel) -> None:
        """Resume the incomplete reply from the retained state (exact: the ids of the
        uninterrupted turn) for up to the generation limit more tokens."""
        p = self.conv.pending
        if p is None or not p.continuable:
            self._refuse_turn(ChatRefusal("there is no stopped reply to continue on this "
                                          "model: Regenerate answers the message again",
                                          EXIT_USAGE), "continue")
            return
        self._turn(spec, cancel, resume=True)

    def _turn(self, spec: RunSpec, cancel, resume: bool = False) -> None:
        if self.engine is None:
            self._refuse_turn(ChatRefusal("no model is loaded: load one in Setup first",
                                          EXIT_USAGE), "turn")
            return
        self.busyChanged.emit(True)
        info = {"failed": True, "n": 0}
        try:
            self.spec = spec
            info = self._run_turn(spec, cancel, resume)
        except BaseException as e:  # noqa: BLE001
            # a refusal before the turn (the render, a limit): its message is dropped
            if not resume and type(e).__name__ in ("ChatError", "LimitError") and \
                    self.history.ends_with_user:
                self.history.remove_last()
            if type(e).__name__ == "ChatError":
                e = ChatRefusal(str(e))
            self._fail(e, "turn")
            self._emit_conversation()
        finally:
            self._in_turn = False
            # Idle first, the summary last: whatever reacts to turnFinished (New, Send, a
            # test) must find the engine idle, or a New pressed on it is dropped as "busy"
            # (tests/app/test_app_continue.py caught this as a turn that continued the
            # previous conversation).
            self.busyChanged.emit(False)
            self.turnFinished.emit(info)

    def _run_turn(self, spec: RunSpec, cancel, resume: bool = False) -> dict:
        from k3engine import events as E
        eng, conv, the_plan = self.engine, self.conv, self.engine.plan
        gen = spec.gen_spec()
        prior = conv.pending.as_dict() if resume else None
        turn = conv.continue_turn(gen, cancel) if resume else conv.turn(gen, cancel)
        started = next(turn)                  # refusals (render, limits) raise here
        self.turnStarted.emit(dict(prompt_ids=started.prompt_ids, gen=spec.gen,
                                   command=command_line(spec), thinking=spec.thinking,
                                   t=time.monotonic(), resumed=len(prior["ids"]) if prior else 0,
                                   prior=prior))
        self._prompt_ids, self._in_turn = started.prompt_ids, not resume
        heat_n = 0
        res, tail, step = None, "", None
        for ev in turn:
            if isinstance(ev, E.StepDone):
                self._in_turn = False      # the first token is out: prefill is over
                step = ev
            elif isinstance(ev, E.TokenOut):
                if ev.id < 0:              # the parser's held-back tail
                    tail = ev.text
                    continue
                t = step.telemetry
                rec = dict(i=step.step + 1, id=ev.id, text_delta=ev.text, phase=ev.phase,
                           step=step.step, seconds=step.seconds,
                           **{k: getattr(t, k) for k in t.EVENT_KEYS},
                           retention=t.retention_rate / 100.0, raw_hit=t.raw_hit_rate / 100.0,
                           io_trunk_share=t.io_trunk_share, io_expert_share=t.io_expert_share,
                           plan_total=the_plan.total_bytes, available=the_plan.available_bytes)
                if self.records.put(rec):
                    self.recordsReady.emit()
                heat_n += 1
                if heat_n % HEAT_EVERY == 0:
                    self._post_heat()
            elif isinstance(ev, E.TrunkNotice):
                self._on_event(ev)
            elif isinstance(ev, E.TurnEnded):
                res = ev.result
        self._post_heat()
        if res.malformed is not None:
            raise ChatRefusal(f"malformed assistant turn: {res.malformed}")
        self._emit_conversation()
        return turn_info(res, spec, eng, tail)

    def _post_heat(self) -> None:
        """Requests per (layer, expert) so far: the trace's running counts, O(layers x
        experts) however long the session (no pass over the requests)."""
        grid = self.engine.expert_heat() if self.engine is not None else None
        if grid is not None and self.heat.put(grid):
            self.heatReady.emit()

    @Slot()
    def emit_conversation(self) -> None:
        self._emit_conversation()


def turn_info(res, spec: RunSpec, eng, tail: str = "") -> dict:
    """A finished turn for the panels: the engine's TurnSummary as plain values (its
    figures(), the same the REPL and the server show), the engine's session figures, and
    what the panels label it with."""
    n = res.new_ids
    return dict(
        res.figures(), **eng.session_figures(), failed=False, n=n, ids=list(res.ids),
        prompt_ids=res.prompt_positions, reused=res.reused, continued=res.continued,
        read_bytes=res.bytes_read, peak_measured=eng.peak_measured,
        first_token_seconds=res.first_token_seconds,
        s_per_token=res.seconds / n if n else 0.0,
        decode_s_per_token=res.decode_s_per_token or 0.0,
        tokens_per_s=res.decode_tokens_per_s,
        prefill_positions_per_s=res.prefill_positions_per_s,
        end_id=res.end_id, end_name=res.end_name, interrupted=res.interrupted,
        reasoning=res.reasoning, content=res.content, tail=tail, gen=spec.gen,
        thinking=spec.thinking, plan_total=eng.plan.total_bytes,
        available=eng.plan.available_bytes)


# --------------------------------------------------------------------------- GUI side

class EngineHost(QObject):
    """The GUI thread's handle on the engine thread: forwards requests as queued signals,
    drains the worker's mailboxes, and re-emits what it observes for the panels."""

    # requests (queued to the worker)
    _load = Signal(object, object, int)
    _unload = Signal()
    _send = Signal(str, object, object)
    _regenerate = Signal(object, object)
    _new = Signal(object)
    _open = Signal(str, object)
    _save = Signal(str)
    _system = Signal(str)
    _take_back = Signal()
    _conversation = Signal()
    _edit = Signal(int, str, object, object)
    _continue = Signal(object, object)

    # observations (GUI thread)
    busyChanged = Signal(bool)
    status = Signal(str)
    planned = Signal(object)
    loaded = Signal(object)
    unloaded = Signal()
    conversation = Signal(object)
    turnStarted = Signal(object)
    records = Signal(object)          # list of per-token records, in order
    prefillProgress = Signal(object)
    heat = Signal(object)             # ndarray layers x experts
    turnFinished = Signal(object)
    errored = Signal(object)
    pendingChanged = Signal(object)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.busy = False
        self.pending: dict | None = None
        self.loaded_info: dict | None = None
        self.messages: list[dict] = []
        self._cancel = None
        self.thread = QThread()
        self.thread.setObjectName("k3studio-engine")
        self.worker = EngineWorker()
        self.worker.moveToThread(self.thread)
        w = self.worker
        self._load.connect(w.load)
        self._unload.connect(w.unload)
        self._send.connect(w.send)
        self._regenerate.connect(w.regenerate)
        self._new.connect(w.new_conversation)
        self._open.connect(w.open_conversation)
        self._edit.connect(w.edit)
        self._continue.connect(w.continue_reply)
        w.pendingChanged.connect(self._on_pending)
        self._save.connect(w.save_conversation)
        self._system.connect(w.set_system)
        self._take_back.connect(w.take_back)
        self._conversation.connect(w.emit_conversation)
        w.busyChanged.connect(self._on_busy)
        w.status.connect(self.status)
        w.planned.connect(self.planned)
        w.loaded.connect(self._on_loaded)
        w.unloaded.connect(self._on_unloaded)
        w.conversation.connect(self._on_conversation)
        w.turnStarted.connect(self.turnStarted)
        w.recordsReady.connect(self._drain_records)
        w.progressReady.connect(self._drain_progress)
        w.heatReady.connect(self._drain_heat)
        w.turnFinished.connect(self._on_finished)
        w.errored.connect(self.errored)
        self.thread.start()

    # -- requests -------------------------------------------------------------------
    def load(self, spec: RunSpec, available_override: int | None = None,
             baseline_bytes: int = 0) -> None:
        self._load.emit(spec, available_override, int(baseline_bytes))

    def unload(self) -> None:
        self._unload.emit()

    def send(self, text: str, spec: RunSpec) -> None:
        from k3engine.generate import Cancel
        self._cancel = Cancel()
        self._send.emit(text, spec, self._cancel)

    def regenerate(self, spec: RunSpec) -> None:
        from k3engine.generate import Cancel
        self._cancel = Cancel()
        self._regenerate.emit(spec, self._cancel)

    def edit(self, index: int, text: str, spec: RunSpec) -> None:
        from k3engine.generate import Cancel
        self._cancel = Cancel()
        self._edit.emit(index, text, spec, self._cancel)

    def continue_reply(self, spec: RunSpec) -> None:
        from k3engine.generate import Cancel
        self._cancel = Cancel()
        self._continue.emit(spec, self._cancel)

    def stop(self) -> None:
        """Ask the turn in flight to stop after the token being computed (safe point)."""
        if self._cancel is not None:
            self._cancel.set()

    def new_conversation(self, system_prompt: str = "") -> None:
        self._new.emit(system_prompt)

    def open_conversation(self, path: str, extra: dict | None = None) -> None:
        self._open.emit(path, extra)

    def save_conversation(self, path: str) -> None:
        self._save.emit(path)

    def set_system(self, text: str) -> None:
        self._system.emit(text)

    def take_back(self) -> None:
        self._take_back.emit()

    def refresh_conversation(self) -> None:
        self._conversation.emit()

    def shutdown(self, timeout_ms: int = 120000) -> None:
        """Stop at the next safe point, release the model on its own thread, end the
        thread.  Never terminates the thread: the token in flight completes."""
        if not self.thread.isRunning():
            return
        self.stop()
        # blocking: the model's files and reader threads are closed on the engine thread
        # before that thread's event loop ends (a queued request could be dropped by quit)
        QMetaObject.invokeMethod(self.worker, "unload", Qt.BlockingQueuedConnection)
        self.thread.quit()
        self.thread.wait(timeout_ms)

    # -- observations ---------------------------------------------------------------
    @Slot(bool)
    def _on_busy(self, busy: bool) -> None:
        self.busy = busy
        self.busyChanged.emit(busy)

    @Slot(object)
    def _on_loaded(self, info: dict) -> None:
        self.loaded_info = info
        self.loaded.emit(info)

    @Slot()
    def _on_unloaded(self) -> None:
        self.loaded_info = None
        self.unloaded.emit()

    @Slot(object)
    def _on_pending(self, p) -> None:
        self.pending = p
        self.pendingChanged.emit(p)

    @Slot(object)
    def _on_conversation(self, msgs: list) -> None:
        self.messages = msgs
        self.conversation.emit(msgs)

    @Slot()
    def _drain_records(self) -> None:
        items = self.worker.records.take()
        if items:
            self.records.emit(items)

    @Slot()
    def _drain_progress(self) -> None:
        p = self.worker.progress.take()
        if p is not None:
            self.prefillProgress.emit(p)

    @Slot()
    def _drain_heat(self) -> None:
        h = self.worker.heat.take()
        if h is not None:
            self.heat.emit(h)

    @Slot(object)
    def _on_finished(self, info: dict) -> None:
        self._drain_records()            # every token's record lands before the summary
        self._drain_heat()
        self.turnFinished.emit(info)

    @property
    def model_loaded(self) -> bool:
        return self.loaded_info is not None


__all__ = ["EngineWorker", "EngineHost", "describe_error", "Mailbox", "Latest",
           "ChatRefusal", "EXIT_MEANING", "turn_info"]
