"""The shareable benchmark datapoint (`k3 datapoint`, `k3 doctor --datapoint`): a real run
of a generated checkpoint, the record's structure, and nothing personal in it."""
from __future__ import annotations

import getpass
import json
import os
import socket

import pytest

from k3engine import forecast as F
from k3engine.cli import main as k3_main
from k3engine.tools import datapoint as D
from k3engine.trunk import pack_trunk

from engine_helpers import make_tiny
from test_forecast import GIVEN


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny checkpoint in a directory whose name carries the user's and the host's
    names, so a record that leaked the path would be caught."""
    root = tmp_path_factory.mktemp("dp")
    name = f"{getpass.getuser()}-{socket.gethostname()}-private-model"
    m = make_tiny(root / name)
    pack_trunk(m, str(root / f"{name}-trunk"))
    return m, str(root / f"{name}-trunk")


@pytest.fixture
def given_machine(monkeypatch):
    monkeypatch.setattr(F, "machine_figures", lambda *a, **k: GIVEN)


def test_datapoint_from_a_real_run(model, given_machine, tmp_path, capsys):
    m, trunk = model
    out = tmp_path / "dp"
    assert k3_main(["datapoint", m, "--trunk", trunk, "--trunk-gb", "0", "--cache-gb", "0.01",
                    "--gen", "3", "--prompt-len", "4", "--out", str(out)]) == 0
    rec = json.loads((tmp_path / "dp.json").read_text())
    md = (tmp_path / "dp.md").read_text()
    assert rec["schema"] == D.SCHEMA
    assert rec["model"]["name"].startswith("generated 'tiny'")
    assert rec["plan"]["streamed"] and rec["plan"]["n_pinned"] == 0
    assert rec["plan"]["trunk_gb"] == 0.0 and rec["plan"]["cache_gb"] == 0.01
    meas = rec["measured"]
    assert meas["tokens"] == 3 and meas["prompt_positions"] == 4
    for key in ("s_per_token", "ttft_s", "peak_rss_bytes", "expert_hit_rate"):
        assert meas[key] is not None and meas[key] >= 0, key
    assert meas["peak_rss_bytes"] > 10 * 10**6              # the child's own, measured
    for key in ("cpu", "physical_cores", "memory_bytes", "disk_read_mbs"):
        assert key in rec["machine"], key
    assert "peak RSS" in md and "s/token" in md and rec["version"]["k3"] in md
    print("[cli] datapoint:", json.dumps(rec, sort_keys=True)[:200])


def test_nothing_personal_in_the_record(model, given_machine, tmp_path):
    m, trunk = model
    out = tmp_path / "dp2"
    assert D.main([m, "--gen", "2", "--prompt-len", "3", "--out", str(out)]) == 0
    text = (tmp_path / "dp2.json").read_text() + (tmp_path / "dp2.md").read_text()
    for s in (m, os.path.basename(m), os.path.dirname(m), str(tmp_path),
              os.path.expanduser("~"), socket.gethostname()):
        assert s not in text, s
    if getpass.getuser() not in ("root",):
        assert getpass.getuser() not in text


def test_a_leak_is_refused_and_nothing_written(model, given_machine, tmp_path, monkeypatch):
    m, _ = model
    monkeypatch.setattr(D, "_cpu", lambda: f"cpu at {os.path.expanduser('~')}/x")
    out = tmp_path / "leak"
    assert D.main([m, "--gen", "1", "--prompt-len", "2", "--out", str(out)]) == 1
    assert not (tmp_path / "leak.json").exists() and not (tmp_path / "leak.md").exists()
    with pytest.raises(D.PersonalDataError):
        D.check_impersonal(f"model at {m}", [m])


def test_unwritable_out_is_refused_before_the_run(model, tmp_path, capsys):
    m, _ = model
    assert D.main([m, "--out", str(tmp_path / "absent" / "dp")]) == 3
    assert "does not exist" in capsys.readouterr().err


def test_from_events_needs_a_complete_run(model, tmp_path, capsys):
    m, _ = model
    ev = tmp_path / "ev.jsonl"
    ev.write_text(json.dumps({"ev": "plan", "trunk_gb": 1}) + "\n")
    assert D.main([m, "--from-events", str(ev), "--out", str(tmp_path / "x")]) == 1
    assert "no complete run" in capsys.readouterr().err


def test_doctor_datapoint_hook(model, given_machine, tmp_path, capsys):
    m, trunk = model
    assert k3_main(["doctor", "--datapoint", str(tmp_path / "doc")]) == 2    # needs --model
    assert "--model" in capsys.readouterr().err
    assert k3_main(["doctor", "--model", m, "--trunk", trunk,
                    "--datapoint", str(tmp_path / "doc")]) == 0
    rec = json.loads((tmp_path / "doc.json").read_text())
    assert rec["plan"]["streamed"] and rec["measured"]["tokens"] == 8
    assert (rec["plan"]["trunk_gb"], rec["plan"]["cache_gb"]) == (16.0, 64.0)   # defaults
    from k3engine.threads import default_threads
    assert rec["threads"] == default_threads()              # what the run used, not null


def test_the_shipped_demo_is_named_as_such():
    """The trained demo model has its own shape (not a --dims size): the record says what
    it is rather than "custom checkpoint", from the shape alone."""
    from k3engine.loading import read_config
    from k3engine.tools.demo import shipped_dir
    cfg, _ = read_config(shipped_dir(), None)
    assert D.model_name(cfg).startswith("the K3 Studio demo model")
    assert "not Kimi K3" in D.model_name(cfg)
