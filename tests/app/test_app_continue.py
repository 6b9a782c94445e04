"""Keeping what was generated, through the real window: Stop then Continue gives the ids of
an uninterrupted turn; an edit of an earlier message forks the conversation with the ids of
a fresh one; an incomplete reply is saved where a reference reader ignores it; per-reply
stats leave the first token out of the decode rate; telemetry and the measured peak reset
on model load and on New."""
from __future__ import annotations

import pytest

from k3engine.chat import History
from k3engine.memory import human_seconds

from .app_helpers import TIMEOUT, load, send


def _click_and_wait(qtbot, window, button) -> dict:
    qtbot.waitUntil(lambda: button.isEnabled(), timeout=TIMEOUT)
    with qtbot.waitSignal(window.host.turnFinished, timeout=TIMEOUT) as b:
        button.click()
    return b.args[0]


def _new(qtbot, window) -> None:
    with qtbot.waitSignal(window.host.conversation, timeout=TIMEOUT):
        window.actions_by_name["new"].trigger()


def test_stop_then_continue_gives_the_ids_of_an_uninterrupted_turn(qtbot, window, demo_model):
    window.chat.limit.setValue(16)
    load(qtbot, window, *demo_model)
    want = send(qtbot, window, "Tell me a story")["ids"]
    assert len(want) == 16

    _new(qtbot, window)

    def stop_at_5(records):
        if records[-1]["i"] >= 5 and window.chat.stop_btn.isEnabled():
            window.chat.stop_btn.click()
    window.host.records.connect(stop_at_5)
    part = send(qtbot, window, "Tell me a story")
    window.host.records.disconnect(stop_at_5)
    assert part["interrupted"] and 5 <= part["n"] < 16
    k = part["n"]
    assert window.chat.pending["ids"] == part["ids"] and window.chat.pending["continuable"]
    # the incomplete reply is saved in the sidecar; the .jsonl ends with the user message
    lib = window.library
    qtbot.waitUntil(lambda: bool(lib.current and lib.store.meta(lib.current).incomplete),
                    timeout=TIMEOUT)
    assert lib.store.meta(lib.current).incomplete["ids"] == part["ids"]
    assert History.load(lib.path)[-1].role == "user"

    window.chat.limit.setValue(16 - k)                 # Continue: up to the limit more
    rest = _click_and_wait(qtbot, window, window.chat.continue_btn)
    print(f"[gate] app: stop after {k} + Continue: {rest['ids']} vs uninterrupted {want}")
    assert rest["ids"] == want and rest["continued"] == k and rest["n"] == 16 - k
    assert "continued after" in window.chat.pending_stats


def test_edit_of_an_earlier_message_forks_with_the_ids_of_a_fresh_conversation(
        qtbot, window, demo_model, tmp_path):
    window.chat.limit.setValue(6)
    load(qtbot, window, *demo_model)
    # a fresh conversation that says the edited text first: the ids to expect
    want = send(qtbot, window, "Edited first question")["ids"]
    _new(qtbot, window)
    send(qtbot, window, "First question")
    send(qtbot, window, "Second question")              # answers the incomplete reply
    msgs = window.host.messages
    assert [m["role"] for m in msgs if m["role"] != "system"] == ["user", "assistant", "user"]
    first_user = next(i for i, m in enumerate(msgs) if m["role"] == "user")
    bubbles = [window.chat.column.itemAt(i).widget() for i in range(window.chat.column.count())]
    user_bubble = next(w for w in bubbles if w is not None and w.index == first_user)
    assert user_bubble.edit_btn.isVisibleTo(user_bubble)
    user_bubble.edit_btn.click()
    assert window.chat.editing == first_user
    assert "dropped" in window.chat.edit_label.text()
    window.chat.input.setPlainText("Edited first question")
    with qtbot.waitSignal(window.host.turnFinished, timeout=TIMEOUT) as b:
        window.chat.send_btn.click()
    got = b.args[0]
    users = [m["content"] for m in window.host.messages if m["role"] == "user"]
    print(f"[gate] app: edit of message 1: {got['ids']} vs a fresh conversation {want}; "
          f"{got['reused']} of {got['prompt_ids']} positions reused")
    assert users == ["Edited first question"] and got["ids"] == want
    assert got["reused"] > 0                  # the state before the edited message was kept


def test_stats_leave_the_first_token_out_of_the_decode_rate(qtbot, window, demo_model):
    load(qtbot, window, *demo_model)
    steps = []
    window.host.records.connect(lambda r: steps.extend(x["seconds"] for x in r))
    t = send(qtbot, window, "Hello")
    n = t["n"]
    assert n == len(steps) == window.settings.gen
    # the first step carries the whole prefill: the decode figures are over the others
    decode = t["seconds"] - t["first_token_seconds"]
    assert abs(t["decode_s_per_token"] - decode / (n - 1)) < 1e-9
    assert abs(t["tokens_per_s"] - (n - 1) / decode) < 1e-6
    assert abs(t["prefill_positions_per_s"]
               - (t["prompt_ids"] - t["reused"]) / t["first_token_seconds"]) < 1e-6
    assert t["first_token_seconds"] >= steps[0] * 0.5     # same span, measured twice
    line = window.chat.pending_stats
    assert f"{human_seconds(t['decode_s_per_token'])}/token after the first" in line
    assert " tokens/s" in line and "first token" in line
    assert "read " in line and t["read_bytes"] > 0 and "peak RSS" in line
    # the prefill breakdown is the engine's vocabulary: behind the details toggle
    assert "reused" not in line
    window.chat.set_details(True)
    assert f"{t['reused']} of {t['prompt_ids']} reused" in window.chat.column.itemAt(
        window.chat.column.count() - 2).widget().stats.text()


