"""Keyboard and text through the real window: Enter sends, Shift+Enter is a newline, Esc
stops, Tab moves the focus, the focus comes back to the message box; replies render as
Markdown with code blocks and copy buttons, re-rendered at most every RENDER_MS."""
from __future__ import annotations

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QFontMetricsF, QGuiApplication
from PySide6.QtWidgets import QApplication

from k3studio import markdown_view
from k3studio.markdown_view import CodeBlock, MarkdownView, ProseBlock, split_blocks

from .app_helpers import TIMEOUT, load

REPLY = ("Here is **bold** and `inline`.\n\n```python\ndef f(x):\n    return x + 1\n```\n\n"
         "After the code.")


def _active(qtbot, window):
    window.activateWindow()
    qtbot.waitUntil(lambda: QApplication.activeWindow() is window, timeout=TIMEOUT)
    window.tabs.setCurrentIndex(2)
    window.chat.input.setFocus()
    qtbot.waitUntil(lambda: window.chat.input.hasFocus(), timeout=TIMEOUT)


def test_enter_sends_and_shift_enter_is_a_newline(qtbot, window, demo_model):
    load(qtbot, window, *demo_model)
    _active(qtbot, window)
    box = window.chat.input
    started = []
    window.host.turnStarted.connect(started.append)
    qtbot.keyClicks(box, "line one")
    qtbot.keyClick(box, Qt.Key_Return, Qt.ShiftModifier)
    qtbot.keyClicks(box, "line two")
    assert box.toPlainText() == "line one\nline two"        # "\n", not U+2028
    assert not started and not window.host.busy
    with qtbot.waitSignal(window.host.turnFinished, timeout=TIMEOUT):
        qtbot.keyClick(box, Qt.Key_Return)
    assert box.toPlainText() == ""
    users = [m["content"] for m in window.host.messages if m["role"] == "user"]
    assert users == ["line one\nline two"]
    qtbot.waitUntil(lambda: window.host.messages[-1]["role"] == "user", timeout=TIMEOUT)
    assert box.hasFocus(), QApplication.focusWidget()        # ready for the next one


def test_esc_stops_and_the_focus_returns_to_the_message_box(qtbot, window, demo_model):
    window.chat.limit.setValue(4096)
    load(qtbot, window, *demo_model)
    _active(qtbot, window)
    pressed = []

    def esc(_records):
        if not pressed:
            pressed.append(1)
            qtbot.keyClick(window.chat.input, Qt.Key_Escape)
    window.host.records.connect(esc)
    window.chat.input.setPlainText("Tell me a long story")
    with qtbot.waitSignal(window.host.turnFinished, timeout=TIMEOUT) as b:
        qtbot.keyClick(window.chat.input, Qt.Key_Enter)         # the keypad's Enter too
    window.host.records.disconnect(esc)
    assert b.args[0]["interrupted"] and 1 <= b.args[0]["n"] < 4096
    assert window.chat.input.hasFocus()
    assert not window.chat.esc.isEnabled()       # Esc is free again for other widgets


def test_tab_moves_the_focus(qtbot, window):
    _active(qtbot, window)
    box = window.chat.input
    qtbot.keyClicks(box, "no tabs")
    qtbot.keyClick(box, Qt.Key_Tab)
    assert not box.hasFocus() and "\t" not in box.toPlainText()
    qtbot.keyClick(QApplication.focusWidget(), Qt.Key_Backtab, Qt.ShiftModifier)
    assert box.hasFocus()


def test_menus_carry_the_usual_shortcuts(window):
    a = window.actions_by_name
    assert {n: a[n].shortcut().toString() for n in ("new", "open", "export_jsonl", "quit",
                                                    "settings")} == {
        "new": "Ctrl+N", "open": "Ctrl+O", "export_jsonl": "Ctrl+S", "quit": "Ctrl+Q",
        "settings": "Ctrl+,"}
    titles = [m.title() for m in window.menuBar().findChildren(type(window.menuBar().addMenu("x")))]
    assert {"&File", "&Chat", "&View"} <= set(titles)


