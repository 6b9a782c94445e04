"""Chat panel: the conversation, streamed as it is generated (Markdown), with the thinking
block collapsible, Stop / Continue / Regenerate, Edit on every message of the person, the
system prompt, thinking and sampling settings, and honest stats under every reply.

The conversation itself lives on the engine worker; this panel renders the snapshots it
sends and the per-token records of the reply in flight.  A reply that stops without an end
id (limit reached, Stop pressed) stays on screen as an incomplete reply, marked as such:
Continue resumes it from the retained state (exactly: the ids of an uninterrupted turn),
Regenerate answers again, and a new message answers it (it then joins the transcript).
A failed reply (an error) is shown as a draft outside the conversation.
"""
from __future__ import annotations

from typing import Callable

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication, QKeySequence, QShortcut
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFrame,
                               QGroupBox, QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit,
                               QProgressBar, QPushButton, QScrollArea, QSizePolicy, QSpinBox,
                               QToolButton, QVBoxLayout, QWidget)

from k3engine.memory import human, human_seconds

from .markdown_view import MarkdownView
from .notice_bar import NoticeBar
from .runspec import RunSpec

ROLE_TITLE = {"user": "You", "assistant": "K3", "system": "System prompt"}


class MessageWidget(QFrame):
    """One message: role, optional collapsible reasoning, content, stats line."""

    def __init__(self, role: str, content: str = "", reasoning: str | None = None,
                 stats: str = "", note: str = "", parent=None):
        super().__init__(parent)
        self.role = role
        self.setObjectName(f"bubble_{role}")
        self.setSizePolicy(QSizePolicy.Preferred, QSizePolicy.Maximum)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(10, 6, 10, 6)
        lay.setSpacing(4)
        head = QHBoxLayout()
        head.setContentsMargins(0, 0, 0, 0)
        head.addWidget(QLabel(f"<b>{ROLE_TITLE.get(role, role)}</b>"), 1)
        self.copy_btn = QToolButton()
        self.copy_btn.setObjectName("copy_message")
        self.copy_btn.setText("Copy")
        self.copy_btn.setToolTip("Copy this message (its Markdown text)")
        self.copy_btn.clicked.connect(self.copy)
        self.edit_btn = QToolButton()
        self.edit_btn.setObjectName("copy_message")
        self.edit_btn.setText("Edit")
        self.edit_btn.setToolTip("Edit this message: the conversation continues from it "
                                 "(what came after is dropped; the model's state up to it "
                                 "is reused)")
        head.addWidget(self.edit_btn)
        head.addWidget(self.copy_btn)
        lay.addLayout(head)
        # only once it has a parent: setVisible(True) on a parentless widget shows it as a
        # window of its own, which takes the activation (and the focus) from the main one
        self.edit_btn.setVisible(role == "user")
        self.index = -1                      # position in the transcript (set by the panel)
        self.think_toggle = QToolButton()
        self.think_toggle.setObjectName("thinking_toggle")
        self.think_toggle.setCheckable(True)
        self.think_toggle.setToolButtonStyle(Qt.ToolButtonTextBesideIcon)
        self.think_toggle.setArrowType(Qt.RightArrow)
        self.think_toggle.toggled.connect(self._toggle)
        self.think_frame = QFrame()
        self.think_frame.setObjectName("thinking")
        tl = QVBoxLayout(self.think_frame)
        tl.setContentsMargins(8, 2, 4, 2)
        self.thinking = MarkdownView(markdown=False)
        tl.addWidget(self.thinking)
        lay.addWidget(self.think_toggle)
        lay.addWidget(self.think_frame)
        # the model's replies are Markdown; what a person typed is shown as typed
        self.content = MarkdownView(markdown=role == "assistant")
        lay.addWidget(self.content)
        self.progress = QProgressBar()
        self.progress.setMaximumHeight(14)
        self.progress.setTextVisible(True)
        self.progress.setVisible(False)
        lay.addWidget(self.progress)
        self.note = QLabel()
        self.note.setWordWrap(True)
        self.note.setObjectName("check_warn")
        lay.addWidget(self.note)
        self.stats = QLabel()
        self.stats.setObjectName("stats")
        self.stats.setWordWrap(True)
        self.stats.setTextInteractionFlags(Qt.TextSelectableByMouse)
        lay.addWidget(self.stats)
        self._reasoning = reasoning or ""
        self._content = content
        self._has_thinking = False
        self.set_reasoning(reasoning, expanded=False)
        self.content.set_text(content)
        self.content.setVisible(bool(content) or role != "assistant")
        self.set_stats(stats)
        self.set_note(note)

    # -- streaming ---------------------------------------------------------------------
    def append_thinking(self, text: str) -> None:
        if not text:
            return
        self._has_thinking = True
        if not self._reasoning:
            self.think_toggle.setChecked(True)       # open while it streams
        self._reasoning += text
        self.thinking.append(text)
        self._update_toggle()

    def append_content(self, text: str) -> None:
        if not text:
            return
        if not self._content and self._reasoning:
            self.think_toggle.setChecked(False)      # the answer started: fold the thoughts
        self._content += text
        self.content.append(text)
        self.content.setVisible(True)

    def set_reasoning(self, text: str | None, expanded: bool) -> None:
        """None: no thinking block at all (thinking off); "" or text: a block."""
        self._has_thinking = text is not None and self.role == "assistant"
        self._reasoning = text or ""
        self.thinking.set_text(self._reasoning)
        self.think_toggle.setChecked(expanded)
        self._update_toggle()

    def set_content(self, text: str) -> None:
        self._content = text
        self.content.set_text(text)
        self.content.setVisible(True)

    def flush(self) -> None:
        """The stream ended: render what the throttle still holds."""
        self.thinking.flush()
        self.content.flush()

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self._content)

    def set_stats(self, text: str) -> None:
        self.stats.setText(text)
        self.stats.setVisible(bool(text))

    def set_note(self, text: str) -> None:
        self.note.setText(text)
        self.note.setVisible(bool(text))

    @property
    def reasoning_text(self) -> str:
        return self._reasoning

    @property
    def content_text(self) -> str:
        return self._content

    def _toggle(self, on: bool) -> None:
        self.think_frame.setVisible(on and self._has_thinking)
        self.think_toggle.setArrowType(Qt.DownArrow if on else Qt.RightArrow)

    def _update_toggle(self) -> None:
        n = len(self._reasoning)
        self.think_toggle.setText(f"Thinking ({n} characters)" if n else "Thinking…")
        self.think_toggle.setVisible(self._has_thinking)
        self._toggle(self.think_toggle.isChecked())

    @property
    def has_thinking(self) -> bool:
        return self._has_thinking


