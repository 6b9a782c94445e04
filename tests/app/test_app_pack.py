"""The Pack trunk dialog: progress to completion, and Cancel leaving nothing behind."""
from __future__ import annotations

import os

from .app_helpers import TIMEOUT

from k3engine.trunk import TrunkManifest
from k3studio.pack_dialog import PackDialog


def test_pack_completes(qtbot, demo_model, tmp_path):
    dest = tmp_path / "packed"
    dlg = PackDialog(demo_model[0], trunk_bytes=11_894_016, n_layers=13)
    qtbot.addWidget(dlg)
    assert "MB to write" in dlg.estimate.text() and "free at the destination" in dlg.estimate.text()
    dlg.dest.setText(str(dest))
    with qtbot.waitSignal(dlg.packed, timeout=TIMEOUT) as b:
        dlg.start_btn.click()
    assert b.args[0] == str(dest) and dlg.outcome == "done"
    assert dlg.bar.value() == 1000
    m = TrunkManifest.load(str(dest))
    assert len(m.layers) == 13


def test_pack_cancel_leaves_nothing(qtbot, demo_model, tmp_path):
    dest = tmp_path / "cancelled"
    dlg = PackDialog(demo_model[0], trunk_bytes=11_894_016, n_layers=13)
    qtbot.addWidget(dlg)
    dlg.dest.setText(str(dest))
    dlg.start()
    dlg.cancel()                     # before the first chunk: the pack checks between chunks
    qtbot.waitUntil(lambda: dlg.outcome != "", timeout=TIMEOUT)
    assert dlg.outcome == "cancelled", dlg.status.text()
    left = os.listdir(dest) if dest.exists() else []
    assert "trunk.json" not in left and "trunk.bin" not in left
    assert not [f for f in left if "partial" in f]
    assert dlg.cancel_btn.text() == "Close"


def test_pack_from_the_setup_panel_fills_the_trunk_field(qtbot, window, model_copy):
    setup = window.setup
    setup.set_paths(model_copy, "", "")
    qtbot.waitUntil(lambda: setup.pack_btn.isEnabled(), timeout=TIMEOUT)
    dlg = setup.open_pack_dialog()
    assert dlg.dest.text() == model_copy + "-trunk"
    with qtbot.waitSignal(dlg.packed, timeout=TIMEOUT):
        dlg.start_btn.click()
    qtbot.waitUntil(lambda: setup.inspection is not None
                    and setup.inspection.trunk.level == "ok", timeout=TIMEOUT)
    assert setup.trunk.text() == model_copy + "-trunk"
    dlg.close()
