"""Chat on the demo model through the window: streaming, plots (one point per token),
Stop at a safe point, limits, errors, conversations as JSONL."""
from __future__ import annotations

import os

import pytest
from .app_helpers import TIMEOUT, load, send

from k3engine.chat import History


def test_full_turn_every_plot_gets_one_point_per_token(qtbot, window, demo_model, tmp_path):
    info = load(qtbot, window, *demo_model)
    assert info["streamed"] and info["ring_slots"] >= 1
    assert 0 < len(info["pinned_layers"]) < info["n_layers"]      # budgets of the store
    assert "k3 " in info["command"] and "--chat" in info["command"]
    records = []
    window.host.records.connect(lambda r: records.extend(r))
    started = []
    window.host.turnStarted.connect(lambda i: started.append(i))
    t = send(qtbot, window, "Hello, who are you?")
    gen = window.settings.gen
    assert not t["failed"] and t["n"] == gen == len(t["ids"])
    assert [r["i"] for r in records] == list(range(1, gen + 1))
    assert started and started[0]["prompt_ids"] == t["prompt_ids"]
    counts = window.plots.point_counts()
    assert set(counts.values()) == {gen}, counts
    assert window.plots.series.n == gen
    # telemetry values are sane: RSS from the OS, shares in range, hit rates in [0, 1]
    s = window.plots.series
    assert (s.view("rss_bytes") > 0).all() and (s.view("seconds") > 0).all()
    assert ((s.view("true_resident_hit") >= 0) & (s.view("true_resident_hit") <= 1)).all()
    assert (s.view("trunk_bytes") > 0).any()        # ring layers are re-read every token
    assert window.plots.heat is not None and window.plots.heat.sum() > 0
    # export: one CSV row per token, and a PNG of the plots
    csv_path, png_path = tmp_path / "t.csv", tmp_path / "t.png"
    window.plots.export_csv(str(csv_path))
    rows = csv_path.read_text().splitlines()
    assert len(rows) == gen + 1 and rows[0].startswith("token,seconds,rss_bytes")
    assert window.plots.export_png(str(png_path)) and png_path.stat().st_size > 1000
    # the random-weight demo does not close its turn: kept as an incomplete reply, outside
    # the transcript (which ends with the user message, §9.4)
    assert t["end_id"] is None
    p = window.chat.pending
    assert p is not None and p["why"] == "limit" and p["continuable"] and p["ids"] == t["ids"]
    assert "generation limit" in window.chat._pending_note(p) and "incomplete" in \
        window.chat._pending_note(p)
    qtbot.waitUntil(lambda: window.host.messages and
                    window.host.messages[-1]["role"] == "user", timeout=TIMEOUT)
    assert f"{gen} tokens" in window.chat.pending_stats
    assert "s/token" in window.chat.pending_stats and "first token" in window.chat.pending_stats
    assert window.chat.continue_btn.isEnabled()
    # still usable: a second message answers the incomplete reply, which joins the
    # transcript as the context of what follows (marked incomplete)
    records.clear()
    t2 = send(qtbot, window, "Second try")
    assert not t2["failed"] and t2["n"] == gen
    assert window.plots.series.n == 2 * gen
    assert set(window.plots.point_counts().values()) == {2 * gen}
    msgs = [m for m in window.host.messages if m["role"] != "system"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    assert msgs[1]["incomplete"] and msgs[1]["content"] == p["content"]
    assert [m["content"] for m in msgs if m["role"] == "user"] == ["Hello, who are you?",
                                                                   "Second try"]


def test_stop_ends_the_turn_at_a_safe_point(qtbot, window, demo_model):
    window.chat.limit.setValue(4096)
    load(qtbot, window, *demo_model)
    def press_stop(_records):
        if window.chat.stop_btn.isEnabled():
            window.chat.stop_btn.click()
    window.host.records.connect(press_stop)
    t = send(qtbot, window, "Tell me a long story")
    window.host.records.disconnect(press_stop)
    assert not t["failed"] and t["interrupted"]
    assert 1 <= t["n"] < 4096
    assert window.plots.series.n == t["n"]
    assert window.chat.pending["why"] == "stopped"
    assert "Stopped after" in window.chat._pending_note(window.chat.pending)
    # and the app carries on
    window.chat.limit.setValue(5)
    t2 = send(qtbot, window, "Short one")
    assert t2["n"] == 5 and not t2["interrupted"]


def test_regenerate_and_edit_last(qtbot, window, demo_model):
    load(qtbot, window, *demo_model)
    send(qtbot, window, "First question")
    with qtbot.waitSignal(window.host.turnFinished, timeout=TIMEOUT) as b:
        window.chat.regen_btn.click()
    assert b.args[0]["n"] == window.settings.gen
    qtbot.waitUntil(lambda: window.chat.edit_btn.isEnabled(), timeout=TIMEOUT)
    window.chat.edit_btn.click()
    assert window.chat.input.toPlainText() == "First question"
    assert window.chat.editing is not None and window.chat.edit_bar.isVisibleTo(window.chat)
    window.chat.cancel_edit()
    assert window.chat.editing is None and window.chat.input.toPlainText() == ""


def test_engine_error_is_shown_and_the_app_stays_usable(qtbot, window, demo_model, model_copy):
    """A damaged checkpoint (passes the pickers, fails at load): the CLI's message."""
    window.setup.set_paths(model_copy, "", "")
    qtbot.waitUntil(lambda: window.setup.load_btn.isEnabled(), timeout=TIMEOUT)
    os.unlink(os.path.join(model_copy, "model.safetensors"))
    with qtbot.waitSignal(window.host.errored, timeout=TIMEOUT) as b:
        window.setup.load_btn.click()
    err = b.args[0]
    assert err["code"] == 1 and err["message"].startswith("k3: ")
    assert "no .safetensors files" in err["message"] and model_copy in err["message"]
    assert window.errors.isVisible() and "k3 would exit 1" in window.errors.text.text()
    qtbot.waitUntil(lambda: not window.host.busy, timeout=TIMEOUT)
    load(qtbot, window, *demo_model)
    t = send(qtbot, window, "Still there?")
    assert not t["failed"] and t["n"] == window.settings.gen


def test_failed_expert_read_mid_turn(qtbot, window, demo_model, monkeypatch):
    """Fault injection (K3_FAIL_EXPERT, read at load): the turn fails with exit 4's
    message, the conversation keeps the user message, a reload without it works."""
    monkeypatch.setenv("K3_FAIL_EXPERT", "1,*")
    load(qtbot, window, *demo_model)
    errors = []
    window.host.errored.connect(lambda e: errors.append(e))
    t = send(qtbot, window, "Hello")
    assert t["failed"]
    assert errors and errors[0]["code"] == 4 and errors[0]["message"].startswith("RUN INVALID")
    assert window.host.messages[-1]["role"] == "user"
    monkeypatch.delenv("K3_FAIL_EXPERT")
    qtbot.waitUntil(lambda: window.setup.load_btn.isEnabled(), timeout=TIMEOUT)
    with qtbot.waitSignal(window.host.loaded, timeout=TIMEOUT):
        window.setup.load_btn.click()
    # the button follows the load's signals: a click before it is enabled does nothing
    qtbot.waitUntil(lambda: window.chat.regen_btn.isEnabled(), timeout=TIMEOUT)
    with qtbot.waitSignal(window.host.turnFinished, timeout=TIMEOUT) as b:
        window.chat.regen_btn.click()
    assert not b.args[0]["failed"]


def test_send_without_a_model_is_refused_politely(qtbot, window):
    assert not window.chat.send_btn.isEnabled()
    with qtbot.waitSignal(window.host.errored, timeout=TIMEOUT) as b:
        window.host.send("hi", window.spec())
    assert b.args[0]["message"].startswith("chat: no model is loaded")


def test_conversations_as_engine_jsonl(qtbot, window, tmp_path):
    """New / save / open use the engine's History format (k3 --history)."""
    window.chat.system.setText("Be brief.")
    with qtbot.waitSignal(window.host.conversation, timeout=TIMEOUT):
        window.actions_by_name["new"].trigger()         # File > New (Ctrl+N)
    path = tmp_path / "conv.jsonl"
    with open(path, "w") as f:
        f.write('{"role":"system","content":"Be brief."}\n'
                '{"role":"user","content":"Hi"}\n'
                '{"role":"assistant","content":"Hello!","reasoning_content":"greet"}\n')
    with qtbot.waitSignal(window.host.conversation, timeout=TIMEOUT) as b:
        window.chat.open_conversation(str(path))
    msgs = b.args[0]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant"]
    assert msgs[2]["reasoning"] == "greet"
    bubbles = [window.chat.column.itemAt(i).widget() for i in range(window.chat.column.count())]
    bubbles = [w for w in bubbles if w is not None]
    assert [w.role for w in bubbles] == ["user", "assistant"]
    b1 = bubbles[1]
    assert b1.think_toggle.isVisibleTo(b1) and not b1.think_frame.isVisibleTo(b1)  # folded
    b1.think_toggle.click()
    assert b1.think_frame.isVisibleTo(b1) and b1.thinking.text() == "greet"
    assert b1.content.text() == "Hello!"
    out = tmp_path / "saved.jsonl"
    window.host.save_conversation(str(out))
    qtbot.waitUntil(lambda: out.exists(), timeout=TIMEOUT)
    assert list(History.load(str(out))) == list(History.load(str(path)))
    # a malformed file: the engine's message, nothing replaced
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"role":"user","content":"x"}\n\n')
    with qtbot.waitSignal(window.host.errored, timeout=TIMEOUT) as b:
        window.chat.open_conversation(str(bad))
    assert b.args[0]["message"].startswith("chat: ") and "is blank" in b.args[0]["message"]


@pytest.mark.parametrize("thinking", [True, False])
def test_command_line_mirrors_the_settings(window, demo_model, thinking):
    window.setup.set_paths(*demo_model)
    window.chat.thinking.setChecked(thinking)
    window.chat.greedy.setChecked(False)
    window.chat.temperature.setValue(0.7)
    cmd = window.command_line()
    assert cmd.startswith(f"k3 {demo_model[0]} --chat --tok {demo_model[0]} --trunk {demo_model[1]}")
    assert ("--no-think" in cmd) != thinking
    assert "--temperature 0.7" in cmd and "--threads 1" in cmd
