"""The conversation list through the real window: conversations are saved as they happen
(one §9.1 JSONL file each, 0600, titles in a sidecar), renamed, deleted with Undo, searched,
exported, and the last one reopens after a restart with the model it was run on."""
from __future__ import annotations

import json
import os
import stat

from PySide6.QtCore import Qt

from k3engine.chat import History, Message
from k3studio.conversations import Meta

from .app_helpers import TIMEOUT, load, send


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_conversation_is_saved_as_it_happens(qtbot, window, demo_model):
    load(qtbot, window, *demo_model)
    store = window.library.store
    assert store.list() == [] and window.sidebar.list.count() == 0
    assert window.sidebar.empty.isVisible()
    send(qtbot, window, "What is a trunk?")
    qtbot.waitUntil(lambda: window.sidebar.list.count() == 1, timeout=TIMEOUT)
    cid = window.library.current
    path = store.path(cid)
    # the transcript is exactly what the engine's reader takes (k3 --history)
    hist = History.load(path)
    assert [m.role for m in hist][-1] == "user"           # the demo reply hit the limit
    assert hist[-1].content == "What is a trunk?"
    # titles (and all §9.1 cannot hold) live in the sidecar, which k3 never reads
    meta_path = path[:-len(".jsonl")] + ".meta.json"
    meta = json.load(open(meta_path))
    assert meta["title"] == "What is a trunk?" and meta["model_dir"] == demo_model[0]
    assert _mode(path) == 0o600 and _mode(meta_path) == 0o600
    assert window.sidebar.titles() == ["What is a trunk?"]
    # the folder is under the data directory, named once
    assert store.root == os.path.join(window.data_dir, "conversations")


def test_new_rename_search_delete_undo(qtbot, window, tmp_path):
    store = window.library.store
    for q in ("Apples and pears", "Routing experts", "Pears only"):
        cid = store.new_id()
        store.save(cid, History([Message("user", q), Message("assistant", f"re: {q}")]),
                   Meta(cid))
    window.sidebar.refresh()
    assert sorted(window.sidebar.titles()) == ["Apples and pears", "Pears only",
                                               "Routing experts"]
    # search by title and by text (the reply), case-insensitive, every word
    window.sidebar.search.setText("pears")
    assert sorted(window.sidebar.titles()) == ["Apples and pears", "Pears only"]
    window.sidebar.search.setText("RE: routing")
    assert window.sidebar.titles() == ["Routing experts"]
    window.sidebar.search.setText("nothing like this")
    assert window.sidebar.titles() == [] and "Nothing matches" in window.sidebar.empty.text()
    window.sidebar.search.clear()
    # rename in place (the list item's editor), stored in the sidecar
    item = next(window.sidebar.list.item(i) for i in range(3)
                if window.sidebar.list.item(i).text() == "Pears only")
    cid = item.data(Qt.UserRole)
    item.setText("Only pears, renamed")
    assert store.meta(cid).title == "Only pears, renamed"
    assert "Only pears, renamed" in window.sidebar.titles()
    assert History.load(store.path(cid))[0].content == "Pears only"     # transcript untouched
    # open it from the list, then delete it: the window continues in a new conversation
    with qtbot.waitSignal(window.host.conversation, timeout=TIMEOUT) as b:
        window.library.open(cid)
    assert b.args[0][0]["content"] == "Pears only"
    window.sidebar.delete(cid)
    assert not os.path.exists(store.path(cid)) and window.library.current is None
    assert window.sidebar.undo_bar.isVisibleTo(window.sidebar)
    assert "Only pears, renamed" not in window.sidebar.titles()
    window.sidebar.undo_btn.click()
    assert os.path.exists(store.path(cid)) and "Only pears, renamed" in window.sidebar.titles()
    # export: the JSONL is the reference format, the Markdown is readable
    out_j, out_m = tmp_path / "x.jsonl", tmp_path / "x.md"
    window.sidebar.export(cid, str(out_j), "jsonl")
    window.sidebar.export(cid, str(out_m), "md")
    assert History.load(str(out_j)) == History.load(store.path(cid))
    md = out_m.read_text()
    assert md.startswith("# Only pears, renamed") and "## You" in md and "re: Pears only" in md
    # a deletion not undone is final at the next start
    window.sidebar.delete(cid)
    store.purge_trash()
    assert not store.undo_delete(cid)


