"""File → Save benchmark datapoint…: the record of `k3 datapoint` made from the session's
last reply, through the engine's own datapoint code, saved where the person picks
(atomically), shown whole, and with nothing personal in it."""
from __future__ import annotations

import getpass
import json
import os
import shutil
import socket

import pytest
from PySide6.QtWidgets import QFileDialog

from k3engine import forecast as F
from k3engine.tools import datapoint as D

from .app_helpers import TIMEOUT, load, send
from .test_app_whatif import GIVEN


@pytest.fixture
def private_model(demo_model, tmp_path):
    """The demo model and trunk in folders whose names carry the user's and the host's
    names, so a record that leaked a path would be caught."""
    name = f"{getpass.getuser()}-{socket.gethostname()}-private"
    model, trunk = tmp_path / f"{name}-model", tmp_path / f"{name}-trunk"
    shutil.copytree(demo_model[0], model)
    shutil.copytree(demo_model[1], trunk)
    return str(model), str(trunk)


@pytest.fixture
def measured(qtbot, window, private_model, monkeypatch):
    """A loaded model and one reply; the machine's figures given (no device test)."""
    monkeypatch.setattr(F, "machine_figures", lambda *a, **k: GIVEN)
    window.memory.forecast_box.set_machine(GIVEN)
    act = window.actions_by_name["datapoint"]
    assert not act.isEnabled()                        # nothing measured yet
    load(qtbot, window, private_model[0], private_model[1], private_model[0])
    info = send(qtbot, window, "hello, what day comes after monday?")
    assert not info["failed"] and info["n"] > 1
    qtbot.waitUntil(act.isEnabled, timeout=TIMEOUT)
    return info


def save_via_menu(qtbot, window, monkeypatch, path):
    monkeypatch.setattr(QFileDialog, "getSaveFileName",
                        staticmethod(lambda *a, **k: (str(path), "")))
    dp = window.datapoint
    with qtbot.waitSignals([dp.saved], timeout=TIMEOUT, raising=False) as blocker:
        window.actions_by_name["datapoint"].trigger()
    return blocker


def test_the_datapoint_of_the_last_reply(qtbot, window, private_model, measured, monkeypatch,
                                         tmp_path):
    out = tmp_path / "shared"
    out.mkdir()
    blocker = save_via_menu(qtbot, window, monkeypatch, out / "mine.json")
    assert blocker.signal_triggered, "the datapoint was not saved"
    # atomic: the two files and nothing else (no temp file left behind)
    assert sorted(os.listdir(out)) == ["mine.json", "mine.md"]
    rec = json.loads((out / "mine.json").read_text())
    md = (out / "mine.md").read_text()
    assert rec["schema"] == D.SCHEMA and rec["source"] == D.SOURCE_APP
    assert md == D.markdown(rec)                      # the engine's own rendering
    info = measured
    m = rec["measured"]
    assert m["tokens"] == info["n"] and m["prompt_positions"] == info["prompt_ids"]
    assert m["reused_positions"] == info["reused"]
    assert m["s_per_token"] == round(info["seconds"] / info["n"], 4)
    first_step = window.datapoint.turn["steps"][0]               # the plots' record
    assert first_step["step"] == 0 and m["ttft_s"] == round(first_step["seconds"], 4)
    # the step clock and the turn summary's first-token clock time the same prefill
    assert m["ttft_s"] == pytest.approx(info["first_token_seconds"], rel=0.1)
    assert m["peak_rss_bytes"] == info["peak_rss_bytes"]
    assert 0 <= m["expert_hit_rate"] <= 1 and m["expert_requests"] > 0
    spec = window.loaded_spec
    assert rec["plan"]["trunk_gb"] == spec.trunk_gb and rec["plan"]["cache_gb"] == spec.cache_gb
    assert rec["plan"]["streamed"] and rec["plan"]["planned_bytes"] == info["plan_total"]
    assert rec["model"]["name"] == "custom checkpoint" or rec["model"]["name"].startswith(
        "generated")
    assert rec["machine"]["disk_read_mbs"] == {"qd1": 1000.0, "qd16": 3000.0, "qd4": 2000.0}
    assert rec["version"]["k3"] in md and "peak RSS" in md
    # nothing personal: the home, the user, the host, every path of the session
    text = (out / "mine.json").read_text() + md
    home, user, host = os.path.expanduser("~"), getpass.getuser(), socket.gethostname()
    for s in (home, private_model[0], private_model[1], os.path.basename(private_model[0]),
              window.data_dir, str(tmp_path), str(out)):
        assert s not in text, s
    assert user.lower() not in text.lower(), user
    if len(host) >= 3:                 # a two-letter host name ("vm") is in ordinary words
        assert host.lower() not in text.lower(), host
    # shown whole
    dlg = window.datapoint.dialog
    assert dlg is not None and dlg.isVisible()
    assert dlg.json.toPlainText() == (out / "mine.json").read_text()
    assert "peak RSS" in dlg.markdown.toPlainText()
    dlg.close()
    print(f"[app] datapoint: {m['tokens']} tokens, {m['s_per_token']} s/token, first token "
          f"{m['ttft_s']} s, hit {m['expert_hit_rate']}, peak RSS {m['peak_rss_bytes']}")


def test_a_leak_is_refused_and_nothing_written(qtbot, window, measured, monkeypatch,
                                               tmp_path):
    monkeypatch.setattr(D, "_cpu", lambda: f"cpu in {os.path.expanduser('~')}")
    out = tmp_path / "leak"
    out.mkdir()
    with qtbot.waitSignal(window.datapoint.failed, timeout=TIMEOUT) as blocker:
        monkeypatch.setattr(QFileDialog, "getSaveFileName",
                            staticmethod(lambda *a, **k: (str(out / "dp.json"), "")))
        window.actions_by_name["datapoint"].trigger()
    assert "personal" in blocker.args[0] and os.listdir(out) == []


def test_an_unwritable_place_is_refused(qtbot, window, measured, tmp_path):
    with qtbot.waitSignal(window.datapoint.failed, timeout=TIMEOUT) as blocker:
        window.datapoint.save(str(tmp_path / "absent" / "dp.json"))
    assert "not saved" in blocker.args[0] and "absent" in blocker.args[0]
    assert not (tmp_path / "absent").exists()