class WelcomeCard(QFrame):
    """An empty conversation on the demo model: what the demo is and is not, a few prompts
    from what it was trained on (one click sends), and where to get Kimi K3."""

    def __init__(self, blurb: str, prompts: list[str], on_prompt, on_download, parent=None):
        super().__init__(parent)
        self.role = "welcome"                # in the column with the messages (by role)
        self.setObjectName("welcome")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(14, 12, 14, 12)
        lay.setSpacing(6)
        title = QLabel("<b>Try the demo model</b>")
        self.blurb = QLabel(blurb)
        self.blurb.setWordWrap(True)
        lay.addWidget(title)
        lay.addWidget(self.blurb)
        self.buttons = []
        for text in prompts:
            b = QPushButton(text)
            b.setObjectName("example_prompt")
            b.setToolTip("Send this message")
            b.clicked.connect(lambda _c=False, t=text: on_prompt(t))
            lay.addWidget(b, 0, Qt.AlignLeft)
            self.buttons.append(b)
        self.download = QLabel('<a href="download">Get Kimi K3 itself in the Download '
                               'tab</a>')
        self.download.setObjectName("hint")
        self.download.linkActivated.connect(lambda _l: on_download())
        lay.addWidget(self.download)


class MessageInput(QPlainTextEdit):
    """The message box: Enter (or Ctrl+Enter) sends, Shift+Enter starts a new line, Tab
    and Shift+Tab move the focus (a tab character is never what a chat message wants)."""

    submitted = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setTabChangesFocus(True)

    def keyPressEvent(self, e) -> None:
        if e.key() in (Qt.Key_Return, Qt.Key_Enter):
            if e.modifiers() & Qt.ShiftModifier:
                # a plain "\n": Qt's own Shift+Enter inserts U+2028, a line separator that
                # would reach the model as a different character
                self.insertPlainText("\n")
            else:
                self.submitted.emit()
            e.accept()
            return
        super().keyPressEvent(e)


# what a reply's stats line needs from the turn summary: kept with the conversation (its
# meta file) so the line shows again when the conversation is reopened
STATS_KEYS = ("n", "continued", "prompt_ids", "reused", "first_token_seconds",
              "prefill_positions_per_s", "tokens_per_s", "decode_s_per_token", "read_bytes",
              "end_name", "peak_rss_bytes", "stats")


def _rate(x: float) -> str:
    return f"{x:.3g}" if x < 1000 else f"{x:.0f}"


