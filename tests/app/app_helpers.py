"""Helpers shared by the app tests (drive the window as a person would)."""
from __future__ import annotations

TIMEOUT = 120_000          # ms: generous, never a speed assertion


def load(qtbot, win, model: str, trunk: str = "", tok: str = "") -> dict:
    """Select the directories, wait for the live checks, press Load, wait for the model."""
    win.setup.set_paths(model, trunk, tok)
    qtbot.waitUntil(lambda: win.setup.inspection is not None and not win.setup.validating
                    and win.setup.load_btn.isEnabled(), timeout=TIMEOUT)
    with qtbot.waitSignal(win.host.loaded, timeout=TIMEOUT) as blocker:
        win.setup.load_btn.click()
    qtbot.waitUntil(lambda: not win.host.busy, timeout=TIMEOUT)
    return blocker.args[0]


def send(qtbot, win, text: str, via=None) -> dict:
    """Type a message, press Send, wait for the turn to end; returns the turn summary.
    `via`: the host whose turnFinished ends it (default: this machine's engine)."""
    win.chat.input.setPlainText(text)
    qtbot.waitUntil(lambda: win.chat.send_btn.isEnabled(), timeout=TIMEOUT)
    with qtbot.waitSignal((via or win.host).turnFinished, timeout=TIMEOUT) as blocker:
        win.chat.send_btn.click()
    return blocker.args[0]
