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


def _at(qtbot, win, w, h):
    win.resize(w, h)
    qtbot.waitUntil(lambda: (win.width(), win.height()) == (w, h), timeout=TIMEOUT)
    win.tabs.setCurrentIndex(2)
    QApplication.processEvents()


@pytest.mark.parametrize("size", [(1024, 700), (1920, 1080)])
def test_the_conversation_owns_the_window(qtbot, window, size):
    """The conversation is the widest column and most of the height (the generation box
    and five stacked buttons took it); each plot page keeps its plots legible."""
    from k3studio.window import CHAT, LIST, SIDE
    _at(qtbot, window, *size)
    sizes = window.splitter.sizes()
    assert sizes[CHAT] > max(sizes[LIST], sizes[SIDE]), sizes
    assert window.chat.scroll.height() >= 0.6 * size[1], window.chat.scroll.height()
    plots = window.plots
    for page in plots.extra_pages:                       # the Batch page (while serving)
        plots.show_page(page, True)
    every = plots._token_plots + (plots.p_heat,) + tuple(
        p for page in plots.extra_pages for p in page.plot_items)

    def on(page, p) -> bool:
        view = p.scene().views()[0]
        return view is page or page.isAncestorOf(view)
    for page in range(plots.pages.count()):
        plots.pages.setCurrentIndex(page)
        QApplication.processEvents()
        shown = [p for p in every if on(plots.pages.currentWidget(), p)]
        assert shown and all(p.vb.height() >= 120 for p in shown), \
            [(p.titleLabel.text, p.vb.height()) for p in shown]


def test_side_panels_collapse_and_are_remembered(qtbot, window, store, tmp_path):
    from k3studio.window import CHAT, LIST, SIDE, MainWindow
    _at(qtbot, window, 1024, 700)
    wide = window.splitter.sizes()[CHAT]
    window.chat.side_toggle.click()                      # the button in the chat's bar
    window.actions_by_name["show_list"].trigger()        # View > Conversation list
    sizes = window.splitter.sizes()
    assert sizes[LIST] == 0 and sizes[SIDE] == 0 and sizes[CHAT] > wide, sizes
    assert not window.chat.side_toggle.isChecked()
    assert not window.actions_by_name["show_side"].isChecked()
    window.close()                                       # saves the settings
    again = MainWindow(store=store, data_dir=str(tmp_path / "data"))
    qtbot.addWidget(again)
    again.show()
    _at(qtbot, again, 1024, 700)
    assert again.splitter.sizes()[SIDE] == 0 and again.splitter.sizes()[LIST] == 0
    assert not again.chat.side_toggle.isChecked()
    again.chat.side_toggle.click()
    assert again.splitter.sizes()[SIDE] > 250 and again.chat.side_toggle.isChecked()
    again.close()


def _records(n, **over):
    base = dict(seconds=0.006, rss_bytes=160e6, peak_rss_bytes=165e6, trunk_bytes=0.0,
                expert_bytes=0.0, io_trunk_share=0.0, io_expert_share=0.0,
                true_resident_hit=0.0, retention=0.0, raw_hit=0.0)
    return [dict(base, **over) for _ in range(n)]


def test_plots_have_sane_axes_for_zero_and_tiny_series(qtbot, window):
    """An all-zero series (the demo reads nothing once warm, spends no time in I/O) got
    pyqtgraph's centred range: "read (mB)" from -400 to 400, "% (x0.001)"."""
    _at(qtbot, window, 1024, 700)
    p = window.plots
    p.on_records(_records(20))
    QApplication.processEvents()
    for plot in (p.p_gb, p.p_io, p.p_spt):
        lo, hi = plot.vb.viewRange()[1]
        assert lo == 0 and hi > 0, (plot.titleLabel.text, lo, hi)
        label = plot.getAxis("left").labelString()
        assert "x0.0" not in label and "(mB)" not in label, label
    assert "(ms)" in p.p_spt.getAxis("left").labelString()    # 6 ms a token, in ms


def test_the_plan_label_is_not_clipped(qtbot, window):
    _at(qtbot, window, 1024, 700)
    p = window.plots
    p.pages.setCurrentIndex(p.pages.indexOf(p.views["Memory"]))
    p.set_plan(167_410_000, 20_000_000_000)
    p.on_records(_records(30))
    QApplication.processEvents()
    label = p.l_plan.label
    assert label.toPlainText() == "plan 167.41 MB"
    box, view = label.sceneBoundingRect(), p.p_rss.vb.sceneBoundingRect()
    assert view.left() <= box.left() and box.right() <= view.right(), (box, view)


def test_status_messages_keep_their_room_beside_the_demo_badge(qtbot, window):
    from k3studio import demo
    _at(qtbot, window, 1024, 700)
    window.demo_label.setVisible(True)
    msg = "Loaded demo-model in 86.4 ms: trunk streamed; peak RSS after loading 203.14 MB"
    window.statusBar().showMessage(msg)
    QApplication.processEvents()
    permanent = window.demo_label.width() + window.rss_label.width()
    room = window.statusBar().width() - permanent
    assert room >= window.statusBar().fontMetrics().horizontalAdvance(msg) + 20, room
    assert window.demo_label.toolTip() == demo.DEMO_LABEL      # the sentence, on hover


def test_export_says_its_arrow(window):
    """The style drew the drop-down arrow over the last letters of "Export"."""
    b = window.sidebar.export_btn
    assert b.text().startswith("Export") and b.text().endswith("▾")
    assert b.sizeHint().width() >= b.fontMetrics().horizontalAdvance(b.text())


def test_the_current_preset_shows_in_its_drop_down(qtbot, window):
    """The current row ("custom") was drawn as an empty white box: white selected text on
    the combo rule's white background."""
    from PySide6.QtGui import QColor
    combo = window.memory.preset
    assert combo.currentText() == "custom"                  # the test store's preset
    window.tabs.setCurrentIndex(1)
    combo.showPopup()
    view = combo.view()
    qtbot.waitUntil(view.isVisible, timeout=TIMEOUT)
    rect = view.visualRect(view.model().index(combo.currentIndex(), 0))
    img = view.viewport().grab(rect).toImage()
    combo.hidePopup()
    colours = {QColor(img.pixel(x, y)).name() for x in range(0, img.width(), 3)
               for y in range(img.height())}
    assert "#2f6fe0" in colours, colours                    # the sheet's selection colour
