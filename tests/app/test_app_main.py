"""Entry point, resources and the worker's plumbing."""
from __future__ import annotations

import os
import time

import pytest
from .app_helpers import TIMEOUT


def test_main_quits_by_itself(qtbot, tmp_path, monkeypatch):
    """`k3-studio --quit-after N` (and K3STUDIO_QUIT_AFTER) for headless checks."""
    from k3studio.__main__ import main, parse_args
    monkeypatch.setenv("K3STUDIO_QUIT_AFTER", "2.5")
    assert parse_args([]).quit_after == 2.5
    monkeypatch.delenv("K3STUDIO_QUIT_AFTER")
    t0 = time.monotonic()
    code = main(["--quit-after", "0.5", "--settings", str(tmp_path / "s.ini"),
                 "--data-dir", str(tmp_path / "data")])
    assert code == 0
    assert time.monotonic() - t0 < TIMEOUT / 1000
    assert (tmp_path / "s.ini").exists()          # settings were saved on the way out


def test_main_with_a_model(qtbot, tmp_path, demo_model):
    from k3studio.__main__ import main
    code = main(["--quit-after", "0.5", "--settings", str(tmp_path / "s.ini"),
                 "--model", demo_model[0], "--trunk", demo_model[1]])
    assert code == 0
    from PySide6.QtCore import QSettings
    s = QSettings(str(tmp_path / "s.ini"), QSettings.IniFormat)
    assert s.value("model_dir") == demo_model[0] and s.value("trunk_dir") == demo_model[1]


def test_version(capsys):
    from k3studio.__main__ import main
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("k3-studio ")


def test_resources_load_from_the_package(qapp):
    """Found through importlib.resources in `k3studio_resources`, not by a path."""
    import importlib.resources

    from k3studio import appres
    assert "QPushButton" in appres.style_sheet()
    assert not appres.app_icon().isNull()
    root = importlib.resources.files("k3studio_resources")
    desktop = (root / "k3studio.desktop").read_text()
    assert "Exec=k3-studio" in desktop and "Icon=k3studio" in desktop
    assert (root / "k3studio.png").is_file()


def test_describe_error_matches_the_cli():
    from k3engine.checkpoint import CheckpointError
    from k3engine.config import ConfigError
    from k3engine.experts import ExpertLoadError
    from k3studio.worker import describe_error
    e = describe_error(ConfigError("/m/config.json", "missing hidden_size"))
    assert e["code"] == 2 and e["message"].startswith("k3: ")
    assert e["message"].endswith("ABORTED: the model config could not be read with confidence.")
    e = describe_error(CheckpointError("/m/x.safetensors: truncated", "/m/x.safetensors"))
    assert (e["code"], e["message"]) == (1, "k3: /m/x.safetensors: truncated")
    e = describe_error(ExpertLoadError(3, 7, "short read"))
    assert e["code"] == 4 and e["message"].startswith("RUN INVALID: ")
    e = describe_error(RuntimeError("boom"))
    assert e["code"] == 1 and "internal error" in e["message"]


def test_mailboxes_coalesce():
    from k3studio.worker import Latest, Mailbox
    m = Mailbox()
    assert m.put(1) is True          # wake the consumer once...
    assert m.put(2) is False and m.put(3) is False   # ...not again while it has not drained
    assert m.take() == [1, 2, 3] and m.take() == []
    assert m.put(4) is True
    latest = Latest()
    assert latest.put("a") is True and latest.put("b") is False
    assert latest.take() == "b" and latest.take() is None


@pytest.mark.parametrize("gen", [1, 3])
def test_the_demo_is_made_once(tmp_path, gen):
    from k3studio import demo
    root = str(tmp_path / "data")
    assert not demo.demo_ready(root)
    seen = []
    model, trunk = demo.make_demo(root, progress=seen.append)
    assert demo.demo_ready(root) and demo.is_demo(model)
    assert {p[0] for p in seen} == {"model", "trunk"}
    mtime = os.path.getmtime(os.path.join(model, "config.json"))
    demo.make_demo(root)                  # already there: nothing rewritten
    assert os.path.getmtime(os.path.join(model, "config.json")) == mtime
    assert not os.path.exists(model + ".partial")


def test_data_dir_isolates_everything(qtbot, tmp_path, monkeypatch, demo_model):
    """--data-dir without --settings kept the per-user settings, so the model remembered
    there was loaded into the isolated folder's session."""
    from PySide6.QtCore import QSettings

    from k3studio import settings as settings_mod
    from k3studio.__main__ import main
    user = tmp_path / "user.ini"
    s = QSettings(str(user), QSettings.IniFormat)
    s.setValue("model_dir", demo_model[0])
    s.sync()
    before = user.read_bytes()
    monkeypatch.setattr(settings_mod, "default_store",
                        lambda: QSettings(str(user), QSettings.IniFormat))
    data = tmp_path / "isolated"
    assert main(["--quit-after", "0.5", "--data-dir", str(data)]) == 0
    mine = QSettings(str(data / "settings.ini"), QSettings.IniFormat)
    assert (data / "settings.ini").exists() and not mine.value("model_dir")
    assert user.read_bytes() == before                 # the per-user store untouched


def test_one_instance_per_data_folder(qtbot, window, tmp_path):
    from k3studio.__main__ import main
    from k3studio.single_instance import InstanceServer, raise_running
    server = InstanceServer(window.data_dir, window)
    assert server.listening
    raised = []
    server.raiseRequested.connect(lambda: raised.append(True))
    t0 = time.monotonic()
    assert main(["--data-dir", window.data_dir]) == 0   # a second start: no second window
    assert time.monotonic() - t0 < 10
    qtbot.waitUntil(lambda: raised == [True], timeout=TIMEOUT)
    assert not raise_running(str(tmp_path / "another-folder"))
