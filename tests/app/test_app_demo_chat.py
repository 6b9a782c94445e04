"""The quick start's chat on the trained demo model, through the real window: the demo is
set up in the app's data directory (copied from the package, trunk packed), loaded, and a
two-turn conversation closes both turns (thinking on at the app's default effort, low); it is
saved, reopened and continued."""
from __future__ import annotations

from .app_helpers import TIMEOUT, load, send

from k3engine.chat import History


def test_two_turns_saved_reopened_continued(qtbot, window, tmp_path):
    from k3studio import demo
    window.chat.limit.setValue(256)    # the app's default limit (the test store's is 12)
    model, trunk = demo.make_demo(window.data_dir)
    load(qtbot, window, model, trunk)
    t1 = send(qtbot, window, "Hello!")
    t2 = send(qtbot, window, "What day comes after Monday?")
    print(f"[gate] demo chat in the window: turn 1 {t1['n']} ids, end {t1['end_id']}, "
          f"{t1['content']!r}; turn 2 {t2['n']} ids, end {t2['end_id']}, {t2['content']!r}")
    assert not t1["failed"] and t1["end_id"] is not None
    assert not t2["failed"] and t2["end_id"] is not None
    qtbot.waitUntil(lambda: [m["role"] for m in window.host.messages][-4:] ==
                    ["user", "assistant", "user", "assistant"], timeout=TIMEOUT)
    path = tmp_path / "demo.jsonl"
    window.host.save_conversation(str(path))
    qtbot.waitUntil(lambda: path.exists(), timeout=TIMEOUT)
    saved = list(History.load(str(path)))
    assert [m.role for m in saved if m.role != "system"] == ["user", "assistant"] * 2
    assert all(m.content for m in saved if m.role == "assistant")
    with qtbot.waitSignal(window.host.conversation, timeout=TIMEOUT):
        window.actions_by_name["new"].trigger()         # File > New (Ctrl+N)
    with qtbot.waitSignal(window.host.conversation, timeout=TIMEOUT) as b:
        window.chat.open_conversation(str(path))
    assert len(b.args[0]) == len(saved)
    t3 = send(qtbot, window, "Thank you.")
    assert not t3["failed"] and t3["end_id"] is not None
    qtbot.waitUntil(lambda: len(window.host.messages) == len(saved) + 2, timeout=TIMEOUT)
    assert window.host.messages[-1]["role"] == "assistant"
