"""The conversation list: a sidebar over the conversations folder (conversations.py).

Search filters by title and text; double-click or F2 renames in place; Delete moves the
conversation to the trash with an Undo bar (no confirmation dialog to click through, and
nothing is lost by a slip); Export writes the reference JSONL or Markdown.  The panel only
lists and edits files: which conversation is open is the window's business (`openRequested`).
"""
from __future__ import annotations

import os
import weakref

from PySide6.QtCore import QStandardPaths, Qt, Signal
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (QFileDialog, QHBoxLayout, QLabel, QLineEdit,
                               QListWidget, QListWidgetItem, QMenu, QPushButton, QToolButton,
                               QVBoxLayout, QWidget)

from . import damaged
from .conversations import ConversationStore
from .notice_bar import NoticeBar

ID_ROLE = Qt.UserRole


class ConversationsPanel(QWidget):
    openRequested = Signal(str)        # a conversation id
    newRequested = Signal()
    deleted = Signal(str)              # a conversation id (moved to the trash)
    restored = Signal(str)

    def __init__(self, store: ConversationStore, parent=None):
        super().__init__(parent)
        self.store = store
        self.current: str | None = None
        self._undo_id: str | None = None
        self._filling = False

        self.new_btn = QPushButton("New chat")
        self.new_btn.setObjectName("primary")
        self.new_btn.setToolTip("Start a new conversation (Ctrl+N)")
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search titles and text…")
        self.search.setClearButtonEnabled(True)
        self.list = QListWidget()
        self.list.setObjectName("conversations")
        self.list.setTextElideMode(Qt.ElideRight)         # long titles end in "…"
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.list.setUniformItemSizes(True)
        self.list.setEditTriggers(QListWidget.EditKeyPressed | QListWidget.SelectedClicked)
        self.list.setToolTip("Double-click or F2 to rename; Delete to remove (with Undo)")
        self.empty = QLabel("No conversations yet: send a message and it appears here.")
        self.empty.setObjectName("hint")
        self.empty.setWordWrap(True)

        self.rename_btn = QToolButton()
        self.rename_btn.setText("Rename")
        self.delete_btn = QToolButton()
        self.delete_btn.setText("Delete")
        self.export_btn = QToolButton()
        # the arrow in the text: the style's menu indicator was drawn over "Export"
        self.export_btn.setObjectName("menu_button")
        self.export_btn.setText("Export ▾")
        self.export_btn.setPopupMode(QToolButton.InstantPopup)
        menu = QMenu(self.export_btn)
        menu.addAction("As JSONL (k3 --history)…", lambda: self.export_dialog("jsonl"))
        menu.addAction("As Markdown…", lambda: self.export_dialog("md"))
        self.export_btn.setMenu(menu)
        tools = QHBoxLayout()
        for b in (self.rename_btn, self.delete_btn, self.export_btn):
            tools.addWidget(b)
        tools.addStretch(1)

        self.undo_bar = NoticeBar("Undo")
        self.undo_label, self.undo_btn = self.undo_bar.label, self.undo_bar.button
        # files of the data folder that could not be read and were moved aside (damaged.py):
        # each said once, here, naming the file
        self.damage_bar = NoticeBar("Dismiss")
        self.damage_notes: list[str] = []
        self.damage_bar.button.clicked.connect(self._dismiss_damage)

        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 4, 0)
        lay.addWidget(self.new_btn)
        lay.addWidget(self.search)
        lay.addWidget(self.list, 1)
        lay.addWidget(self.empty)
        lay.addWidget(self.undo_bar)
        lay.addWidget(self.damage_bar)
        lay.addLayout(tools)

        self.new_btn.clicked.connect(self.newRequested)
        self.search.textChanged.connect(lambda _t: self.refresh())
        self.list.itemActivated.connect(self._activated)
        self.list.itemClicked.connect(self._activated)
        self.list.itemDoubleClicked.connect(self.list.editItem)
        self.list.itemChanged.connect(self._item_renamed)
        self.rename_btn.clicked.connect(self._rename_selected)
        self.delete_btn.clicked.connect(self._delete_selected)
        self.undo_btn.clicked.connect(self.undo)
        QShortcut(QKeySequence.Delete, self.list, self._delete_selected,
                  context=Qt.WidgetShortcut)
        self._listen_for_damage()
        self.refresh()

    # -- files moved aside -------------------------------------------------------------
    def _listen_for_damage(self) -> None:
        ref = weakref.ref(self)

        def note(text: str) -> bool:
            panel = ref()
            try:
                if panel is not None:
                    panel.add_damage_notice(text)
                    return True
            except RuntimeError:        # the widget is gone (its window closed)
                pass
            damaged.unsubscribe(note)
            return False

        damaged.subscribe(note)
        for text in damaged.take_notices():
            self.add_damage_notice(text)

    def add_damage_notice(self, text: str) -> None:
        self.damage_notes.append(text)
        self.damage_bar.label.setText("\n".join(self.damage_notes))
        self.damage_bar.label.setToolTip("Moved aside, never deleted: the files can be "
                                         "inspected or put back by hand")
        self.damage_bar.show()

    def _dismiss_damage(self) -> None:
        self.damage_notes.clear()
        self.damage_bar.hide()

    # -- the list ---------------------------------------------------------------------
    def refresh(self) -> None:
        self._filling = True
        try:
            self.list.clear()
            for m in self.store.search(self.search.text()):
                item = QListWidgetItem(m.title)
                item.setData(ID_ROLE, m.id)
                item.setFlags(item.flags() | Qt.ItemIsEditable)
                tip = m.title
                if m.model_dir:
                    tip += f"\nmodel: {m.model_dir}"
                if m.incomplete:
                    tip += "\nlast reply incomplete (Continue resumes it)"
                item.setToolTip(tip)
                self.list.addItem(item)
                if m.id == self.current:
                    self.list.setCurrentItem(item)
        finally:
            self._filling = False
        searching = bool(self.search.text().strip())
        self.empty.setText("Nothing matches the search." if searching else
                           "No conversations yet: send a message and it appears here.")
        self.empty.setVisible(self.list.count() == 0)
        has = self.list.currentItem() is not None
        for b in (self.rename_btn, self.delete_btn, self.export_btn):
            b.setEnabled(has)

    def titles(self) -> list[str]:
        return [self.list.item(i).text() for i in range(self.list.count())]

    def set_current(self, cid: str | None) -> None:
        self.current = cid
        self.refresh()

    def _selected_id(self) -> str | None:
        item = self.list.currentItem()
        return item.data(ID_ROLE) if item is not None else None

    def _activated(self, item: QListWidgetItem) -> None:
        cid = item.data(ID_ROLE)
        for b in (self.rename_btn, self.delete_btn, self.export_btn):
            b.setEnabled(True)
        if cid and cid != self.current:
            self.openRequested.emit(cid)

    # -- rename -----------------------------------------------------------------------
    def rename(self, cid: str, title: str) -> None:
        self.store.rename(cid, title)
        self.refresh()

    def _rename_selected(self) -> None:
        item = self.list.currentItem()
        if item is not None:
            self.list.editItem(item)

    def _item_renamed(self, item: QListWidgetItem) -> None:
        if self._filling:
            return
        cid = item.data(ID_ROLE)
        if cid:
            self.store.rename(cid, item.text())
            self.refresh()

    # -- delete / undo --------------------------------------------------------------------
    def delete(self, cid: str) -> None:
        title = self.store.meta(cid).title or cid
        self.store.delete(cid)
        self._undo_id = cid
        self.undo_label.setText(f"Deleted “{title}”.")
        self.undo_bar.show()
        self.deleted.emit(cid)
        self.refresh()

    def _delete_selected(self) -> None:
        cid = self._selected_id()
        if cid:
            self.delete(cid)

    def undo(self) -> None:
        cid, self._undo_id = self._undo_id, None
        self.undo_bar.hide()
        if cid and self.store.undo_delete(cid):
            self.restored.emit(cid)
            self.refresh()

    # -- export -----------------------------------------------------------------------
    def export_dialog(self, kind: str, cid: str | None = None) -> None:
        cid = cid or self._selected_id() or self.current
        if not cid:
            return
        title = self.store.meta(cid).title or "conversation"
        safe = "".join(c if c.isalnum() or c in " -_" else "_" for c in title).strip()
        docs = QStandardPaths.writableLocation(QStandardPaths.DocumentsLocation)
        ext, filt = (("jsonl", "Conversations (*.jsonl)") if kind == "jsonl" else
                     ("md", "Markdown (*.md)"))
        path, _ = QFileDialog.getSaveFileName(
            self, "Export conversation", os.path.join(docs, f"{safe or 'conversation'}.{ext}"),
            f"{filt};;All files (*)")
        if path:
            self.export(cid, path, kind)

    def export(self, cid: str, path: str, kind: str) -> None:
        if kind == "jsonl":
            self.store.export_jsonl(cid, path)
        else:
            self.store.export_markdown(cid, path)
