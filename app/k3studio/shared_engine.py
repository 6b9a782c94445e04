"""Serving with one engine: while "Serve this model to other apps" is on, ONE copy of the
model answers everyone -- the app's own chat is one of the local server's slots.

Switching Serve on: a reply in progress ends first (Stop ends it now); the app releases its
own engine (its memory goes back before the server loads, so two copies never coexist),
starts `k3 serve --parallel N` on loopback (local_server.py; N from the setting, or the
most the plan fits up to AUTO_MAX) and, when it listens, moves the chat pane to an
engine-less RemoteHost on that server: the same conversation file is reopened there, so
the transcript, an incomplete reply and each reply's stats stay in the pane.  The Batch
plot page polls the server's steps (steps_feed.py -> batch_plots.py).

Switching it off (or the server ending on its own): a reply in progress ends first, the
server stops, the chat goes back to this machine's engine (the conversation reopened
there) and the model the app had loaded is loaded again with the current settings.

While serving, Load is refused (it would be the second copy) and the backend choice is
locked; the Setup and chat labels say where the model is.
"""
from __future__ import annotations

import os

from PySide6.QtCore import QObject, QTimer, Signal

from k3engine.memory import AUTO_SEQUENCES as AUTO_MAX   # slots when the setting says auto


def slots_that_fit(figures, spec, available, baseline_bytes: int = 0,
                   total_memory: int = 0, most: int = AUTO_MAX) -> int:
    """The most slots, up to `most`, whose plan as `k3 serve --parallel N` makes it (N
    sequences of --gen + 1 positions each) has no refusal; 1 when even two do not fit or
    the model's figures are not known (then other apps wait in the server's queue while
    the window's chat runs)."""
    if figures is None:
        return 1
    from dataclasses import replace

    from k3engine.engine import MAX_GEN
    from k3engine.memory import most_sequences, plan_for
    ls = spec.load_spec(baseline_bytes=baseline_bytes, total_memory=total_memory)
    return most_sequences(lambda n: not plan_for(
        figures, replace(ls, sequences=n).plan_request(n * (MAX_GEN + 1)), available,
        total_memory).refusals, most)


