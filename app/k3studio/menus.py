"""The menu bar with the usual shortcuts, and the small Settings dialog (Ctrl+,).

File: New conversation (Ctrl+N), Open… (Ctrl+O: import a §9.1 JSONL file into the
conversation list), Export as JSONL… (Ctrl+S), Export as Markdown… (Ctrl+Shift+S),
Save benchmark datapoint… (datapoint_action.py), Quit (Ctrl+Q).  Chat: Stop (Esc), Continue, Regenerate.  View: the side panels, engine details, theme.  Settings… (Ctrl+,).
The window keeps the actions (`win.actions_by_name`) so tests and panels trigger the same
thing a person does.
"""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QAction, QActionGroup, QKeySequence
from PySide6.QtWidgets import (QComboBox, QDialog, QDialogButtonBox, QFileDialog,
                               QFormLayout, QLabel)

THEME_LABELS = {"system": "Follow the system", "light": "Light", "dark": "Dark"}


def build_menus(win) -> dict[str, QAction]:
    acts: dict[str, QAction] = {}
    bar = win.menuBar()

    def add(menu, name, text, slot, shortcut=None, tip=""):
        a = QAction(text, win)
        if shortcut:
            a.setShortcut(QKeySequence(shortcut))
        a.setStatusTip(tip)
        a.triggered.connect(slot)
        menu.addAction(a)
        acts[name] = a
        return a

    f = bar.addMenu("&File")
    add(f, "new", "&New conversation", win.new_conversation, "Ctrl+N")
    add(f, "open", "&Open conversation file…", lambda: open_dialog(win), "Ctrl+O",
        "Import a JSONL conversation (k3 --history format) into the list")
    f.addSeparator()
    add(f, "export_jsonl", "&Export as JSONL…",
        lambda: win.sidebar.export_dialog("jsonl", win.library.current), "Ctrl+S")
    add(f, "export_md", "Export as &Markdown…",
        lambda: win.sidebar.export_dialog("md", win.library.current), "Ctrl+Shift+S")
    f.addSeparator()
    add(f, "datapoint", "Save benchmark &datapoint…", lambda: win.datapoint.save_dialog(),
        tip="A shareable record of the last reply: machine, model, plan, s/token, first "
            "token, hit rate, peak RSS (k3 datapoint); nothing personal in it")
    f.addSeparator()
    add(f, "settings", "Se&ttings…", lambda: SettingsDialog(win).exec(), "Ctrl+,")
    f.addSeparator()
    add(f, "quit", "&Quit", win.close, "Ctrl+Q")
    acts["quit"].setMenuRole(QAction.QuitRole)
    acts["settings"].setMenuRole(QAction.PreferencesRole)

    c = bar.addMenu("&Chat")
    # Esc itself is the chat panel's shortcut (enabled only while a reply runs); the menu
    # shows it so it can be found.
    add(c, "stop", "&Stop\tEsc", win.chat.stop)
    add(c, "continue", "&Continue the stopped reply", win.chat.continue_reply)
    add(c, "regenerate", "&Regenerate", win.chat.regenerate)

    v = bar.addMenu("&View")
    for name, text, key, toggle in (
            ("show_list", "&Conversation list", "Ctrl+Shift+L", win.chat.list_toggle),
            ("show_side", "Telemetry and settings &panel", "Ctrl+Shift+P", win.chat.side_toggle),
            ("details", "Engine &details", "Ctrl+Shift+D", win.chat.details_toggle)):
        a = QAction(text, win, checkable=True)
        a.setShortcut(QKeySequence(key))
        # the action and the chat bar's button are one switch
        a.setChecked(toggle.isChecked())
        a.toggled.connect(toggle.setChecked)
        toggle.toggled.connect(a.setChecked)
        v.addAction(a)
        acts[name] = a
    v.addSeparator()
    group = QActionGroup(win)
    for key, label in THEME_LABELS.items():
        a = QAction(label, win, checkable=True)
        a.setChecked(win.settings.theme == key)
        a.triggered.connect(lambda _c=False, k=key: win.set_theme(k))
        group.addAction(a)
        v.addAction(a)
        acts[f"theme_{key}"] = a
    return acts


def open_dialog(win) -> None:
    path, _ = QFileDialog.getOpenFileName(win, "Open conversation", win.library.store.root,
                                          "Conversations (*.jsonl);;All files (*)")
    if path:
        win.library.import_file(path)


class SettingsDialog(QDialog):
    """What the app keeps outside the panels: the look, and where conversations live."""

    def __init__(self, win):
        super().__init__(win)
        self.setWindowTitle("Settings")
        self.theme = QComboBox()
        for key, label in THEME_LABELS.items():
            self.theme.addItem(label, key)
        self.theme.setCurrentIndex(list(THEME_LABELS).index(win.settings.theme)
                                   if win.settings.theme in THEME_LABELS else 0)
        self.theme.currentIndexChanged.connect(
            lambda _i: win.set_theme(self.theme.currentData()))
        folder = QLabel(win.library.store.root)
        folder.setTextInteractionFlags(Qt.TextSelectableByMouse)
        folder.setWordWrap(True)
        data = QLabel(win.data_dir)
        data.setTextInteractionFlags(Qt.TextSelectableByMouse)
        data.setWordWrap(True)
        form = QFormLayout(self)
        form.addRow("Theme", self.theme)
        form.addRow("Conversations", folder)
        form.addRow("Data folder", data)
        buttons = QDialogButtonBox(QDialogButtonBox.Close)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)
