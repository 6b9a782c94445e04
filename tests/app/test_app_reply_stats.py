"""Each reply's stats line is that reply's: the first reply has one, a later reply does not
show the one before's, a regenerated reply is not "continued", an edit drops the stats of
the branch it drops, and the stats come back when the conversation is reopened (they are
kept in its meta file)."""
from __future__ import annotations

from k3studio.chat_panel import stats_text

from .app_helpers import TIMEOUT, load, send


def _replies(win) -> list:
    col = win.chat.column
    ws = [col.itemAt(i).widget() for i in range(col.count())]
    return [w for w in ws if w is not None and w.role == "assistant"]


def _counted(qtbot, win, act) -> tuple[dict, int]:
    """Run one turn; returns its summary and the per-token records the telemetry got."""
    got = []
    win.host.records.connect(lambda r: got.extend(r))
    try:
        t = act()
    finally:
        win.host.records.disconnect()
        win.host.records.connect(win.plots.on_records)
        win.host.records.connect(win.chat.on_records)
    return t, len(got)


def _line(t: dict) -> str:
    return stats_text(dict(t, continued=0))


def test_each_reply_shows_its_own_stats(qtbot, window):
    from k3studio import demo
    window.chat.limit.setValue(256)
    model, trunk = demo.make_demo(window.data_dir)
    load(qtbot, window, model, trunk)
    turns = []
    for q in ("Hello!", "What is 7 + 5?", "What day comes after Monday?", "Thank you."):
        t, counted = _counted(qtbot, window, lambda q=q: send(qtbot, window, q))
        assert not t["failed"] and t["end_id"] is not None
        assert counted == t["n"], "the telemetry saw another number of tokens"
        turns.append(t)
    qtbot.waitUntil(lambda: len(_replies(window)) == 4, timeout=TIMEOUT)
    shown = [w.stats.text() for w in _replies(window)]
    print("[stats] " + "\n[stats] ".join(shown))
    assert shown == [_line(t) for t in turns]
    assert all(s.startswith(f"{t['n']} token") for s, t in zip(shown, turns))
    # the default view speaks plainly; the engine's vocabulary is behind Details
    summary = window.plots.summary
    assert not any("ended by" in s for s in shown)
    assert "TRUE resident hit" not in summary.text()
    window.chat.details_toggle.click()
    assert all(f"ended by {t['end_name']}" in w.stats.text()
               for w, t in zip(_replies(window), turns))
    assert "TRUE resident hit" in summary.text() and window.settings.details
    window.actions_by_name["details"].trigger()           # View > Engine details: off
    assert not window.chat.details_toggle.isChecked()
    assert [w.stats.text() for w in _replies(window)] == shown

    # Regenerate: a new reply, not a continuation of the one it replaces
    with qtbot.waitSignal(window.host.turnFinished, timeout=TIMEOUT) as b:
        window.chat.regen_btn.click()
    regen = b.args[0]
    qtbot.waitUntil(lambda: len(_replies(window)) == 4, timeout=TIMEOUT)
    last = _replies(window)[-1].stats.text()
    assert "continued" not in last and last == _line(regen)

    # Edit the second message: the replies after it and their stats are dropped
    users = [i for i, m in enumerate(window.chat.messages) if m["role"] == "user"]
    window.chat.begin_edit(users[1])
    window.chat.input.setPlainText("What is 2 + 3?")
    with qtbot.waitSignal(window.host.turnFinished, timeout=TIMEOUT) as b:
        window.chat.send_btn.click()
    edited = b.args[0]
    qtbot.waitUntil(lambda: len(_replies(window)) == 2, timeout=TIMEOUT)
    assert [w.stats.text() for w in _replies(window)] == [shown[0], _line(edited)]
    assert len(window.chat.reply_stats) == 2

    # reopened: the same lines again, from the conversation's meta file
    cid = window.library.current
    with qtbot.waitSignal(window.host.conversation, timeout=TIMEOUT):
        window.actions_by_name["new"].trigger()
    assert _replies(window) == []
    with qtbot.waitSignal(window.host.conversation, timeout=TIMEOUT):
        window.library.open(cid)
    qtbot.waitUntil(lambda: len(_replies(window)) == 2, timeout=TIMEOUT)
    assert [w.stats.text() for w in _replies(window)] == [shown[0], _line(edited)]