def test_prefill_progress_has_elapsed_time_and_an_eta(qtbot, window, demo_model):
    load(qtbot, window, *demo_model)
    seen = []
    window.host.prefillProgress.connect(
        lambda p: seen.append((p, window.chat.prefill_text.text())))
    send(qtbot, window, " ".join(["A long prompt to read."] * 40))
    assert seen, "no prefill progress was reported"
    p, shown = seen[-1]
    assert p["n_layers"] > 0 and 1 <= p["layers"] <= p["n_layers"]
    assert "elapsed" in shown and f"layer {p['layers']}/{p['n_layers']}" in shown
    assert any(q["eta_s"] is not None and "left" in f for q, f in seen)


def test_telemetry_and_measured_peak_reset_on_load_and_new(qtbot, window, demo_model):
    load(qtbot, window, *demo_model)
    t = send(qtbot, window, "One")
    assert window.plots.series.n == t["n"]
    # New: the token axis starts again; the earlier series stays exportable
    _new(qtbot, window)
    assert window.plots.series.n == 0 and window.plots.is_empty(window.plots.p_rss)
    assert window.plots.archive and window.plots.archive[-1][1].n == t["n"]
    assert "After a run" in window.memory.measured.text()    # the old peak is gone
    send(qtbot, window, "Two")
    assert window.plots.series.view("token")[0] == 1
    # a model load: the same, and the measured peak is this load's, not an earlier one's:
    # a 256 MB peak just before the load must not show in it
    import numpy as np
    from k3engine.telemetry import PeakWindow, rss_bytes
    probe = PeakWindow()
    big = np.ones(32 << 20)                # 256 MB touched, then freed
    del big
    earlier_peak = probe.sample()
    with qtbot.waitSignal(window.host.loaded, timeout=TIMEOUT) as b:
        window.load_model()
    info = b.args[0]
    assert window.plots.series.n == 0
    if info["peak_measured"] != "VmHWM":
        pytest.skip("no /proc/self/clear_refs here: the peak cannot be reset by the OS")
    print(f"[gate] peak before the load {earlier_peak >> 20} MB, after it "
          f"{info['peak_rss_after_load'] >> 20} MB (RSS now {rss_bytes() >> 20} MB)")
    assert info["peak_rss_after_load"] < earlier_peak - (128 << 20)
    from k3engine.memory import human
    assert human(info["peak_rss_after_load"]) in window.memory.measured.text()
    assert window.plots.archive[-1][0].startswith("model ")


def test_apply_loads_the_new_budgets_without_a_trip_to_setup(qtbot, window, demo_model):
    load(qtbot, window, *demo_model)
    send(qtbot, window, "Keep this conversation")
    before = window.host.loaded_info
    assert not window.memory.apply_btn.isEnabled()          # what is shown is loaded
    window.tabs.setCurrentIndex(1)
    old = window.settings.cache_gb
    window.memory.cache.spin.setValue(old * 2)
    assert window.memory.apply_btn.isEnabled() and window.settings.cache_gb == old * 2
    # the chat's command line shows what is loaded, not the budgets waiting for Apply
    assert f"--cache-gb {old:g} " in window.chat.command.text()
    assert f"--cache-gb {old * 2:g} " in window.command_line()
    with qtbot.waitSignal(window.host.loaded, timeout=TIMEOUT) as b:
        window.memory.apply_btn.click()
    after = b.args[0]
    assert after["expert_slots"] > before["expert_slots"]   # the new cache budget is loaded
    assert window.tabs.currentIndex() == 1 and not window.memory.apply_btn.isEnabled()
    assert any(m["content"] == "Keep this conversation" for m in window.host.messages)
    assert window.loaded_spec.cache_gb == window.settings.cache_gb == old * 2
    assert f"--cache-gb {old * 2:g} " in window.chat.command.text()
    # the expert replacement policy is a memory setting too: Apply loads it
    assert "replacement" not in after["cache_line"]          # the reference's LRU
    window.memory.policy.setCurrentIndex(window.memory.policy.findData("s3fifo"))
    assert window.memory.apply_btn.isEnabled()
    with qtbot.waitSignal(window.host.loaded, timeout=TIMEOUT) as b:
        window.memory.apply_btn.click()
    assert b.args[0]["cache_line"].endswith("S3-FIFO replacement)")
    assert "--cache-policy s3fifo" in window.chat.command.text()
    assert not window.memory.apply_btn.isEnabled()
