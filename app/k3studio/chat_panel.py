"""Chat panel: the conversation, streamed as it is generated, with the thinking block
collapsible, Stop / Regenerate / Edit last, the system prompt, thinking and sampling
settings, conversations as the engine's JSONL history, and stats under every reply.

The conversation itself lives on the engine worker; this panel renders the snapshots it
sends and the per-token records of the reply in flight.  A reply that stops without an end
id (limit reached, Stop pressed, error) is shown as a draft that is not part of the
conversation, which stays usable: send again, regenerate, or edit the last message.
"""
from __future__ import annotations

from typing import Callable

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication, QKeySequence, QShortcut
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFrame,
                               QGroupBox, QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit,
                               QProgressBar, QPushButton, QScrollArea, QSizePolicy, QSpinBox,
                               QToolButton, QVBoxLayout, QWidget)

from k3engine.memory import human

from .markdown_view import MarkdownView
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
        head.addWidget(self.copy_btn)
        lay.addLayout(head)
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


def stats_text(info: dict) -> str:
    n = info["n"]
    parts = [f"{n} token{'s' if n != 1 else ''}",
             f"{info['s_per_token']:.3f} s/token",
             f"first token {info['first_token_seconds']:.2f} s",
             f"{info['reused']} of {info['prompt_ids']} prompt positions reused"]
    if info.get("end_name"):
        parts.append(f"ended by {info['end_name']}")
    parts.append(f"peak RSS {human(info['peak_rss_bytes'])}")
    return " · ".join(parts)


