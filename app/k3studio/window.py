"""The main window: a thin composition of the panels around one EngineHost.

The window owns the settings object and the wiring; each panel owns its widgets.  The
current `RunSpec` is always built from the settings, so what the memory panel plans, what
the worker loads and the `k3` command line shown are the same run.
"""
from __future__ import annotations

import os
from dataclasses import asdict

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import (QFrame, QHBoxLayout, QLabel, QMainWindow, QPushButton,
                               QSplitter, QTabWidget, QToolButton, QVBoxLayout, QWidget)

from k3engine.memory import human, human_seconds
from k3engine.telemetry import rss_bytes

from . import APP_NAME, appres, demo
from . import settings as settings_mod
from . import chat_backend
from .chat_backend import ChatBackend
from .chat_panel import ChatPanel
from .conversation_library import ConversationLibrary
from .conversations import ConversationStore, default_root
from .conversations_panel import ConversationsPanel
from .datapoint_action import attach_datapoint
from .download_panel import attach_download
from .memory_panel import MemoryPanel
from .menus import build_menus
from .plots_panel import PlotsPanel
from .runspec import RunSpec, command_line, from_settings
from .setup_panel import SetupPanel
from .tasks import Task
from .remote_host import RemoteHost
from .whatif_panel import WhatIfPanel, attach_whatif
from .worker import EngineHost

TAB_SETUP, TAB_MEMORY, TAB_CHAT = 0, 1, 2
LIST, CHAT, SIDE = 0, 1, 2            # the chat tab's splitter: list | conversation | side
SIDE_TELEMETRY, SIDE_SETTINGS = 0, 1
MEMORY_FIELDS = ("model_dir", "trunk_dir", "tok_dir", "preset", "trunk_gb", "cache_gb",
                 "trunk_ring", "cache_policy", "lookahead", "threads")


def cache_text(info: dict) -> str:
    """The loaded expert cache in units for its size (the engine's own line is the
    reference's, fixed to MB/GB/TB: "224 slots x 0.02 MB = 0.00 GB" on the demo)."""
    slots, slot = info["expert_slots"], info["expert_slot_bytes"]
    pool = len(info["moe_layers"]) * info["n_experts"]
    share = f" ({100 * slots / pool:.0f}% of the {pool} (layer, expert) pairs)" if pool else ""
    return f"expert cache {slots} slots x {human(slot)} = {human(slots * slot)}{share}"


