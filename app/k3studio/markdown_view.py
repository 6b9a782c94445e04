"""A message body: Markdown with fenced code blocks, rendered incrementally while it streams.

The text is split into blocks: prose (rendered by Qt's own CommonMark reader, a QLabel in
MarkdownText format) and fenced code (``` or ~~~: a monospace, unwrapped block with a Copy
button).  While tokens stream, `append` re-renders at most every RENDER_MS; in between the
text only accumulates (an open code block gets it appended as plain text at once, which
costs nothing).  A re-render touches only the blocks that changed -- in practice the last
one -- so a long reply does not get slower to stream as it grows.
"""
from __future__ import annotations

import re
import time

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QFontDatabase, QGuiApplication
from PySide6.QtWidgets import (QFrame, QHBoxLayout, QLabel, QScrollArea, QToolButton,
                               QVBoxLayout, QWidget)

RENDER_MS = 50
# An opening fence: up to 3 spaces, ``` or ~~~ (3 or more), an optional info string.
_OPEN = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$")


def split_blocks(text: str) -> list[tuple[str, str, str]]:
    """[(kind, lang, body)] with kind 'prose' or 'code'.  An unclosed fence (a reply still
    streaming, or cut off) runs to the end, as CommonMark says."""
    out: list[tuple[str, str, str]] = []
    buf: list[str] = []
    fence, lang = None, ""
    for line in text.split("\n"):
        if fence is None:
            m = _OPEN.match(line)
            if m:
                if buf and any(s.strip() for s in buf):
                    out.append(("prose", "", "\n".join(buf).strip("\n")))
                buf, fence, lang = [], m.group(1), m.group(2)
                continue
            buf.append(line)
        else:
            s = line.strip()
            if s and s[0] == fence[0] and set(s) == {fence[0]} and len(s) >= len(fence):
                out.append(("code", lang, "\n".join(buf)))
                buf, fence, lang = [], None, ""
                continue
            buf.append(line)
    if fence is not None:
        out.append(("code", lang, "\n".join(buf)))
    elif buf and any(s.strip() for s in buf):
        out.append(("prose", "", "\n".join(buf).strip("\n")))
    return out


def mono_font():
    """The platform's fixed-width font, not a family name (a name like "monospace" can
    resolve to a bitmap font without OpenType tables: Qt then logs "OpenType support
    missing" for every script it shapes)."""
    return QFontDatabase.systemFont(QFontDatabase.FixedFont)


class CodeBlock(QFrame):
    """A fenced code block: language, Copy, the code in monospace (scrolls sideways)."""

    def __init__(self, lang: str, body: str, parent=None):
        super().__init__(parent)
        self.setObjectName("code_block")
        self.kind = "code"
        head = QHBoxLayout()
        head.setContentsMargins(6, 2, 2, 0)
        self.lang = QLabel(lang or "code")
        self.lang.setObjectName("code_lang")
        self.copy_btn = QToolButton()
        self.copy_btn.setText("Copy")
        self.copy_btn.setToolTip("Copy this code")
        self.copy_btn.clicked.connect(self.copy)
        head.addWidget(self.lang, 1)
        head.addWidget(self.copy_btn)
        self.code = QLabel()
        self.code.setTextFormat(Qt.PlainText)
        self.code.setFont(mono_font())
        self.code.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.code.setContentsMargins(8, 4, 8, 6)
        self.code.setAlignment(Qt.AlignLeft | Qt.AlignTop)
        self.area = QScrollArea()
        self.area.setWidget(self.code)
        self.area.setWidgetResizable(True)
        self.area.setFrameShape(QFrame.NoFrame)
        self.area.setVerticalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(0)
        lay.addLayout(head)
        lay.addWidget(self.area)
        self.set(lang, body)

    def set(self, lang: str, body: str) -> None:
        self.key = ("code", lang, body)
        self.lang.setText(lang or "code")
        self.code.setText(body)
        self._fit()

    def append(self, text: str) -> None:
        self.code.setText(self.code.text() + text)
        self.key = ("code", self.key[1], self.code.text())
        self._fit()

    def _fit(self) -> None:
        # tall enough for every line plus the sideways scroll bar when a line is too long
        h = self.code.sizeHint().height()
        if self.code.sizeHint().width() > max(self.area.viewport().width(), 1):
            h += self.area.horizontalScrollBar().sizeHint().height()
        self.area.setFixedHeight(h + 2)

    def resizeEvent(self, e) -> None:
        super().resizeEvent(e)
        self._fit()

    def text(self) -> str:
        return self.code.text()

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.code.text())