class SharedEngine(QObject):
    changed = Signal(str)             # "off" | "starting" | "serving" | "stopping"

    def __init__(self, window, panel):
        super().__init__(window)
        from .batch_plots import BatchPlots
        from .local_server import LocalServer
        from .remote_host import RemoteHost
        from .steps_feed import StepsFeed
        self.w, self.panel = window, panel
        self.server = LocalServer(window, os.path.join(window.data_dir, "prompt-cache"))
        self.served = RemoteHost(window)          # the window's chat as one server slot
        window.backend.add(self.served)
        self.feed = StepsFeed(self)
        self.plots = BatchPlots()
        window.plots.add_page(self.plots, "Batch")
        self.state = "off"
        self.moved = False            # the chat went to the server (it was on this engine)
        self.reload = False           # the app had a model loaded: load it again after
        self._releasing = False
        self._next = None             # what runs once no reply or load is in progress
        self.server.started.connect(self._started)
        self.server.stopped.connect(self._stopped)
        self.feed.steps.connect(self.plots.on_steps)
        window.host.unloaded.connect(self._released)
        window.host.busyChanged.connect(self._maybe_idle)
        window.backend.turnFinished.connect(self._maybe_idle)
        self.served.errored.connect(window._errored)
        self.served.status.connect(lambda s: window.statusBar().showMessage(s, 10000))
        panel.serveToggled.connect(self.switch)

    @property
    def serving(self) -> bool:
        return self.state != "off"

    def switch(self, on: bool) -> None:
        (self.start if on else self.stop)()

    # -- on ------------------------------------------------------------------------------
    def start(self) -> None:
        if self.state != "off":
            return
        if not self.w.spec().model_dir:
            self._toggle(False)
            self.panel.serve_url.setText("choose a model above first")
            return
        self._set("starting")
        self._when_idle(self._release)

    def _release(self) -> None:
        w = self.w
        self.moved = w.backend.active is w.host
        self.reload = w.host.model_loaded
        if self.reload:
            self._say("releasing the app's engine …")
            self._releasing = True
            w.host.unload()                       # -> _released
        else:
            self._launch()

    def _released(self) -> None:
        if self._releasing:
            self._releasing = False
            self._launch()

    def _launch(self) -> None:
        w = self.w
        n = w.settings.serve_slots or slots_that_fit(
            w.memory.figures, w.spec(), w.memory.available, w.baseline_bytes,
            (w.memory.probe.total or 0) if w.memory.available_override is None
            and w.memory.probe else 0)
        self._say(f"starting k3 serve with {n} slot{'s' * (n > 1)} …")
        self.server.start(w.spec(), n)

    def _started(self, url: str) -> None:
        w, n = self.w, self.server.parallel
        name = os.path.basename(os.path.normpath(w.spec().model_dir))
        self.served.configure(url, "", name)
        self.served.where = f"this machine's k3 serve, one of {n} slots"
        self.plots.reset(n)
        w.plots.show_page(self.plots, True, alone=True)
        w.plots.summary.setText(f"Served by k3 serve: the Batch page shows every "
                                f"conversation its {n} slot{'s' * (n > 1)} hold; the "
                                f"per-token pages fill again when Serve is off.")
        self.feed.start(url)
        if self.moved:
            self._carry(self.served)
        self.panel.serve_url.setText(url)
        slots = f"{n} slot{'s' * (n > 1)}"
        w.chat.set_model(f"<b>{name}</b> · served at {url} · "
                         + ("this chat is one of its " + slots if self.moved else slots), True)
        w.setup.set_engine_state(False, True, f"Served by k3 serve at {url}: one copy of "
                                 f"the model, {slots}" + ("; this window's chat is one of "
                                                          "them" if self.moved else "")
                                 + ". Switch Serve off (Backend, below) to have it here.")
        self._set("serving")

    # -- off -----------------------------------------------------------------------------
    def stop(self) -> None:
        if self.state in ("off", "stopping"):
            return
        if self.state == "starting" and not self.server.running:
            # not launched yet (waiting for a reply, or for the engine to be released)
            self._next, self._releasing = None, False
            self._stopped(0, "")
            return
        self._set("stopping")
        self._when_idle(self.server.stop)         # -> _stopped

    def _stopped(self, code: int, tail: str) -> None:
        """The server ended: asked to, or on its own (a crash, a plan refusal before it
        listened): the chat and the model come back to this machine's engine."""
        w = self.w
        self.feed.stop()
        w.plots.show_page(self.plots, False)
        self.plots.reset(1, serving=False)
        self._set("off")
        self._toggle(False)
        self.panel.serve_url.setText("" if code == 0 else f"k3 serve ended ({code}): "
                                     f"{tail.splitlines()[-1] if tail else ''}")
        if self.moved and w.backend.active is self.served:
            self._carry(w.host)
        self.moved = False
        if self.reload:
            self.reload = False
            w.setup.loadRequested.emit()          # as Load in Setup: the current settings
        elif not w.host.model_loaded:
            w._unloaded()                         # the labels of "no model here"

    # -- helpers -------------------------------------------------------------------------
    def _carry(self, host) -> None:
        """The chat to `host`, on the same conversation: its file (the library keeps it
        saved after every message and reply) with its incomplete reply, or an empty one
        with the same system prompt when nothing was said yet."""
        w = self.w
        w.library.carry_to(host, lambda: w.backend.use(host), w.chat.system.text())

    def _busy(self) -> bool:
        return self.w.backend.busy or self.w.host.busy

    def _when_idle(self, fn) -> None:
        if self._busy():
            self._next = fn
            self._say("waiting for the reply in progress to end (Stop ends it now) …")
        else:
            fn()

    def _maybe_idle(self, *_a) -> None:
        # after the signal's other receivers (the turn's summary reaches the chat first)
        if self._next is not None:
            QTimer.singleShot(0, self._run_next)

    def _run_next(self) -> None:
        if self._next is not None and not self._busy():
            fn, self._next = self._next, None
            fn()

    def _set(self, state: str) -> None:
        self.state = state
        self.panel.lock(state != "off")           # the backend choice waits for Serve off
        self.changed.emit(state)

    def _toggle(self, on: bool) -> None:
        s = self.panel.serve
        s.blockSignals(True)
        s.setChecked(on)
        s.blockSignals(False)

    def _say(self, text: str) -> None:
        self.panel.serve_url.setText(text)


__all__ = ["SharedEngine", "slots_that_fit", "AUTO_MAX"]