def test_new_keeps_the_previous_conversation(qtbot, window, demo_model):
    load(qtbot, window, *demo_model)
    send(qtbot, window, "First conversation")
    first = window.library.current
    with qtbot.waitSignal(window.host.conversation, timeout=TIMEOUT) as b:
        window.actions_by_name["new"].trigger()
    assert [m for m in b.args[0] if m["role"] != "system"] == []
    assert window.library.current is None
    send(qtbot, window, "Second conversation")
    qtbot.waitUntil(lambda: window.sidebar.list.count() == 2, timeout=TIMEOUT)
    assert window.library.current != first
    assert window.sidebar.titles() == ["Second conversation", "First conversation"]


def test_new_is_disabled_while_a_reply_runs_and_ready_when_it_ends(qtbot, window, demo_model):
    """A New pressed as a reply ends used to be dropped: the summary (turnFinished) reached
    the window before the engine said it was idle, so the press met a busy engine and the
    next message continued the old conversation."""
    load(qtbot, window, *demo_model)
    new, side = window.actions_by_name["new"], window.sidebar.new_btn
    during, at_end = [], []
    window.host.records.connect(
        lambda r: during.append((window.host.busy, new.isEnabled(), side.isEnabled())))
    window.host.turnFinished.connect(
        lambda info: at_end.append((window.host.busy, new.isEnabled(), side.isEnabled())))
    send(qtbot, window, "First conversation")
    print(f"[gate] (busy, New, sidebar New) while generating {during[0]}, "
          f"at the summary {at_end}")
    assert during and all(d == (True, False, False) for d in during)
    assert at_end == [(False, True, True)]
    with qtbot.waitSignal(window.host.conversation, timeout=TIMEOUT) as b:
        new.trigger()                        # pressed right at the summary: it is taken
    assert [m for m in b.args[0] if m["role"] != "system"] == []


def test_the_last_conversation_and_its_model_reopen_after_restart(qtbot, store, tmp_path,
                                                                  demo_model):
    from k3studio.window import MainWindow
    data = str(tmp_path / "data")
    win = MainWindow(store=store, data_dir=data)
    qtbot.addWidget(win)
    win.show()
    load(qtbot, win, *demo_model)
    send(qtbot, win, "Remember me")
    qtbot.waitUntil(lambda: win.library.current is not None, timeout=TIMEOUT)
    cid = win.library.current
    # another model selected afterwards (not loaded): the conversation still names its own
    win.close()
    store.setValue("model_dir", "")
    store.sync()

    win2 = MainWindow(store=store, data_dir=data)
    qtbot.addWidget(win2)
    with qtbot.waitSignal(win2.host.loaded, timeout=TIMEOUT) as b:
        win2.show()
    assert b.args[0]["model_dir"] == demo_model[0]
    assert win2.library.current == cid
    qtbot.waitUntil(lambda: any(m["content"] == "Remember me" for m in win2.host.messages),
                    timeout=TIMEOUT)
    assert win2.sidebar.list.currentItem().text() == "Remember me"
    win2.close()


def test_import_a_file_from_elsewhere(qtbot, window, tmp_path):
    src = tmp_path / "elsewhere.jsonl"
    src.write_text('{"role":"user","content":"Imported"}\n'
                   '{"role":"assistant","content":"Yes"}\n')
    with qtbot.waitSignal(window.host.conversation, timeout=TIMEOUT) as b:
        cid = window.library.import_file(str(src))
    assert [m["content"] for m in b.args[0]] == ["Imported", "Yes"]
    assert History.load(window.library.store.path(cid)) == History.load(str(src))
    assert window.sidebar.titles() == ["elsewhere"]
    # a malformed file is refused with the engine's message, nothing is added
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"role":"user","content":"x"}\n\n')
    with qtbot.waitSignal(window.library.failed, timeout=TIMEOUT) as b:
        assert window.library.import_file(str(bad)) is None
    assert "is blank" in b.args[0] and window.sidebar.titles() == ["elsewhere"]