class ProseBlock(QLabel):
    def __init__(self, body: str, markdown: bool, parent=None):
        super().__init__(parent)
        self.kind = "prose"
        self.setWordWrap(True)
        self.setTextFormat(Qt.MarkdownText if markdown else Qt.PlainText)
        self.setTextInteractionFlags(Qt.TextBrowserInteraction if markdown
                                     else Qt.TextSelectableByMouse)
        self.setOpenExternalLinks(False)     # no network from a click in a model's reply
        self.set("", body)

    def set(self, _lang: str, body: str) -> None:
        self.key = ("prose", "", body)
        self.setText(body)


class MarkdownView(QWidget):
    """The body of one message.  markdown=False: one plain-text block (user messages,
    thinking), with the same throttled streaming."""

    def __init__(self, text: str = "", markdown: bool = True, parent=None):
        super().__init__(parent)
        self.markdown = markdown
        self._text = ""
        self._blocks: list[QWidget] = []
        self._last = 0.0
        self.renders = 0                       # how many re-renders (tests: throttling)
        self._lay = QVBoxLayout(self)
        self._lay.setContentsMargins(0, 0, 0, 0)
        self._lay.setSpacing(6)
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.timeout.connect(self._render)
        self.set_text(text)

    # -- text in ---------------------------------------------------------------------
    def text(self) -> str:
        return self._text

    def set_text(self, text: str) -> None:
        self._text = text
        self._timer.stop()
        self._render()

    def append(self, delta: str) -> None:
        if not delta:
            return
        self._text += delta
        wait_ms = RENDER_MS - (time.monotonic() - self._last) * 1000.0
        if wait_ms <= 0:                 # due (the timer may be late behind a busy loop)
            self._timer.stop()
            self._render()
            return
        self._cheap_append(delta)
        if not self._timer.isActive():
            self._timer.start(int(wait_ms) + 1)

    def flush(self) -> None:
        """Render what is pending now (end of a stream)."""
        if self._timer.isActive():
            self._timer.stop()
            self._render()

    def _cheap_append(self, delta: str) -> None:
        """Between re-renders: an open code block takes the text as it comes (plain text,
        no parsing); prose waits for the next render (at most RENDER_MS)."""
        last = self._blocks[-1] if self._blocks else None
        # no fence character in the delta: it cannot close the block
        if self.markdown and isinstance(last, CodeBlock) and not {"`", "~"} & set(delta):
            last.append(delta)

    # -- rendering ---------------------------------------------------------------------
    def blocks(self) -> list[QWidget]:
        return list(self._blocks)

    def _render(self) -> None:
        self._last = time.monotonic()
        self.renders += 1
        if self.markdown:
            wanted = split_blocks(self._text)
        else:
            wanted = [("prose", "", self._text)] if self._text else []
        for i, key in enumerate(wanted):
            if i < len(self._blocks):
                w = self._blocks[i]
                if w.key == key:
                    continue
                if w.kind == key[0]:
                    w.set(key[1], key[2])
                    continue
                for old in self._blocks[i:]:      # the kinds diverge: rebuild the rest
                    self._lay.removeWidget(old)
                    old.deleteLater()
                del self._blocks[i:]
            w = (CodeBlock(key[1], key[2]) if key[0] == "code"
                 else ProseBlock(key[2], self.markdown))
            self._blocks.append(w)
            self._lay.addWidget(w)
        for old in self._blocks[len(wanted):]:
            self._lay.removeWidget(old)
            old.deleteLater()
        del self._blocks[len(wanted):]