def stats_text(info: dict, details: bool = False) -> str:
    """Per-reply figures.  The first token carries the whole prefill, so the decode rate
    (tokens/s and s/token) is taken over the tokens after it; a one-token reply has none.
    The prefill breakdown and the end id are the engine's vocabulary: `details` only."""
    if info.get("stats"):                 # a remote reply: only what the server can tell
        return info["stats"]
    n = info["n"]
    parts = [f"{n} token{'s' if n != 1 else ''}"
             + (f" (continued after {info['continued']})" if info.get("continued") else "")]
    first = human_seconds(info["first_token_seconds"])
    if info.get("continued"):
        parts.append(f"first new token {first}")
    elif details:
        new = info["prompt_ids"] - info["reused"]
        parts.append(f"first token {first} (prefill {new} "
                     f"position{'s' if new != 1 else ''} at "
                     f"{_rate(info.get('prefill_positions_per_s', 0.0))}/s; "
                     f"{info['reused']} of {info['prompt_ids']} reused)")
    else:
        parts.append(f"first token {first}")
    if n > 1:
        parts.append(f"decode {_rate(info['tokens_per_s'])} tokens/s = "
                     f"{human_seconds(info['decode_s_per_token'])}/token after the first")
    if info.get("read_bytes") is not None:
        parts.append(f"read {human(info['read_bytes'])}" if info["read_bytes"] else
                     "nothing read from disk")
    parts.append(f"peak RSS {human(info['peak_rss_bytes'])}")
    if details and info.get("end_name"):
        parts.append(f"ended by {info['end_name']}")
    return " · ".join(parts)


def progress_text(p: dict) -> str:
    """Prefill progress: layers done of the prompt pass, elapsed time and an ETA from the
    layers done so far (the engine's LoadProgress)."""
    frac = p["done_bytes"] / p["total_bytes"] if p.get("total_bytes") else 0.0
    eta = p.get("eta_s")
    left = f" · about {human_seconds(eta)} left" if eta is not None else ""
    return (f"Reading the prompt: {p['prompt_ids']} positions · layer {p['layers']}/"
            f"{p.get('n_layers') or '?'} ({100 * frac:.0f}%) · "
            f"{human_seconds(p.get('elapsed_s', 0))} elapsed{left}")