class ErrorBanner(QFrame):
    """Engine errors, non-modal: what happened and what to do (fixes.py) first, then the
    CLI's own message with its exit code's meaning, expandable."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("error_box")
        self.headline = QLabel()
        self.headline.setWordWrap(True)
        self.headline.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.details_btn = QToolButton()
        self.details_btn.setText("Details")
        self.details_btn.setCheckable(True)
        self.text = QLabel()
        self.text.setWordWrap(True)
        self.text.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.details_btn.toggled.connect(self.text.setVisible)
        close = QPushButton("Dismiss")
        close.clicked.connect(self.hide)
        lay = QHBoxLayout(self)
        col = QVBoxLayout()
        col.addWidget(self.headline)
        col.addWidget(self.details_btn, 0, Qt.AlignLeft)
        col.addWidget(self.text)
        lay.addLayout(col, 1)
        lay.addWidget(close, 0, Qt.AlignTop)
        self.hide()

    def show_error(self, info: dict) -> None:
        from html import escape

        from .fixes import advice
        meaning = f" ({info['meaning']})" if info.get("meaning") else ""
        during = info.get("during", "")
        a = advice(info["message"])
        self.headline.setText(f"<b>{escape(a.cause)}</b> {escape(a.fix)}" if a else
                              f"<b>{escape(info['kind'])} during {escape(during)}</b>")
        self.text.setText(f"<b>{escape(info['kind'])} during {escape(during)}; k3 would exit "
                          f"{info['code']}{escape(meaning)}</b><br><pre style='white-space:"
                          f"pre-wrap'>{escape(info['message'])}</pre>")
        # with advice the technical part folds away; without, it is all there is
        self.details_btn.setVisible(a is not None)
        self.details_btn.setChecked(a is None)
        self.text.setVisible(a is None)
        self.show()


class MainWindow(QMainWindow):
    def __init__(self, store=None, data_dir: str | None = None, parent=None):
        super().__init__(parent)
        self.store = store if store is not None else settings_mod.default_store()
        self.settings = settings_mod.load(self.store)
        self.data_dir = data_dir or demo.data_dir()
        self.last_error: dict | None = None
        self.loaded_spec: RunSpec | None = None
        self._autoload = False
        self.setWindowTitle(APP_NAME)
        self._default_size()

        self.host = EngineHost(self)
        # the chat talks to this machine's engine or a remote endpoint (chat_backend.py)
        self.remote = RemoteHost(self)
        self.backend = ChatBackend(self.host, self.remote, self)
        self.setup = SetupPanel(self.data_dir)
        self.memory = MemoryPanel(self.spec)
        self.chat = ChatPanel(self.backend, self.effective_spec)
        self.plots = PlotsPanel()
        store = ConversationStore(default_root(self.data_dir))
        store.purge_trash()                  # deletions of an earlier session are final
        # the library follows whichever host the chat talks to (chat_backend.py)
        self.library = ConversationLibrary(store, self.backend, self)
        self.sidebar = ConversationsPanel(store)

        # The conversation owns the window: the list on the left and the telemetry and
        # settings on the right are side panels that collapse (a toggle each, or drag a
        # panel to the edge); the splitter's state is kept in the settings.
        self.side = QTabWidget()
        self.side.setObjectName("side_panel")
        self.side.addTab(self.plots, "Telemetry")
        self.side.addTab(self.chat.settings_box, "Settings")
        self.splitter = QSplitter(Qt.Horizontal)
        self.splitter.setChildrenCollapsible(True)
        self.splitter.addWidget(self.sidebar)
        self.splitter.addWidget(self.chat)
        self.splitter.addWidget(self.side)
        self.splitter.setCollapsible(CHAT, False)
        self.splitter.setStretchFactor(LIST, 0)
        self.splitter.setStretchFactor(CHAT, 3)
        self.splitter.setStretchFactor(SIDE, 1)
        self._panel_width = {LIST: 0, SIDE: 0}   # a collapsed panel's width to reopen at
        self.tabs = QTabWidget()
        self.tabs.addTab(self.setup, "Setup")
        self.tabs.addTab(self.memory, "Memory")
        self.tabs.addTab(self.splitter, "Chat")
        self.whatif = WhatIfPanel()
        self.tabs.addTab(self.whatif, "What-if")
        self.errors = ErrorBanner()
        central = QWidget()
        lay = QVBoxLayout(central)
        lay.setContentsMargins(8, 8, 8, 4)
        lay.addWidget(self.errors)
        lay.addWidget(self.tabs, 1)
        self.setCentralWidget(central)

        self.rss_label = QLabel()
        self.rss_label.setToolTip("This process's resident set now (from the OS)")
        # short, so the status messages beside it keep their room (the whole sentence cut
        # them off at 1024 px); the sentence is the tooltip and the welcome card's
        self.demo_label = QLabel("Demo model")
        self.demo_label.setToolTip(demo.DEMO_LABEL)
        self.demo_label.setObjectName("demo_badge")
        self.demo_label.setVisible(False)
        self.statusBar().addPermanentWidget(self.demo_label)
        self.statusBar().addPermanentWidget(self.rss_label)
        self._rss_timer = QTimer(self)
        self._rss_timer.timeout.connect(self._show_rss)
        self._rss_timer.start(1000)

        # the process's own baseline (interpreter, NumPy, Qt) counts in the plan (§5.8)
        self.baseline_bytes = rss_bytes()

        # panels -> settings
        self.setup.load_from(self.settings)
        self.memory.load_from(self.settings)
        self.chat.load_from(self.settings)
        self.memory.set_baseline(self.baseline_bytes)
        self.setup.changed.connect(self._collect)
        self.memory.changed.connect(self._collect)
        self.memory.applyRequested.connect(self.apply_memory)
        self.chat.changed.connect(self._collect)
        self.setup.inspected.connect(self._inspected)
        self.setup.loadRequested.connect(self.load_model)
        self.setup.unloadRequested.connect(self.host.unload)
        self.setup.demoReady.connect(self._demo_ready)

        # engine -> panels
        h = self.host
        h.status.connect(lambda s: self.statusBar().showMessage(s, 10000))
        h.busyChanged.connect(self._busy)
        h.planned.connect(self._planned)
        h.loaded.connect(self._loaded)
        h.unloaded.connect(self._unloaded)
        h.records.connect(self.plots.on_records)
        h.heat.connect(self.plots.set_heat)
        h.turnFinished.connect(self._turn_finished)
        h.errored.connect(self._errored)

        # conversations
        lib = self.library
        self.sidebar.openRequested.connect(lib.open)
        self.sidebar.newRequested.connect(self.new_conversation)
        self.sidebar.deleted.connect(lib.forget)
        self.chat.replyStatsChanged.connect(lib.set_reply_stats)
        self.chat.list_toggle.toggled.connect(lambda on: self.show_panel(LIST, on))
        self.chat.side_toggle.toggled.connect(lambda on: self.show_panel(SIDE, on))
        self.chat.details_toggle.toggled.connect(self._details)
        self.splitter.splitterMoved.connect(self._sync_toggles)
        self.chat.downloadRequested.connect(lambda: self.tabs.setCurrentWidget(self.download))
        lib.changed.connect(self.sidebar.set_current)
        lib.switched.connect(self._switched)
        lib.wantsModel.connect(self._conversation_model)
        lib.failed.connect(lambda why: self.statusBar().showMessage(why, 15000))
        self._shown_conversation = self._plotted_model = ""
        self._applying = False
        self.actions_by_name = build_menus(self)
        self.dark = False
        self.set_theme(self.settings.theme)
        chat_backend.attach(self)
        self.local_server.port = self.settings.serve_port

        attach_whatif(self)
        attach_download(self)
        attach_datapoint(self)
        appres.sheet_drawn_popups(self)
        self._restore_window()
        self.chat.details_toggle.setChecked(self.settings.details)
        self._details(self.settings.details)
        if not self.settings.model_dir:
            self.tabs.setCurrentIndex(TAB_SETUP)
        self._show_rss()
        self.chat.show_command()
        last = self.settings.conversation_path
        if not (last and os.path.dirname(last) == store.root and os.path.isfile(last)
                and lib.open(store.id_of(last))):
            lib.new(self.settings.system_prompt)

    # -- the current run ---------------------------------------------------------------
    def spec(self) -> RunSpec:
        return from_settings(self.settings)

    def _collect(self) -> None:
        """Panel values -> the settings object (persisted on close and on load)."""
        s = self.settings
        for k, v in {**self.setup.values(), **self.memory.values(),
                     **self.chat.values()}.items():
            setattr(s, k, v)
        self.memory.refresh()
        self.chat.show_command()
        self._stale_note()

    def save_settings(self) -> None:
        self._collect()
        s = self.settings
        s.geometry = bytes(self.saveGeometry().data())
        s.splitter = bytes(self.splitter.saveState().data())
        s.side_tab = self.side.currentIndex()
        s.serve_port = self.local_server.port
        s.tab = self.tabs.currentIndex()
        s.conversation_path = self.library.path
        settings_mod.save(self.store, s)

    def _restore_window(self) -> None:
        s = self.settings
        if s.geometry:
            self.restoreGeometry(s.geometry)
        if not (s.splitter and self.splitter.restoreState(s.splitter)
                and self.splitter.count() == len(self.splitter.sizes())):
            self.splitter.setSizes(self._default_sizes())
        self.side.setCurrentIndex(min(max(s.side_tab, 0), self.side.count() - 1))
        self.tabs.setCurrentIndex(min(max(s.tab, 0), self.tabs.count() - 1))
        self._sync_toggles()

    def _default_sizes(self) -> list[int]:
        """The conversation gets the most: at 1024 px about 180 | 530 | 300 (the side
        panel's plots stay legible), at 1920 px 260 | 1100 | 560."""
        w = max(self.width(), 1000)
        side = max(300, w * 29 // 100)
        lst = max(170, w * 14 // 100)
        return [lst, w - side - lst, side]

    # -- side panels --------------------------------------------------------------------
    def panel_shown(self, index: int) -> bool:
        return self.splitter.sizes()[index] > 0

    def show_panel(self, index: int, on: bool) -> None:
        """Open or collapse a side panel; the conversation takes or gives the room."""
        sizes = self.splitter.sizes()
        if on == (sizes[index] > 0):
            return
        if on:
            want = self._panel_width[index] or self._default_sizes()[index]
            give = min(want, max(sizes[CHAT] - 300, 0)) or want
            sizes[index], sizes[CHAT] = give, max(sizes[CHAT] - give, 1)
        else:
            self._panel_width[index] = sizes[index]
            sizes[CHAT] += sizes[index]
            sizes[index] = 0
        self.splitter.setSizes(sizes)
        self._sync_toggles()

    def _sync_toggles(self, *_a) -> None:
        """The toggles follow the splitter (a panel dragged shut is shown as closed)."""
        sizes = self.splitter.sizes()
        for toggle, index in ((self.chat.list_toggle, LIST), (self.chat.side_toggle, SIDE)):
            toggle.blockSignals(True)
            toggle.setChecked(sizes[index] > 0)
            toggle.blockSignals(False)
            a = self.actions_by_name.get("show_list" if index == LIST else "show_side")
            if a is not None:
                a.blockSignals(True)
                a.setChecked(sizes[index] > 0)
                a.blockSignals(False)

    def _show_model_line(self) -> None:
        """The chat bar's model line: the name (and that a demo is not Kimi K3); how the
        trunk is held is the engine's vocabulary, shown with Details."""
        info = self.host.loaded_info
        if info is None or self.backend.is_remote:
            return
        name = os.path.basename(os.path.normpath(info["model_dir"]))
        line = f"<b>{name}</b>"
        if demo.is_demo(info["model_dir"]):
            line += " · demo, not Kimi K3"
        if self.settings.details:
            line += " · " + (f"trunk streamed, {len(info['pinned_layers'])}/"
                             f"{info['n_layers']} layers pinned, ring {info['ring_slots']}"
                             if info["streamed"] else "trunk resident")
        self.chat.set_model(line, True)

    def _details(self, on: bool) -> None:
        """The engine's vocabulary (prefill breakdown, end ids, resident hits, binds): in
        the reply stats, the telemetry summary and the memory panel, or not at all."""
        self.settings.details = on
        self.chat.set_details(on)
        self.plots.set_details(on)
        self.memory.set_details(on)
        self._show_model_line()

    # -- model lifecycle -------------------------------------------------------------
    def load_model(self) -> None:
        if self.shared.serving:       # the server holds the model: a load would be a copy
            self.statusBar().showMessage("The model is served to other apps (Setup, "
                                         "Backend): switch Serve off to load it here.", 10000)
            return
        self._collect()
        settings_mod.save(self.store, self.settings)
        spec = self.spec()
        self.errors.hide()
        self.setup.set_engine_state(self.host.model_loaded, True, "Loading…")
        self.host.load(spec, self.memory.available_override, self.baseline_bytes)
        self._pending_spec = spec

    def _planned(self, ev: dict) -> None:
        self.plots.set_plan(ev["total_bytes"], ev["available"])

    def _loaded(self, info: dict) -> None:
        self.loaded_spec = getattr(self, "_pending_spec", self.spec())
        name = os.path.basename(os.path.normpath(info["model_dir"]))
        how = (f"trunk streamed, {len(info['pinned_layers'])}/{info['n_layers']} layers pinned, "
               f"ring {info['ring_slots']}" if info["streamed"] else "trunk resident")
        text = (f"Loaded {name} in {human_seconds(info['seconds'])}: {how}; "
                f"{cache_text(info)}. Peak RSS after loading "
                f"{human(info['peak_rss_after_load'])} (plan {human(info['plan_total'])}).")
        self.setup.set_engine_state(True, self.host.busy, text)
        is_demo = demo.is_demo(info["model_dir"])
        self.demo_label.setVisible(is_demo)
        from k3engine.tools.demo_corpus import example_prompts
        self.chat.set_examples(example_prompts() if is_demo else [],
                               demo.DEMO_BLURB)
        self._show_model_line()
        self.plots.reset(f"model {self._plotted_model or 'none'}")   # token axis from 1
        self._plotted_model = name
        self.plots.set_model(info)
        spec = self.loaded_spec
        self.library.set_model(spec.model_dir, spec.trunk_dir, spec.tok_dir)
        self.memory.show_measured(info["plan_total"], info["peak_rss_after_load"])
        if not self._applying:
            self.tabs.setCurrentIndex(TAB_CHAT)
        self._applying = False
        self._stale_note()
        self.chat.show_command()

    def _unloaded(self) -> None:
        self.loaded_spec = None
        self.setup.set_engine_state(False, self.host.busy, "No model loaded.")
        self.chat.set_model("No model loaded: load one in Setup.", False)
        self.chat.set_examples([])
        self.plots.set_model(None)

    def _busy(self, busy: bool) -> None:
        self.setup.set_engine_state(self.host.model_loaded, busy)
        # New waits for the reply (Stop ends it): a disabled control, not a press ignored
        self.actions_by_name["new"].setEnabled(not busy)
        self.sidebar.new_btn.setEnabled(not busy)
        self._stale_note()

    def _turn_finished(self, info: dict) -> None:
        if info.get("failed"):
            return
        self.memory.show_measured(info["plan_total"], info["peak_rss_bytes"])

    def _errored(self, info: dict) -> None:
        self.last_error = info
        self.errors.show_error(info)
        self.statusBar().showMessage(info["message"].splitlines()[0], 15000)
        self.setup.set_engine_state(self.host.model_loaded, self.host.busy,
                                    None if self.host.model_loaded else
                                    f"Not loaded: {info['message'].splitlines()[0]}")

    def effective_spec(self) -> RunSpec:
        """What a turn runs with: the loaded model and budgets, the current chat settings
        (those apply per turn).  The chat's command line shows this, not budgets that are
        not loaded."""
        cur = self.spec()
        if self.loaded_spec is None:
            return cur
        from dataclasses import replace
        return replace(cur, **{k: getattr(self.loaded_spec, k) for k in MEMORY_FIELDS})

    def _stale_note(self) -> None:
        """Memory and model settings apply at load: Apply (Memory tab) loads them in place."""
        stale = self.loaded_spec is not None and any(
            getattr(self.spec(), k) != getattr(self.loaded_spec, k) for k in MEMORY_FIELDS)
        self.memory.apply_btn.setEnabled(stale and not self.host.busy)
        self.memory.apply_btn.setToolTip(
            "Load these budgets now: the model is reloaded in place, the conversation stays "
            "(its next reply reads it again)" if stale else "The budgets shown are loaded")
        if stale:
            self.statusBar().showMessage("Model or memory settings changed since the load: "
                                         "Apply (Memory tab) loads them; the conversation "
                                         "stays.", 10000)

    def apply_memory(self) -> None:
        if not self.host.busy and self.loaded_spec is not None:
            self._applying = True        # stay on the Memory tab to see the result
            self.load_model()

    # -- setup -> memory ------------------------------------------------------------
    def _inspected(self, insp) -> None:
        self.memory.set_figures(insp.figures if insp.model.ok else None)
        if not self.host.model_loaded:
            self.chat.set_model("No model loaded: load one in Setup." if insp.runnable else
                                "Choose a model in Setup.", False)
        if self._autoload and insp.runnable:
            self._autoload = False
            self.load_model()

    def use_demo(self, autoload: bool = True) -> None:
        """`--demo`: make the demo model if needed, select it, optionally load it."""
        self._autoload = autoload
        if demo.demo_ready(self.data_dir):
            model, trunk = demo.demo_paths(self.data_dir)
            self.setup.set_paths(model, trunk, "")
        else:
            self.tabs.setCurrentIndex(TAB_SETUP)
            self.setup.create_demo()

    def _demo_ready(self, model: str, trunk: str) -> None:
        self.settings.demo_offered = True
        self._collect()

    # -- conversations and look ---------------------------------------------------------
    def new_conversation(self) -> None:
        if self.backend.busy:
            return
        self.library.new(self.chat.system.text())       # on the host the chat talks to

    def _switched(self, cid: str) -> None:
        """New or another conversation: its own stats, and the plots start again at token 1
        (the previous series stays exportable)."""
        self.chat.reset_view()
        if cid and self.library.meta is not None:
            self.chat.set_reply_stats(self.library.meta.extra.get("reply_stats"))
        self.memory.clear_measured()
        self.plots.reset(f"conversation {self._shown_conversation or 'new'}")
        self._shown_conversation = cid

    def _conversation_model(self, model: str, trunk: str, tok: str) -> None:
        """An opened conversation names another model that is on disk: load it (after the
        live checks pass, like --demo)."""
        if self.host.busy:
            return
        self._autoload = True
        self.setup.set_paths(model, trunk, tok)

    def set_theme(self, theme: str) -> None:
        from PySide6.QtWidgets import QApplication
        self.settings.theme = theme if theme in appres.THEMES else "system"
        self.dark = appres.apply_theme(QApplication.instance(), self.settings.theme)
        self.plots.set_dark(self.dark)
        self.whatif.set_dark(self.dark)
        for key in appres.THEMES:
            a = self.actions_by_name.get(f"theme_{key}")
            if a is not None:
                a.setChecked(key == self.settings.theme)

    def _default_size(self) -> None:
        """1280x800, or the screen's available area when that is smaller; every panel
        stays usable down to 1024x700."""
        screen = self.screen().availableGeometry() if self.screen() else None
        w, h = 1280, 800
        if screen is not None and screen.width() > 0:
            w, h = min(w, screen.width()), min(h, screen.height())
        self.resize(w, h)

    # -- misc ------------------------------------------------------------------------
    def _show_rss(self) -> None:
        self.rss_label.setText(f"RSS {human(rss_bytes())}")

    def command_line(self) -> str:
        return command_line(self.spec())

    def closeEvent(self, event) -> None:
        self.save_settings()
        self.memory.forecast_box.cancel_measure()     # a child process: never left behind
        # Background jobs (demo model, pack, checks) must stop before their QThreads are
        # destroyed, or Qt aborts the process; each honours abort at its next safe point.
        for task in list(Task._live):
            task.abort()
            task.wait(120_000)
        self.host.shutdown()
        super().closeEvent(event)

    def settings_dict(self) -> dict:
        return asdict(self.settings)