class ChatPanel(QWidget):
    changed = Signal()                 # a chat setting changed (the window persists it)

    def __init__(self, host, spec_fn: Callable[[], RunSpec], parent=None):
        super().__init__(parent)
        self.host = host
        self._spec_fn = spec_fn
        self.messages: list[dict] = []
        self.stats: dict[int, str] = {}          # assistant ordinal -> stats line
        self.draft: dict | None = None           # a reply that is not in the conversation
        self.live: MessageWidget | None = None   # the reply being streamed
        self.generating = False
        self.loaded = False
        self._follow = True
        self._turn_info: dict | None = None
        self._prefilling = False

        # -- conversation bar ---------------------------------------------------------
        bar = QHBoxLayout()
        self.model_label = QLabel("No model loaded: load one in Setup.")
        self.model_label.setObjectName("hint")
        self.model_label.setWordWrap(True)
        bar.addWidget(self.model_label, 1)     # New / Open / Export: the sidebar and menus

        sysrow = QHBoxLayout()
        self.system = QLineEdit()
        self.system.setPlaceholderText("System prompt (optional): applies to this conversation")
        self.system.setToolTip("The conversation's system message (k3 --system). Changing it "
                               "re-renders the whole transcript, so the next turn prefills "
                               "from scratch.")
        sysrow.addWidget(QLabel("System"))
        sysrow.addWidget(self.system, 1)

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
        self.prefill = QProgressBar()
        self.prefill.setVisible(False)
        self.prefill.setTextVisible(True)

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
        row1, row2 = QHBoxLayout(), QHBoxLayout()
        # the sampling row shows only when sampling is on (greedy ignores it), which keeps
        # the panel usable at 1024x700
        for w in (self.thinking, self.effort, self.limit, self.greedy):
            row1.addWidget(w)
        row1.addStretch(1)
        for w in (self.temperature, self.top_p, self.top_k, self.seed):
            row2.addWidget(w)
        row2.addStretch(1)
        rows = QVBoxLayout()
        rows.addLayout(row1)
        rows.addLayout(row2)
        g.addLayout(rows)

        # -- input --------------------------------------------------------------------
        self.input = MessageInput()
        self.input.setObjectName("message_input")
        self.input.setPlaceholderText("Message K3…  (Enter sends, Shift+Enter: new line, "
                                      "Esc stops)")
        self.input.setMaximumHeight(90)
        self.send_btn = QPushButton("Send")
        self.send_btn.setObjectName("primary")
        self.stop_btn = QPushButton("Stop")
        self.stop_btn.setObjectName("danger")
        self.stop_btn.setToolTip("Stop after the token being computed (a safe point)")
        self.regen_btn = QPushButton("Regenerate")
        self.regen_btn.setToolTip("Answer the last message again")
        self.edit_btn = QPushButton("Edit last")
        self.edit_btn.setToolTip("Take the last message back into the input box to edit it")
        col = QVBoxLayout()
        for b in (self.send_btn, self.stop_btn, self.regen_btn, self.edit_btn):
            col.addWidget(b)
        inrow = QHBoxLayout()
        inrow.addWidget(self.input, 1)
        inrow.addLayout(col)

        cmdrow = QHBoxLayout()
        self.command = QLineEdit()
        self.command.setReadOnly(True)
        self.command.setObjectName("command")
        self.command.setToolTip("The k3 command line that runs the same thing")
        copy = QPushButton("Copy")
        copy.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.command.text()))
        cmdrow.addWidget(QLabel("k3"))
        cmdrow.addWidget(self.command, 1)
        cmdrow.addWidget(copy)

        lay = QVBoxLayout(self)
        lay.addLayout(bar)
        lay.addLayout(sysrow)
        lay.addWidget(self.scroll, 1)
        lay.addWidget(self.prefill)
        lay.addWidget(gen_box)
        lay.addLayout(inrow)
        lay.addLayout(cmdrow)

        # -- wiring -------------------------------------------------------------------
        self.send_btn.clicked.connect(self.send)
        self.stop_btn.clicked.connect(self.stop)
        self.regen_btn.clicked.connect(self.regenerate)
        self.edit_btn.clicked.connect(self.edit_last)
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
        self._update_buttons()
        self.host.send(text, self._spec_fn())

    def regenerate(self) -> None:
        if self.generating or not self.loaded:
            return
        self.draft = None
        self.generating = True
        self._update_buttons()
        self.host.regenerate(self._spec_fn())

    def stop(self) -> None:
        if not self.generating:
            return
        self.host.stop()
        # focus first: disabling the focused Stop button would hand the focus to the next
        # widget in the chain (it was the command-line field)
        self.input.setFocus()
        self.stop_btn.setEnabled(False)
        self.stop_btn.setText("Stopping…")

    def edit_last(self) -> None:
        if self.generating:
            return
        last_user = next((m for m in reversed(self.messages) if m["role"] == "user"), None)
        if last_user is None:
            return
        self.draft = None
        self.input.setPlainText(last_user["content"])
        self.host.take_back()
        self.input.setFocus()

    def reset_view(self) -> None:
        """Another conversation (new or opened): its replies' stats and draft are not ours."""
        self.draft = None
        self.stats.clear()

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
        k = 0
        for m in self.messages:
            if m["role"] == "system":
                continue                 # shown in the system field above
            stats = ""
            if m["role"] == "assistant":
                k += 1
                stats = self.stats.get(k, "")
            w = MessageWidget(m["role"], m["content"], m["reasoning"], stats)
            self.column.insertWidget(self.column.count() - 1, w)
        if live is not None:
            self.column.insertWidget(self.column.count() - 1, live)
        elif self.draft is not None:
            d = self.draft
            w = MessageWidget("assistant", d["content"], d["reasoning"], d["stats"], d["note"])
            w.set_reasoning(d["reasoning"], expanded=not d["content"])
            self.column.insertWidget(self.column.count() - 1, w)
            self.live = None
        if not keep_live:
            self.live = None

    def _turn_started(self, info: dict) -> None:
        self.generating = True
        self._turn_info = info
        self.command.setText(info["command"][3:])
        self.command.setCursorPosition(0)
        self.live = MessageWidget("assistant", reasoning="" if info["thinking"] else None)
        self.live.set_note("")
        self.column.insertWidget(self.column.count() - 1, self.live)
        self._prefilling = True
        self.prefill.setVisible(True)
        self.prefill.setRange(0, 0)      # busy until the first token or a progress report
        self.prefill.setFormat(f"prefill: {info['prompt_ids']} prompt positions…")
        self._follow = True
        self._update_buttons()

    def _prefill_progress(self, p: dict) -> None:
        if not self._prefilling or not p.get("total_bytes"):
            return
        self.prefill.setRange(0, 1000)
        self.prefill.setValue(int(1000 * min(1.0, p["done_bytes"] / p["total_bytes"])))
        self.prefill.setFormat(f"prefill: {p['prompt_ids']} prompt positions; trunk "
                               f"{human(p['done_bytes'])} of {human(p['total_bytes'])} read "
                               f"({p['layers']} layer reads)")

    def on_records(self, records: list) -> None:
        if self.live is None:
            return
        if self._prefilling:
            self._prefilling = False
            self.prefill.setVisible(False)
        think, content = [], []
        for r in records:
            (think if r["phase"] == "thinking" else content).append(r["text_delta"])
        self.live.append_thinking("".join(think))
        self.live.append_content("".join(content))
        last = records[-1]
        gen = self._turn_info["gen"] if self._turn_info else 0
        self.live.set_stats(f"token {last['i']}/{gen} · {last['seconds']:.3f} s for the last "
                            f"token")

    def _turn_finished(self, info: dict) -> None:
        self._prefilling = False
        self.prefill.setVisible(False)
        self.generating = False
        live = self.live
        if live is not None:
            live.flush()
        self.input.setFocus()            # ready for the next message, whatever happened
        if info.get("failed"):
            if live is not None and (live.content_text or live.reasoning_text):
                self.draft = dict(content=live.content_text,
                                  reasoning=live.reasoning_text if live.has_thinking
                                  else None, stats="",
                                  note="The reply failed (see the error); the conversation "
                                       "is unchanged. Send again or regenerate.")
            self.live = None
            self.host.refresh_conversation()
            self._update_buttons()
            return
        stats = stats_text(info)
        if info["end_id"] is not None:
            k = sum(1 for m in self.messages if m["role"] == "assistant") + 1
            self.stats[k] = stats
            self.draft = None
        else:
            why = (f"Stopped after {info['n']} tokens" if info["interrupted"] else
                   f"Reached the generation limit of {info['gen']} tokens without an end id")
            self.draft = dict(
                content=(live.content_text if live else "") + (info.get("tail") or ""),
                reasoning=(live.reasoning_text if live else "") if info["thinking"] else None,
                stats=stats,
                note=f"{why}: this reply is not part of the conversation. The conversation is "
                     f"still usable: send a new message (it replaces the unanswered one), "
                     f"Regenerate, or Edit last.")
        self.live = None
        self._update_buttons()

    def _busy_changed(self, _busy: bool) -> None:
        self._update_buttons()

    def _update_buttons(self) -> None:
        busy = self.host.busy or self.generating
        self.send_btn.setEnabled(self.loaded and not busy)
        if self.stop_btn.hasFocus() and not self.generating:
            self.input.setFocus()
        self.stop_btn.setEnabled(self.generating)
        self.esc.setEnabled(self.generating)
        if not self.generating:
            self.stop_btn.setText("Stop")
        has_user = any(m["role"] == "user" for m in self.messages)
        self.regen_btn.setEnabled(self.loaded and not busy and has_user)
        self.edit_btn.setEnabled(not busy and has_user)

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