class ChatPanel(QWidget):
    changed = Signal()                 # a chat setting changed (the window persists it)
    replyStatsChanged = Signal(object)  # {transcript index (str): stats} to keep in the meta
    downloadRequested = Signal()        # the welcome card's pointer to the Download tab

    def __init__(self, host, spec_fn: Callable[[], RunSpec], parent=None):
        super().__init__(parent)
        self.host = host
        self._spec_fn = spec_fn
        self.messages: list[dict] = []
        # transcript index of a reply -> its turn's figures (STATS_KEYS).  By index, set
        # from the turn that made it: the local engine sends the transcript before the turn
        # summary and a remote one after, so counting replies at the summary is off by one.
        self.reply_stats: dict[int, dict] = {}
        self._reply_index = 0                    # where the reply in flight will go
        self.details = False                     # the engine's vocabulary in the stats
        self.examples: list[str] = []            # the welcome card's prompts (demo only)
        self.examples_blurb = ""
        self.welcome: WelcomeCard | None = None
        self.draft: dict | None = None           # a failed reply (not in the conversation)
        self.pending: dict | None = None         # the incomplete last reply (the worker's)
        self.pending_stats = ""
        self.editing: int | None = None          # index of the user message being edited
        self.live: MessageWidget | None = None   # the reply being streamed
        self.generating = False
        self.loaded = False
        self._follow = True
        self._turn_info: dict | None = None
        self._prefilling = False

        # -- conversation bar ---------------------------------------------------------
        # the two side panels' toggles frame the model line (the window wires them)
        bar = QHBoxLayout()
        self.list_toggle = QToolButton()
        self.list_toggle.setObjectName("panel_toggle")
        self.list_toggle.setText("☰")
        self.list_toggle.setCheckable(True)
        self.list_toggle.setToolTip("Show or hide the conversation list (Ctrl+Shift+L)")
        self.model_label = QLabel("No model loaded: load one in Setup.")
        self.model_label.setObjectName("hint")
        self.model_label.setWordWrap(True)
        self.details_toggle = QToolButton()
        self.details_toggle.setText("Details")
        self.details_toggle.setCheckable(True)
        self.details_toggle.setToolTip("Show the engine's own terms and figures: prefill "
                                       "breakdown, end ids, resident hits, binds")
        self.details_toggle.toggled.connect(self.set_details)
        self.side_toggle = QToolButton()
        self.side_toggle.setObjectName("panel_toggle")
        self.side_toggle.setText("Panel")
        self.side_toggle.setCheckable(True)
        self.side_toggle.setToolTip("Show or hide the telemetry and settings panel "
                                    "(Ctrl+Shift+P)")
        bar.addWidget(self.list_toggle, 0, Qt.AlignTop)
        bar.addWidget(self.model_label, 1)     # New / Open / Export: the sidebar and menus
        bar.addWidget(self.details_toggle, 0, Qt.AlignTop)
        bar.addWidget(self.side_toggle, 0, Qt.AlignTop)

        self.system = QLineEdit()
        self.system.setPlaceholderText("System prompt (optional): applies to this conversation")
        self.system.setToolTip("The conversation's system message (k3 --system). Changing it "
                               "re-renders the whole transcript, so the next turn prefills "
                               "from scratch.")

        # -- the transcript -----------------------------------------------------------
        self.scroll = QScrollArea()
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QFrame.NoFrame)
        self.canvas = QWidget()
        self.column = QVBoxLayout(self.canvas)
        self.column.setSpacing(8)
        self.column.addStretch(1)
        self.scroll.setWidget(self.canvas)
        self.scroll.verticalScrollBar().rangeChanged.connect(self._autoscroll)
        self.scroll.verticalScrollBar().valueChanged.connect(self._user_scrolled)

        # -- first-token progress --------------------------------------------------------
        # a thin bar with its words beside it (inside the bar they were cut off)
        self.prefill = QProgressBar()
        self.prefill.setVisible(False)
        self.prefill.setTextVisible(False)
        self.prefill.setMaximumHeight(8)
        self.prefill_text = QLabel()
        self.prefill_text.setObjectName("hint")
        self.prefill_text.setWordWrap(True)
        self.prefill_text.setVisible(False)

        # -- generation settings -----------------------------------------------------
        gen_box = QGroupBox("Generation")
        g = QHBoxLayout(gen_box)
        self.thinking = QCheckBox("Thinking")
        self.thinking.setToolTip("Let the model think before answering (off = k3 --no-think)")
        self.effort = QComboBox()
        self.effort.addItems(["low", "high", "max"])
        self.effort.setToolTip("Thinking effort (k3 --thinking-effort)")
        self.limit = QSpinBox()
        self.limit.setRange(1, 4096)
        self.limit.setPrefix("limit ")
        self.limit.setSuffix(" tokens")
        self.limit.setToolTip("Generation limit per reply (k3 --gen). A reply that reaches it "
                              "without an end id is not added to the conversation.")
        self.greedy = QCheckBox("Greedy")
        self.greedy.setToolTip("Always take the most likely token (deterministic)")
        self.temperature = QDoubleSpinBox()
        self.temperature.setRange(0.01, 5.0)
        self.temperature.setSingleStep(0.05)
        self.temperature.setPrefix("T ")
        self.temperature.setToolTip("Sampling temperature (k3 --temperature)")
        self.top_p = QDoubleSpinBox()
        self.top_p.setRange(0.01, 1.0)
        self.top_p.setSingleStep(0.01)
        self.top_p.setPrefix("top-p ")
        self.top_p.setToolTip("Nucleus sampling mass (k3 --top-p)")
        self.top_k = QSpinBox()
        self.top_k.setRange(0, 100000)
        self.top_k.setPrefix("top-k ")
        self.top_k.setSpecialValueText("top-k off")
        self.top_k.setToolTip("Keep only the k most likely tokens (k3 --top-k; 0 = off)")
        self.seed = QSpinBox()
        self.seed.setRange(0, 2**31 - 1)
        self.seed.setPrefix("seed ")
        self.seed.setSpecialValueText("seed: clock")
        self.seed.setToolTip("PCG32 seed (k3 --seed); 0 = a fresh seed from the clock")
        g.setSpacing(6)
        # a spin box's size hint is its widest text ("seed 2147483647"): let them shrink
        for w in (self.limit, self.temperature, self.top_p, self.top_k, self.seed):
            w.setMinimumWidth(80)
        # two to a row, for a side panel ~300 px wide; the sampling rows show only when
        # sampling is on (greedy ignores them)
        rows = QVBoxLayout()
        for pair in ((self.thinking, self.effort), (self.limit, self.greedy),
                     (self.temperature, self.top_p), (self.top_k, self.seed)):
            row = QHBoxLayout()
            for w in pair:
                row.addWidget(w, 1)
            rows.addLayout(row)
        g.addLayout(rows)

        # -- input --------------------------------------------------------------------
        self.input = MessageInput()
        self.input.setObjectName("message_input")
        self.input.setPlaceholderText("Message K3…  (Enter sends, Shift+Enter: new line, "
                                      "Esc stops)")
        self.input.setMaximumHeight(80)
        self.send_btn = QPushButton("Send")
        self.send_btn.setObjectName("primary")
        self.stop_btn = QPushButton("Stop")
        self.stop_btn.setObjectName("danger")
        self.stop_btn.setToolTip("Stop after the token being computed (a safe point)")
        self.continue_btn = QPushButton("Continue")
        self.continue_btn.setToolTip("Resume the stopped reply where it stopped, from the "
                                     "retained state (the same tokens as if it had not "
                                     "stopped), for up to the limit more tokens")
        self.regen_btn = QPushButton("Regenerate")
        self.regen_btn.setToolTip("Answer the last message again")
        self.edit_btn = QPushButton("Edit")
        self.edit_btn.setToolTip("Edit your last message (Edit on any message of yours "
                                 "edits that one)")
        # one row under the message box: the rarer actions left, Stop and Send right (a
        # column of five buttons took the conversation's height at 1024x700)
        btnrow = QHBoxLayout()
        for b in (self.continue_btn, self.regen_btn, self.edit_btn):
            b.setObjectName("small")
            btnrow.addWidget(b)
        btnrow.addStretch(1)
        # as wide as "Stopping…" from the start: the row never grows the window mid-reply
        self.stop_btn.setMinimumWidth(self.stop_btn.fontMetrics().horizontalAdvance(
            "Stopping…") + 36)
        btnrow.addWidget(self.stop_btn)
        btnrow.addWidget(self.send_btn)
        self.edit_bar = NoticeBar("Cancel")
        self.edit_label, self.edit_cancel = self.edit_bar.label, self.edit_bar.button

        cmdrow = QHBoxLayout()
        cmdrow.setContentsMargins(0, 0, 0, 0)
        self.command = QLineEdit()
        self.command.setReadOnly(True)
        self.command.setObjectName("command")
        self.command.setToolTip("The k3 command line that runs the same thing")
        copy = QPushButton("Copy")
        copy.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.command.text()))
        cmdrow.addWidget(QLabel("k3"))
        cmdrow.addWidget(self.command, 1)
        cmdrow.addWidget(copy)

        # the settings of the conversation, for the window's side panel: the system
        # prompt, generation, and the k3 command line that runs the same thing
        self.settings_box = QWidget()
        sl = QVBoxLayout(self.settings_box)
        sl.setContentsMargins(4, 4, 4, 4)
        sl.addWidget(QLabel("<b>System prompt</b>"))
        sl.addWidget(self.system)
        sl.addWidget(gen_box)
        self.gen_box = gen_box
        self.command_row = QWidget()
        self.command_row.setLayout(cmdrow)
        sl.addWidget(QLabel("<b>Command line</b>"))
        sl.addWidget(self.command_row)
        sl.addStretch(1)

        lay = QVBoxLayout(self)
        lay.addLayout(bar)
        lay.addWidget(self.scroll, 1)
        lay.addWidget(self.prefill_text)
        lay.addWidget(self.prefill)
        lay.addWidget(self.edit_bar)
        lay.addWidget(self.input)
        lay.addLayout(btnrow)

        # -- wiring -------------------------------------------------------------------
        self.send_btn.clicked.connect(self.send)
        self.stop_btn.clicked.connect(self.stop)
        self.regen_btn.clicked.connect(self.regenerate)
        self.continue_btn.clicked.connect(self.continue_reply)
        self.edit_btn.clicked.connect(self.edit_last)
        self.edit_cancel.clicked.connect(self.cancel_edit)
        self.system.editingFinished.connect(self._system_edited)
        self.input.submitted.connect(self.send)
        # Esc stops a reply anywhere in the window; enabled only while one is generated so
        # it never steals Esc from an editor (renaming a conversation) otherwise.
        self.esc = QShortcut(QKeySequence(Qt.Key_Escape), self, self.stop,
                             context=Qt.WindowShortcut)
        self.esc.setEnabled(False)
        for w in (self.thinking, self.greedy):
            w.toggled.connect(self._settings_changed)
        self.effort.currentIndexChanged.connect(self._settings_changed)
        for w in (self.limit, self.top_k, self.seed):
            w.valueChanged.connect(self._settings_changed)
        for w in (self.temperature, self.top_p):
            w.valueChanged.connect(self._settings_changed)
        host.conversation.connect(self.show_conversation)
        host.turnStarted.connect(self._turn_started)
        host.records.connect(self.on_records)
        host.prefillProgress.connect(self._prefill_progress)
        host.turnFinished.connect(self._turn_finished)
        host.busyChanged.connect(self._busy_changed)
        host.pendingChanged.connect(self._pending_changed)
        self._update_buttons()

    # -- settings in and out ---------------------------------------------------------
    def load_from(self, s) -> None:
        widgets = (self.thinking, self.effort, self.limit, self.greedy, self.temperature,
                   self.top_p, self.top_k, self.seed, self.system)
        for w in widgets:
            w.blockSignals(True)
        try:
            self.thinking.setChecked(s.thinking)
            self.effort.setCurrentText(s.effort)
            self.limit.setValue(s.gen)
            self.greedy.setChecked(s.greedy)
            self.temperature.setValue(s.temperature)
            self.top_p.setValue(s.top_p)
            self.top_k.setValue(s.top_k)
            self.seed.setValue(s.seed)
            self.system.setText(s.system_prompt)
        finally:
            for w in widgets:
                w.blockSignals(False)
        self._sampling_enabled()

    def values(self) -> dict:
        return dict(thinking=self.thinking.isChecked(), effort=self.effort.currentText(),
                    gen=self.limit.value(), greedy=self.greedy.isChecked(),
                    temperature=self.temperature.value(), top_p=self.top_p.value(),
                    top_k=self.top_k.value(), seed=self.seed.value(),
                    system_prompt=self.system.text())

    def _settings_changed(self, *_a) -> None:
        self._sampling_enabled()
        self.changed.emit()
        self.show_command()

    def _sampling_enabled(self) -> None:
        on = not self.greedy.isChecked()
        for w in (self.temperature, self.top_p, self.top_k, self.seed):
            w.setEnabled(on)
            w.setVisible(on)
        self.effort.setEnabled(self.thinking.isChecked())

    def show_command(self) -> None:
        from .runspec import command_line
        spec = self._spec_fn()
        self.command.setText(command_line(spec)[3:] if spec.model_dir else "")
        self.command.setCursorPosition(0)

    def set_model(self, text: str, loaded: bool) -> None:
        self.loaded = loaded
        self.model_label.setText(text)
        self._update_buttons()
        self.show_command()

    # -- actions -------------------------------------------------------------------
    def send(self) -> None:
        text = self.input.toPlainText().strip()
        if not text or self.generating or not self.loaded:
            return
        self.draft = None
        self.input.clear()
        self.input.setFocus()
        self.generating = True          # until turnFinished (or an error before it)
        editing, self.editing = self.editing, None
        self.edit_bar.hide()
        self._update_buttons()
        if editing is not None:
            self.host.edit(editing, text, self._spec_fn())
        else:
            self.host.send(text, self._spec_fn())

    def continue_reply(self) -> None:
        if self.generating or not self.loaded or not (self.pending or {}).get("continuable"):
            return
        self.draft = None
        self.generating = True
        self._update_buttons()
        self.input.setFocus()
        self.host.continue_reply(self._spec_fn())

    def regenerate(self) -> None:
        if self.generating or not self.loaded:
            return
        self.draft = None
        self.generating = True
        self._update_buttons()
        self.host.regenerate(self._spec_fn())

    def stop(self) -> None:
        if not self.generating:
            if self.editing is not None:
                self.cancel_edit()       # Esc while editing: back to a new message
            return
        self.host.stop()
        # focus first: disabling the focused Stop button would hand the focus to the next
        # widget in the chain (it was the command-line field)
        self.input.setFocus()
        self.stop_btn.setEnabled(False)
        self.stop_btn.setText("Stopping…")

    def edit_last(self) -> None:
        last = next((i for i in range(len(self.messages) - 1, -1, -1)
                     if self.messages[i]["role"] == "user"), None)
        if last is not None:
            self.begin_edit(last)

    def begin_edit(self, index: int) -> None:
        """Put message `index` (a user message) into the box; Send forks the conversation
        there (the worker reuses the state up to it)."""
        if self.generating or not (0 <= index < len(self.messages)) \
                or self.messages[index]["role"] != "user":
            return
        self.editing = index
        k = sum(1 for m in self.messages[:index + 1] if m["role"] == "user")
        later = sum(1 for m in self.messages[index + 1:] if m["role"] != "system") + \
            (1 if self.pending else 0)
        self.edit_label.setText(f"Editing your message {k}: Send answers the edited text"
                                + (f"; the {later} message{'s' if later != 1 else ''} after "
                                   f"it will be dropped" if later else "") + ".")
        self.edit_bar.show()
        self.input.setPlainText(self.messages[index]["content"])
        self.input.setFocus()
        self._update_buttons()

    def cancel_edit(self) -> None:
        self.editing = None
        self.edit_bar.hide()
        self.input.clear()
        self.input.setFocus()
        self._update_buttons()

    def reset_view(self) -> None:
        """Another conversation (new or opened): its replies' stats and draft are not ours."""
        self.draft = None
        self.reply_stats.clear()
        self.pending_stats = ""
        if self.editing is not None:
            self.cancel_edit()

    def set_reply_stats(self, stored: dict | None) -> None:
        """The stats kept with an opened conversation ({index: figures}, as in its meta)."""
        self.reply_stats = {int(k): dict(v) for k, v in (stored or {}).items()}
        if not self.generating:
            self._render()

    def set_examples(self, prompts: list[str], blurb: str = "") -> None:
        """Example prompts for an empty conversation (the demo model's); [] for none."""
        self.examples, self.examples_blurb = list(prompts), blurb
        if not self.generating:
            self._render()

    def send_example(self, text: str) -> None:
        self.input.setPlainText(text)
        self.send()

    def set_details(self, on: bool) -> None:
        self.details = on
        if not self.generating:
            self._render()

    def _stats_line(self, index: int) -> str:
        st = self.reply_stats.get(index)
        return stats_text(st, self.details) if st else ""

    def _stats_changed(self) -> None:
        self.replyStatsChanged.emit({str(k): v for k, v in self.reply_stats.items()})

    def open_conversation(self, path: str) -> None:
        self.reset_view()
        self.host.open_conversation(path)

    def _system_edited(self) -> None:
        current = next((m["content"] for m in self.messages if m["role"] == "system"), "")
        if self.system.text() != current:
            self.host.set_system(self.system.text())
            self.changed.emit()

    # -- observations --------------------------------------------------------------
    def show_conversation(self, msgs: list) -> None:
        self.messages = list(msgs)
        # a shorter transcript (Edit, Regenerate, take back): the dropped replies' stats go;
        # index len(msgs) may be the incomplete reply's, shown after the transcript
        gone = [k for k in self.reply_stats if k > len(msgs)]
        for k in gone:
            del self.reply_stats[k]
        if gone:
            self._stats_changed()
        sysmsg = next((m["content"] for m in msgs if m["role"] == "system"), None)
        if sysmsg is not None and not self.system.hasFocus():
            self.system.blockSignals(True)
            self.system.setText(sysmsg)
            self.system.blockSignals(False)
        if not self.generating:
            self._render()
        else:
            self._render(keep_live=True)
        self._update_buttons()

    def _clear(self, keep: QWidget | None = None) -> None:
        while self.column.count() > 1:
            item = self.column.takeAt(0)
            w = item.widget()
            if w is not None and w is not keep:
                w.deleteLater()

    def _render(self, keep_live: bool = False) -> None:
        live = self.live if keep_live else None
        self._clear(keep=live)
        self.welcome = None
        if self.examples and live is None and self.pending is None and self.draft is None \
                and not any(m["role"] != "system" for m in self.messages):
            self.welcome = WelcomeCard(self.examples_blurb, self.examples, self.send_example,
                                       self.downloadRequested.emit)
            for b in self.welcome.buttons:
                b.setEnabled(self.loaded and not self.host.busy)
            self.column.insertWidget(self.column.count() - 1, self.welcome)
        for i, m in enumerate(self.messages):
            if m["role"] == "system":
                continue                 # shown in the system field above
            stats = note = ""
            if m["role"] == "assistant":
                stats = self._stats_line(i)
                if m.get("incomplete"):
                    note = "This reply was cut short (stopped or at the limit) and answered " \
                           "as it was."
            w = MessageWidget(m["role"], m["content"], m["reasoning"], stats, note)
            w.index = i
            if m["role"] == "user":
                w.edit_btn.clicked.connect(lambda _c=False, i=i: self.begin_edit(i))
                w.edit_btn.setEnabled(not self.generating)
            self.column.insertWidget(self.column.count() - 1, w)
        if live is not None:
            self.column.insertWidget(self.column.count() - 1, live)
        elif self.pending is not None:
            p = self.pending
            w = MessageWidget("assistant", p["content"], p.get("reasoning"),
                              self._stats_line(len(self.messages)) or self.pending_stats,
                              self._pending_note(p))
            w.setObjectName("incomplete")
            w.set_reasoning(p.get("reasoning"), expanded=not p["content"])
            self.column.insertWidget(self.column.count() - 1, w)
        elif self.draft is not None:
            d = self.draft
            w = MessageWidget("assistant", d["content"], d["reasoning"], d["stats"], d["note"])
            w.set_reasoning(d["reasoning"], expanded=not d["content"])
            self.column.insertWidget(self.column.count() - 1, w)
        if not keep_live:
            self.live = None

    @staticmethod
    def _pending_note(p: dict) -> str:
        n = len(p.get("ids") or ())
        why = (f"Stopped after {n} tokens" if p.get("why") == "stopped" else
               f"Reached the generation limit ({n} tokens) before the reply ended")
        how = p.get("how") or (  # a remote reply says why it cannot be continued
               "Continue resumes it exactly where it stopped; Regenerate answers again; or "
               "reply to it as it is." if p.get("continuable") else
               "It was kept from an earlier session, so it cannot be continued: Regenerate "
               "answers again, or reply to it as it is.")
        return f"{why}: an incomplete reply. {how}"

    def _pending_changed(self, p) -> None:
        self.pending = p
        if p is None:
            self.pending_stats = ""
        if not self.generating:
            self._render()
        self._update_buttons()

    def _turn_started(self, info: dict) -> None:
        self.generating = True
        self._turn_info = info
        # the reply goes after the transcript as sent for this turn; whatever stats sat at
        # or after that index belonged to a reply this turn replaces
        self._reply_index = len(self.messages)
        stale = [k for k in self.reply_stats if k >= self._reply_index]
        for k in stale:
            del self.reply_stats[k]
        if stale:
            self._stats_changed()
        self.command.setText(info["command"][3:])
        self.command.setCursorPosition(0)
        prior = info.get("prior")
        if prior:                        # Continue: the reply goes on in the same bubble
            self.live = MessageWidget("assistant", prior["content"], prior.get("reasoning"))
        else:
            self.live = MessageWidget("assistant", reasoning="" if info["thinking"] else None)
        if self.welcome is not None:     # the first message was sent: the card goes
            self.column.removeWidget(self.welcome)
            self.welcome.deleteLater()
            self.welcome = None
        # the incomplete reply (last in the column) gives way to the live one
        last = self.column.itemAt(self.column.count() - 2) if self.column.count() > 1 else None
        if last is not None and last.widget() is not None and \
                last.widget().objectName() == "incomplete":
            old = last.widget()
            self.column.removeWidget(old)
            old.deleteLater()
        self.column.insertWidget(self.column.count() - 1, self.live)
        self._prefilling = not prior
        self._show_prefill(not prior)
        self.prefill.setRange(0, 0)      # busy until the first token or a progress report
        self.prefill_text.setText(f"Reading the prompt: {info['prompt_ids']} positions…")
        self._follow = True
        self._update_buttons()

    def _prefill_progress(self, p: dict) -> None:
        if not self._prefilling or not p.get("total_bytes"):
            return
        self.prefill.setRange(0, 1000)
        self.prefill.setValue(int(1000 * min(1.0, p["done_bytes"] / p["total_bytes"])))
        self.prefill_text.setText(progress_text(p))

    def _show_prefill(self, on: bool) -> None:
        self.prefill.setVisible(on)
        self.prefill_text.setVisible(on)

    def on_records(self, records: list) -> None:
        if self.live is None:
            return
        if self._prefilling:
            self._prefilling = False
            self._show_prefill(False)
        think, content = [], []
        for r in records:
            (think if r["phase"] == "thinking" else content).append(r["text_delta"])
        self.live.append_thinking("".join(think))
        self.live.append_content("".join(content))
        last = records[-1]
        gen = self._turn_info["gen"] if self._turn_info else 0
        done = self._turn_info.get("resumed", 0) if self._turn_info else 0
        self.live.set_stats(f"token {last['i']}/{done + gen} · {human_seconds(last['seconds'])} "
                            f"for the last token")

    def _turn_finished(self, info: dict) -> None:
        self._prefilling = False
        self._show_prefill(False)
        self.generating = False
        live = self.live
        if live is not None:
            live.flush()
        self.input.setFocus()            # ready for the next message, whatever happened
        self.live = None
        if info.get("failed"):
            if live is not None and (live.content_text or live.reasoning_text):
                self.draft = dict(content=live.content_text,
                                  reasoning=live.reasoning_text if live.has_thinking
                                  else None, stats="",
                                  note="The reply failed (see the error); the conversation "
                                       "is unchanged. Send again or regenerate.")
            self.host.refresh_conversation()
            self._update_buttons()
            return
        self.draft = None
        figures = {k: info[k] for k in STATS_KEYS if info.get(k) is not None}
        # only a Continue continues (its turn started from the stopped reply): a
        # regenerated reply is new, whatever the summary's count says
        prior = (self._turn_info or {}).get("prior")
        figures["continued"] = info.get("continued", 0) if prior else 0
        self.reply_stats[self._reply_index] = figures
        self.pending_stats = "" if info["end_id"] is not None else \
            stats_text(figures, self.details)
        self._stats_changed()
        self._render()
        self._update_buttons()

    def _busy_changed(self, _busy: bool) -> None:
        self._update_buttons()

    def _update_buttons(self) -> None:
        busy = self.host.busy or self.generating
        self.send_btn.setEnabled(self.loaded and not busy)
        self.send_btn.setText("Send edit" if self.editing is not None else "Send")
        if self.stop_btn.hasFocus() and not self.generating:
            self.input.setFocus()
        self.stop_btn.setEnabled(self.generating)
        self.esc.setEnabled(self.generating or self.editing is not None)
        if not self.generating:
            self.stop_btn.setText("Stop")
        has_user = any(m["role"] == "user" for m in self.messages)
        self.continue_btn.setEnabled(self.loaded and not busy and
                                     bool((self.pending or {}).get("continuable")))
        self.regen_btn.setEnabled(self.loaded and not busy and has_user)
        self.edit_btn.setEnabled(not busy and has_user)
        if self.welcome is not None:
            for b in self.welcome.buttons:
                b.setEnabled(self.loaded and not busy)

    # -- scrolling: follow the stream unless the person scrolled up ----------------------
    def _user_scrolled(self, v: int) -> None:
        sb = self.scroll.verticalScrollBar()
        self._follow = v >= sb.maximum() - 4

    def _autoscroll(self, _lo: int, hi: int) -> None:
        if self._follow:
            QTimer.singleShot(0, self, self._scroll_to_end)   # context: dropped if deleted

    def _scroll_to_end(self) -> None:
        sb = self.scroll.verticalScrollBar()
        sb.setValue(sb.maximum())