def cut_then_restart(qtbot, store, data, demo_model, text: str, limit: int | None = None):
    """Load, send `text` until the limit cuts the reply (kept in the sidecar), close, and
    start again on the same data folder; returns (the cut turn, the new window)."""
    from k3studio.window import MainWindow
    win = MainWindow(store=store, data_dir=data)
    qtbot.addWidget(win)
    win.show()
    load(qtbot, win, *demo_model)
    if limit is not None:
        win.chat.limit.setValue(limit)
    t = send(qtbot, win, text)
    assert t["end_id"] is None and win.chat.pending["continuable"]
    qtbot.waitUntil(lambda: bool(win.library.meta and win.library.meta.incomplete),
                    timeout=TIMEOUT)
    win.close()
    win2 = MainWindow(store=store, data_dir=data)
    qtbot.addWidget(win2)
    with qtbot.waitSignal(win2.host.loaded, timeout=TIMEOUT):
        win2.show()
    return t, win2


def test_an_incomplete_reply_survives_a_restart(qtbot, store, tmp_path, demo_model):
    """Kept in the sidecar: shown again after a restart (marked, still continuable: its
    ids are known), and a new message answers it as it was."""
    t, win2 = cut_then_restart(qtbot, store, str(tmp_path / "data"), demo_model,
                               "Cut me short")                  # the demo hits the limit
    qtbot.waitUntil(lambda: win2.chat.pending is not None, timeout=TIMEOUT)
    p = win2.chat.pending
    assert p["ids"] == t["ids"] and p["continuable"]
    assert "Continue resumes it" in win2.chat._pending_note(p)
    send(qtbot, win2, "Go on anyway")
    msgs = [m for m in win2.host.messages if m["role"] != "system"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"] and msgs[1]["incomplete"]
    # saved: the answered reply is a turn of the .jsonl, marked in the sidecar
    qtbot.waitUntil(lambda: "incomplete_messages" in win2.library.store.meta(
        win2.library.current).extra, timeout=TIMEOUT)
    hist = History.load(win2.library.path)
    k = win2.library.store.meta(win2.library.current).extra["incomplete_messages"]
    assert [hist[i].role for i in k] == ["assistant"]
    win2.close()


def test_continue_after_a_restart_gives_the_uninterrupted_ids(qtbot, store, tmp_path,
                                                             demo_model):
    """A reply cut by the limit, the app closed (or killed) and started again: Continue
    resumes it by one pass over the transcript and the reply so far, and the whole reply
    equals the same turn answered at once with the larger limit (greedy)."""
    t, win2 = cut_then_restart(qtbot, store, str(tmp_path / "data"), demo_model,
                               "Tell me about K3 Studio", limit=6)
    assert len(t["ids"]) == 6
    qtbot.waitUntil(lambda: win2.chat.continue_btn.isEnabled(), timeout=TIMEOUT)
    win2.chat.limit.setValue(6)
    with qtbot.waitSignal(win2.host.turnFinished, timeout=TIMEOUT) as blocker:
        win2.chat.continue_btn.click()
    whole = blocker.args[0]
    assert not whole.get("failed") and whole["ids"][:6] == t["ids"]
    win2.chat.limit.setValue(len(whole["ids"]))
    qtbot.waitUntil(lambda: win2.chat.regen_btn.isEnabled(), timeout=TIMEOUT)
    with qtbot.waitSignal(win2.host.turnFinished, timeout=TIMEOUT) as blocker:
        win2.chat.regen_btn.click()
    once = blocker.args[0]
    print(f"[app] continued after a restart: {whole['ids']} vs answered at once "
          f"{once['ids']}")
    assert once["ids"] == whole["ids"]
    win2.close()
