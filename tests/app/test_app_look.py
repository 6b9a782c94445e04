"""The look: the data folder names the app once, the theme switches, the console stays
quiet about fonts, empty plots say so, and the window is usable at 1024x700."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from PySide6.QtWidgets import QApplication

from .app_helpers import TIMEOUT

DEVANAGARI = "नमस्ते दुनिया"       # a script the machine may have no OpenType font for

RENDER = f"""
import sys
from k3studio.__main__ import make_app
app = make_app()
from PySide6.QtWidgets import QLabel
label = QLabel({DEVANAGARI!r})
label.show()
app.processEvents()
label.grab()
"""


def _font_lines(env_extra: dict) -> int:
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", **env_extra)
    out = subprocess.run([sys.executable, "-c", RENDER], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return sum("OpenType support missing" in line for line in out.stderr.splitlines())


def test_no_font_noise_on_the_console():
    """The cause: text in a script no installed font can shape (the demo's random replies
    hold Devanagari and more) makes Qt log a line per font it falls back through."""
    os.environ.pop("QT_LOGGING_RULES", None)
    noisy = _font_lines({"QT_LOGGING_RULES": "qt.text.font.db.info=true"})
    if noisy == 0:
        pytest.skip("this machine has a font that shapes Devanagari: Qt logs nothing to "
                    "silence")
    print(f"[look] Devanagari with the category on: {noisy} font lines; as the app starts: "
          f"{_font_lines({})}")
    assert _font_lines({}) == 0


def test_the_data_folder_names_the_app_once(qapp, tmp_path, monkeypatch):
    from k3studio import APP_NAME, demo
    from k3studio.__main__ import make_app
    app = make_app()
    assert app.organizationName() == "" and app.applicationName() == APP_NAME
    # an old doubled folder moves up one level (nothing overwritten)
    root = tmp_path / APP_NAME
    (root / APP_NAME / "demo-model").mkdir(parents=True)
    (root / APP_NAME / "demo-model" / "config.json").write_text("{}")
    (root / "conversations").mkdir()
    demo.migrate_doubled(str(root))
    assert (root / "demo-model" / "config.json").exists()
    assert not (root / APP_NAME).exists()


def test_the_theme_switch(window):
    from PySide6.QtGui import QPalette
    window.actions_by_name["theme_dark"].trigger()
    assert window.dark and window.settings.theme == "dark"
    assert QApplication.instance().palette().color(QPalette.Window).lightness() < 80
    # the plots' legend labels follow the theme (they stayed dark on dark, unreadable)
    labels = [lab for p in window.plots._token_plots if p.legend is not None
              for _, lab in p.legend.items]
    assert labels and all(lab.opts["color"].lightness() > 150 for lab in labels)
    assert "#1e2128" in QApplication.instance().styleSheet()
    window.actions_by_name["theme_light"].trigger()
    assert not window.dark
    assert QApplication.instance().palette().color(QPalette.Window).lightness() > 180
    # drop-down highlight and spin-box arrows: the sheet styles the popup's selection and
    # leaves spin boxes to the style (a sheet border on them drew no arrows)
    sheet = QApplication.instance().styleSheet()
    assert "selection-background-color" in sheet.split("QComboBox QAbstractItemView")[1]
    assert "QSpinBox" not in sheet
    window.actions_by_name["theme_system"].trigger()
    assert window.settings.theme == "system"


def test_empty_plots_say_so(window):
    p = window.plots
    for plot in p._token_plots:
        assert p.is_empty(plot) and not plot.getAxis("left").isVisible()
    assert p.empty_items[p.p_rss].toPlainText() == "no tokens yet"


def test_usable_at_1024_by_700(qtbot, window):
    window.resize(1024, 700)
    qtbot.waitUntil(lambda: window.width() == 1024, timeout=TIMEOUT)
    assert window.minimumSizeHint().width() <= 1024
    assert window.minimumSizeHint().height() <= 700
    window.tabs.setCurrentIndex(2)
    QApplication.processEvents()
    sizes = window.splitter.sizes()
    assert sum(sizes) <= 1024 and min(sizes) > 150, sizes