def test_markdown_reply_with_a_code_block(qtbot, window, tmp_path):
    path = tmp_path / "md.jsonl"
    path.write_text('{"role":"user","content":"Show me"}\n'
                    + '{"role":"assistant","content":' + __import__("json").dumps(REPLY)
                    + '}\n')
    with qtbot.waitSignal(window.host.conversation, timeout=TIMEOUT):
        window.chat.open_conversation(str(path))
    bubbles = [window.chat.column.itemAt(i).widget() for i in range(window.chat.column.count())]
    reply = [w for w in bubbles if w is not None and w.role == "assistant"][0]
    blocks = reply.content.blocks()
    assert [type(b) for b in blocks] == [ProseBlock, CodeBlock, ProseBlock]
    assert blocks[0].textFormat() == Qt.MarkdownText
    code = blocks[1]
    assert code.lang.text() == "python" and code.text() == "def f(x):\n    return x + 1"
    # what a person sees: the family the block asked for, every glyph as wide as the next
    # (not QFontInfo.fixedPitch(), which is False for Noto Sans Mono, a monospace font)
    assert code.code.font().family() == markdown_view.mono_font().family()
    fm = QFontMetricsF(code.code.font())
    assert len({fm.horizontalAdvance(c * 8) for c in "il0W_m"}) == 1
    code.copy_btn.click()
    assert QGuiApplication.clipboard().text() == "def f(x):\n    return x + 1"
    reply.copy_btn.click()
    assert QGuiApplication.clipboard().text() == REPLY
    # what a person typed is shown as typed, not as Markdown
    user = [w for w in bubbles if w is not None and w.role == "user"][0]
    assert user.content.blocks()[0].textFormat() == Qt.PlainText


def test_split_blocks():
    assert split_blocks("a\n```\nx\n```\nb") == [("prose", "", "a"), ("code", "", "x"),
                                                  ("prose", "", "b")]
    # still streaming: an unclosed fence runs to the end
    assert split_blocks("a\n~~~sh\nls -l") == [("prose", "", "a"), ("code", "sh", "ls -l")]
    # a closing fence needs at least the opening's length
    assert split_blocks("````\n```\n````") == [("code", "", "```")]


@pytest.fixture
def fake_clock(monkeypatch):
    t = [1000.0]
    monkeypatch.setattr(markdown_view.time, "monotonic", lambda: t[0])
    return t


def test_streaming_re_renders_at_most_every_50_ms(qtbot, fake_clock):
    view = MarkdownView()
    qtbot.addWidget(view)
    base = view.renders
    deltas = list(REPLY) * 2            # one character per token
    for ch in deltas:
        fake_clock[0] += 0.010          # a token every 10 ms
        view.append(ch)
    # 10 ms per token with a 50 ms throttle: one render per 5 tokens at most
    assert view.renders - base <= len(deltas) // 5 + 1
    first = view.blocks()[0]
    view.flush()
    full = MarkdownView(REPLY * 2)
    qtbot.addWidget(full)
    assert [b.key for b in view.blocks()] == [b.key for b in full.blocks()]
    assert view.text() == REPLY * 2
    # incremental: the blocks that were finished are the same widgets, not rebuilt
    assert view.blocks()[0] is first


def test_an_open_code_block_streams_as_plain_text(qtbot, fake_clock):
    view = MarkdownView("```python\nx = 1")
    qtbot.addWidget(view)
    renders = view.renders
    fake_clock[0] += 0.001              # inside the throttle window
    view.append("\ny = 2")
    code = view.blocks()[-1]
    assert isinstance(code, CodeBlock) and code.text() == "x = 1\ny = 2"
    assert view.renders == renders      # shown at once, without a re-render
