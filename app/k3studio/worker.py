"""The engine on ONE QThread (SYSTEM §12.1; GPT4All's model-on-its-worker).

`EngineWorker` lives on the engine thread and owns everything of the engine: the loaded
model, the tokenizer, the conversation (`History`) and the `ChatSession` that reuses state
between turns.  Widgets never touch these; they send requests through `EngineHost` (which
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
from dataclasses import replace

from PySide6.QtCore import QMetaObject, QObject, Qt, QThread, Signal, Slot

from k3engine.errors import EXIT_MEANING, EXIT_RUNTIME, EXIT_USAGE, EngineError
from k3engine.run import MAX_POSITIONS

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


def messages_of(history, incomplete: set[int] = frozenset()) -> list[dict]:
    """Plain message dicts; `incomplete` marks replies that were cut short and answered
    anyway (their index in the history)."""
    return [{"role": m.role, "content": m.content, "reasoning": m.reasoning_content,
             "incomplete": i in incomplete} for i, m in enumerate(history)]


# --------------------------------------------------------------------------- the worker

class EngineWorker(QObject):
    """Runs on the engine thread.  Every slot catches its own errors."""

    busyChanged = Signal(bool)
    status = Signal(str)
    planned = Signal(object)          # the plan event (memory.Plan.as_event()) of a load
    loaded = Signal(object)           # dict: what was loaded and how (trunk map, slots, RSS)
    unloaded = Signal()
    conversation = Signal(object)     # list of {"role","content","reasoning"}
    turnStarted = Signal(object)      # dict: prompt size, limit, command line
    recordsReady = Signal()           # per-token records waiting in `records`
    progressReady = Signal()          # newest first-token progress waiting in `progress`
    heatReady = Signal()              # newest expert heat map waiting in `heat`
    turnFinished = Signal(object)     # dict: TurnResult as plain values + stats
    errored = Signal(object)          # dict: code, kind, message, during
    pendingChanged = Signal(object)   # the incomplete last reply (dict) or None

    def __init__(self):
        super().__init__()
        self.records, self.progress, self.heat = Mailbox(), Latest(), Latest()
        self.run = None                   # k3engine.run.Run: the loaded model and its plan
        self.spec: RunSpec | None = None
        self.available = None
        self.chat = None
        self.sampler = None
        self._sampler_key = None
        from k3engine.chat import History
        self.history = History()
        self._in_turn = False             # prefill progress is posted only during a turn
        self._prompt_ids = 0
        self._loaded_event = None
        from k3engine.telemetry import PeakWindow
        self.peak = PeakWindow()          # this model's / this reply's peak RSS, from the OS
        # The incomplete last reply: {"content", "reasoning", "ids", "why", "continuable"}.
        # It is not in the History (a reference reader must never take it for a turn); once
        # the person answers it, it joins the transcript and its index goes in `incomplete`.
        self.pending: dict | None = None
        self.incomplete: set[int] = set()

    # -- helpers ------------------------------------------------------------------
    def _fail(self, e: BaseException, during: str) -> None:
        info = describe_error(e)
        if info["message"].startswith("k3: internal error"):
            traceback.print_exception(e)      # not an engine refusal: keep the traceback
        info["during"] = during
        info["meaning"] = EXIT_MEANING.get(info["code"], "")
        self.errored.emit(info)

    def _emit_conversation(self) -> None:
        self.conversation.emit(messages_of(self.history, self.incomplete))

    def _set_pending(self, pending: dict | None) -> None:
        self.pending = pending
        self.pendingChanged.emit(dict(pending) if pending else None)

    def _set_history(self, history, incomplete=()) -> None:
        """Another transcript on the same session: the cached state and its fork snapshots
        stay (the next turn reuses what still matches), the sampler's turn index follows
        the new history as a fresh session's would."""
        self.history = history
        self.incomplete = set(incomplete)
        if self.chat is not None:
            self.chat.history = history
            self.chat.turn0, self.chat.turns_done = history.assistant_count(), 0
            self.chat.pending = None
        self._set_pending(None)

    def _commit_pending(self) -> None:
        """The person answers an incomplete reply: it becomes part of the transcript (the
        context of what follows), marked incomplete in the sidecar."""
        from k3engine.chat import Message
        p = self.pending
        if p is None or not self.history.ends_with_user:
            return
        self.history.add(Message("assistant", p["content"],
                                 p["reasoning"] if p.get("reasoning") is not None else None))
        self.incomplete.add(len(self.history) - 1)
        if self.chat is not None:
            self.chat.pending = None
            self.chat.turns_done += 1
        self._set_pending(None)

    def _new_session(self) -> None:
        """A fresh ChatSession on the loaded model: the next turn prefills from scratch."""
        self.chat = None
        if self.run is None:
            return
        from k3engine.chat import ChatOptions
        self.chat = self.run.chat(self.history, self._sampler_for(self.spec))
        self.chat.opts = ChatOptions(thinking=self.spec.thinking, effort=self.spec.effort)

    def _sampler_for(self, spec: RunSpec):
        """One sampler per session and sampling settings (the PCG32 stream is per session,
        seeded per turn), rebuilt only when the settings change."""
        key = (spec.greedy, spec.temperature, spec.top_p, spec.top_k, spec.seed)
        if self.sampler is None or key != self._sampler_key:
            self.sampler = spec.request().sampling.sampler()
            self._sampler_key = key
        return self.sampler

    def _apply_chat_options(self, spec: RunSpec) -> None:
        """Thinking, effort and sampling change per turn without reloading the model (a
        changed rendering simply reuses nothing)."""
        from k3engine.chat import ChatOptions
        self.spec = spec if self.spec is None else replace(
            self.spec, gen=spec.gen, thinking=spec.thinking, effort=spec.effort,
            greedy=spec.greedy, temperature=spec.temperature, top_p=spec.top_p,
            top_k=spec.top_k, seed=spec.seed, system_prompt=spec.system_prompt)
        if self.chat is not None:
            self.chat.opts = ChatOptions(thinking=spec.thinking, effort=spec.effort)
            self.chat.sampler = self._sampler_for(spec)

    # -- model ----------------------------------------------------------------------
    @Slot(object, object, int)
    def load(self, spec: RunSpec, available_override, baseline_bytes: int) -> None:
        """plan -> refusals -> tokenizer -> load, in the CLI's order (cli.prepare)."""
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
        """open_run: the same set-up, plan, refusals and load as `k3 --chat`."""
        from k3engine.memory import available_memory, human
        from k3engine.run import open_run
        t0 = time.monotonic()
        if available_override is not None:
            available, total = int(available_override), 0
        else:
            _, probe = available_memory()
            available, total = probe.bytes, probe.total or 0
        req = spec.request(available, baseline_bytes, total)
        self.status.emit(f"opening {spec.model_dir}" + (" and checking the packed trunk"
                                                        if spec.trunk_dir else ""))
        self._loaded_event = None
        self.peak.reset()                 # this model's peak, not the previous one's
        run = open_run(req, self._on_event)
        try:
            from k3engine.run import chat_controls
            run.ctl = chat_controls(run.tok)       # no control tokens: refused (exit 2)
        except BaseException:
            run.close()
            raise
        self.run, self.spec, self.available = run, spec, available
        self._new_session()
        lm, cfg, ev = run.lm, run.cfg, self._loaded_event
        info = dict(
            command=command_line(spec), model_dir=spec.model_dir, trunk_dir=spec.trunk_dir,
            n_layers=run.nl, n_experts=cfg.n_experts,
            moe_layers=[L for L in range(run.nl) if not cfg.is_dense(L)],
            layer_kinds=["MLA" if cfg.is_mla(L) else "KDA" for L in range(run.nl)],
            streamed=ev.streamed, pinned_layers=list(ev.pinned_layers),
            ring_slots=ev.ring_slots, slot_bytes=ev.slot_bytes,
            trunk_total_bytes=sum(run.setup.figures.layer_sizes[:run.nl]),
            expert_slots=ev.expert_slots, expert_slot_bytes=ev.expert_slot_bytes,
            cache_line=ev.cache_line, plan_lines=run.plan.lines(),
            plan_total=run.plan.total_bytes, available=run.plan.available_bytes,
            peak_rss_after_load=self.peak.sample(), peak_measured=self.peak.measured,
            threads=run.threads,
            seconds=time.monotonic() - t0, vocab=cfg.vocab, ultra=lm.ultra,
            streamed_tables=lm.table_stream is not None)
        self.status.emit(f"loaded in {info['seconds']:.1f} s; peak RSS after loading weights "
                         f"{human(info['peak_rss_after_load'])}")
        self.loaded.emit(info)

    def _on_event(self, ev) -> None:
        """The run API's set-up and progress events (engine thread)."""
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
                                      n_layers=self.run.nl if self.run else 0,
                                      done_bytes=ev.done_bytes, total_bytes=ev.total_bytes,
                                      elapsed_s=ev.elapsed_s, eta_s=ev.eta_s,
                                      prompt_ids=self._prompt_ids)):
                self.progressReady.emit()

    def _unload(self) -> None:
        had = self.run is not None
        self.chat = None
        if self.run is not None:
            try:
                self.run.close()
            finally:
                self.run = None
        if had:
            self.unloaded.emit()

    @Slot()
    def unload(self) -> None:
        try:
            self._unload()
        except BaseException as e:  # noqa: BLE001
            self._fail(e, "unload")

    # -- conversation (works with or without a model) ----------------------------------
    @Slot(object)
    def new_conversation(self, system_prompt: str) -> None:
        from k3engine.chat import History, Message
        try:
            self.history = History([Message("system", system_prompt)] if system_prompt else [])
            self.incomplete = set()
            self._set_pending(None)
            self._new_session()
        except BaseException as e:  # noqa: BLE001
            self._fail(e, "new conversation")
        self._emit_conversation()

    @Slot(str, object)
    def open_conversation(self, path: str, extra=None) -> None:
        """`extra`: what the sidecar holds ({"incomplete": last reply or None,
        "incomplete_messages": [indices]}); the engine state of a reply from an earlier
        session is gone, so it is shown and answerable, not continuable."""
        from k3engine.chat import History
        try:
            self.history = History.load(path)
            extra = extra or {}
            self.incomplete = {int(i) for i in extra.get("incomplete_messages") or ()
                               if 0 <= int(i) < len(self.history)}
            p = extra.get("incomplete")
            self._set_pending(dict(p, continuable=False) if p and self.history.ends_with_user
                              else None)
            self._new_session()
        except BaseException as e:  # noqa: BLE001
            if type(e).__name__ == "ChatError":
                e = ChatRefusal(str(e), EXIT_USAGE)
            self._fail(e, "open conversation")
        self._emit_conversation()

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
        from k3engine.chat import History, Message
        try:
            rest = [m for m in self.history if m.role != "system"]
            shift = (1 if text else 0) - (1 if self.history.system is not None else 0)
            self.history = History(([Message("system", text)] if text else []) + rest)
            self.incomplete = {i + shift for i in self.incomplete}
            self._new_session()
        except BaseException as e:  # noqa: BLE001
            self._fail(e, "system prompt")
        self._emit_conversation()

    @Slot()
    def take_back(self) -> None:
        """Remove the last exchange (the last user message and any reply after it) so it
        can be edited and sent again."""
        try:
            self._set_pending(None)
            if len(self.history) and self.history[-1].role == "assistant":
                self.history.remove_last()
            if len(self.history) and self.history[-1].role == "user":
                self.history.remove_last()
            self.incomplete = {i for i in self.incomplete if i < len(self.history)}
        except BaseException as e:  # noqa: BLE001
            self._fail(e, "edit")
        self._emit_conversation()

    # -- turns ------------------------------------------------------------------------
    @Slot(str, object, object)
    def send(self, text: str, spec: RunSpec, cancel) -> None:
        """Add a user message and answer it.  An unanswered user message at the end (a
        reply that hit the limit or was stopped) is replaced by the new one."""
        from k3engine.chat import ChatError, Message
        try:
            if self.pending is not None:
                self._commit_pending()    # the incomplete reply is answered: keep it
            elif self.history.ends_with_user:
                self.history.remove_last()   # a turn that failed: its message is replaced
            self.history.add(Message("user", text))
        except ChatError as e:
            self._refuse_turn(e, "send")
            return
        self._emit_conversation()
        self._turn(spec, cancel)

    def _refuse_turn(self, e: BaseException, during: str) -> None:
        """A turn refused before it started: reported, the transcript re-sent as it is,
        and the turn ends (the panel leaves its generating state)."""
        self._fail(e, during)
        self._emit_conversation()
        self.turnFinished.emit({"failed": True, "n": 0})

    @Slot(object, object)
    def regenerate(self, spec: RunSpec, cancel) -> None:
        """Answer the last user message again (dropping the previous reply, if any)."""
        self._set_pending(None)
        if self.chat is not None:
            self.chat.pending = None
        if len(self.history) and self.history[-1].role == "assistant":
            self.history.remove_last()
            self.incomplete.discard(len(self.history))
            if self.chat is not None:
                self.chat.turns_done = max(0, self.chat.turns_done - 1)
            self._emit_conversation()
        if not self.history.ends_with_user:
            self._fail(ChatRefusal("there is no user message to answer", EXIT_USAGE),
                       "regenerate")
            self.turnFinished.emit({"failed": True, "n": 0})
            return
        self._turn(spec, cancel)

    @Slot(int, str, object, object)
    def edit(self, index: int, text: str, spec: RunSpec, cancel) -> None:
        """Replace the user message at `index` and answer it: the conversation forks there
        (what came after is dropped) and the state is reused up to it (the session's fork
        snapshots)."""
        from k3engine.chat import History, Message
        try:
            msgs = list(self.history)
            if not (0 <= index < len(msgs)) or msgs[index].role != "user":
                raise ChatRefusal(f"message {index + 1} is not a user message", EXIT_USAGE)
            self._set_history(History(msgs[:index] + [Message("user", text)]),
                              {i for i in self.incomplete if i < index})
        except BaseException as e:  # noqa: BLE001
            self._refuse_turn(e, "edit")
            return
        self._emit_conversation()
        self._turn(spec, cancel)

    @Slot(object, object)
    def continue_reply(self, spec: RunSpec, cancel) -> None:
        """Resume the incomplete reply from the retained state (exact: the ids of the
        uninterrupted turn) for up to the generation limit more tokens."""
        if self.chat is None or self.chat.pending is None or self.pending is None:
            self._fail(ChatRefusal("there is no stopped reply to continue on this model: "
                                   "Regenerate answers the message again", EXIT_USAGE),
                       "continue")
            self.turnFinished.emit({"failed": True, "n": 0})
            return
        self._turn(spec, cancel, resume=True)

    def _turn(self, spec: RunSpec, cancel, resume: bool = False) -> None:
        if self.run is None:
            self._fail(ChatRefusal("no model is loaded: load one in Setup first", EXIT_USAGE),
                       "turn")
            self.turnFinished.emit({"failed": True, "n": 0})
            return
        self.busyChanged.emit(True)
        info = {"failed": True, "n": 0}
        try:
            self._apply_chat_options(spec)
            info = self._run_turn(cancel, resume)
        except BaseException as e:  # noqa: BLE001
            # A failed forward may leave the carried state half-advanced: start afresh.
            self._set_pending(None)
            self._new_session()
            self._fail(e, "turn")
        finally:
            self._in_turn = False
            # Idle first, the summary last: whatever reacts to turnFinished (New, Send, a
            # test) must find the engine idle, or a New pressed on it is dropped as "busy"
            # (tests/app/test_app_continue.py caught this as a turn that continued the
            # previous conversation).
            self.busyChanged.emit(False)
            self.turnFinished.emit(info)

    def _run_turn(self, cancel, resume: bool = False) -> dict:
        from k3engine import events as E
        from k3engine.chat import ChatError
        from k3engine.memory import human, kv_check
        run, chat, spec = self.run, self.chat, self.spec
        lm, the_plan = run.lm, run.plan
        gen = spec.gen
        prior = self.pending if resume else None
        done_ids = len(prior["ids"]) if prior else 0
        try:
            n_prompt = chat.pending.prompt_ids if resume else len(chat.render())
        except ChatError as e:            # a later-turn render refusal: drop that message
            self.history.remove_last()
            self._emit_conversation()
            raise ChatRefusal(str(e)) from None
        if n_prompt + done_ids + gen + 1 > MAX_POSITIONS:
            raise ChatRefusal(f"rendered transcript is {n_prompt} tokens; current engine limit "
                              f"is 32768 prompt + 4096 generation tokens")
        kv = kv_check(run.setup.figures, n_prompt + done_ids + gen + 1, self.available)
        if kv.refusal is not None:
            raise ChatRefusal(f"KV cache for {n_prompt + done_ids + gen + 1} positions needs "
                              f"{human(kv.need_bytes)}, but only {human(kv.available_bytes)} is "
                              f"available; history was preserved")
        self.turnStarted.emit(dict(prompt_ids=n_prompt, gen=gen, command=command_line(spec),
                                   thinking=spec.thinking, t=time.monotonic(),
                                   resumed=done_ids,
                                   prior=dict(prior) if prior else None))
        self._prompt_ids, self._in_turn = n_prompt, not resume
        self.peak.reset()                 # this reply's peak RSS
        texts = ({"thinking": prior.get("reasoning") or "", "response": prior["content"]}
                 if prior else {"thinking": "", "response": ""})
        read_bytes = 0
        heat_n = 0
        res, tail = None, ""
        for ev in run.turn(chat, gen, cancel, resume=resume):
            if isinstance(ev, E.StepDone):
                self._in_turn = False      # the first token is out: prefill is over
                step = ev
            elif isinstance(ev, E.TokenOut):
                if ev.id < 0:              # the parser's held-back tail
                    tail = ev.text
                    if ev.phase in texts:
                        texts[ev.phase] += ev.text
                    continue
                if ev.phase in texts:
                    texts[ev.phase] += ev.text
                t = step.telemetry
                read_bytes += t.trunk_bytes + t.expert_bytes
                rec = dict(i=step.step + 1, id=ev.id, text_delta=ev.text, phase=ev.phase,
                           step=step.step, seconds=step.seconds,
                           **{k: getattr(t, k) for k in t.EVENT_KEYS},
                           retention=t.retention_rate / 100.0, raw_hit=t.raw_hit_rate / 100.0,
                           io_trunk_share=t.io_trunk_share, io_expert_share=t.io_expert_share,
                           plan_total=the_plan.total_bytes, available=the_plan.available_bytes)
                # this reply's, from the OS (the step's VmHWM: clear_refs reset it)
                rec["peak_rss_bytes"] = self.peak.sample(t.peak_rss_bytes)
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
        peak = self.peak.sample()
        n = len(res.ids) - res.continued          # this run's ids (a continuation's new ones)
        first_s = res.first_token_seconds
        decode_s = res.seconds - first_s
        if res.end_id is None and res.ids:
            why = "stopped" if res.interrupted else "limit"
            self._set_pending(dict(content=texts["response"],
                                   reasoning=texts["thinking"] if spec.thinking else None,
                                   ids=list(res.ids), why=why,
                                   continuable=chat.pending is not None))
        else:
            self._set_pending(None)
        info = dict(
            failed=False, n=n, ids=list(res.ids), prompt_ids=res.prompt_ids, reused=res.reused,
            continued=res.continued, read_bytes=read_bytes, peak_measured=self.peak.measured,
            seconds=res.seconds, first_token_seconds=first_s,
            s_per_token=res.seconds / n if n else 0.0,
            decode_s_per_token=decode_s / (n - 1) if n > 1 else 0.0,
            tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
            prefill_positions_per_s=(res.prompt_ids - res.reused) / first_s
            if first_s > 0 else 0.0,
            end_id=res.end_id,
            end_name=(run.tok.added.get(res.end_id, str(res.end_id))
                      if res.end_id is not None else None),
            interrupted=res.interrupted, reasoning=res.reasoning, content=res.content,
            tail=tail, gen=gen, thinking=spec.thinking, peak_rss_bytes=peak,
            plan_total=the_plan.total_bytes, available=the_plan.available_bytes,
            retention=lm.experts.total.retention / 100.0,
            true_resident_hit=lm.experts.total.true_hit_rate / 100.0,
            expert_bytes_read=lm.experts.total.bytes_read,
            trunk_bytes_read=lm.trunk.stored_bytes_read if lm.trunk else 0)
        self._emit_conversation()
        return info

    def _post_heat(self) -> None:
        """Requests per (layer, expert) so far: the trace's running counts, O(layers x
        experts) however long the session (no pass over the requests)."""
        grid = self.run.expert_heat() if self.run is not None else None
        if grid is not None and self.heat.put(grid):
            self.heatReady.emit()

    @Slot()
    def emit_conversation(self) -> None:
        self._emit_conversation()


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
        from k3engine.run import Cancel
        self._cancel = Cancel()
        self._send.emit(text, spec, self._cancel)

    def regenerate(self, spec: RunSpec) -> None:
        from k3engine.run import Cancel
        self._cancel = Cancel()
        self._regenerate.emit(spec, self._cancel)

    def edit(self, index: int, text: str, spec: RunSpec) -> None:
        from k3engine.run import Cancel
        self._cancel = Cancel()
        self._edit.emit(index, text, spec, self._cancel)

    def continue_reply(self, spec: RunSpec) -> None:
        from k3engine.run import Cancel
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
           "ChatRefusal", "EXIT_MEANING"]
