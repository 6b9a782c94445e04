"""A one-line notice with one button (Undo a deletion, Cancel an edit), hidden until
there is something to say."""
from __future__ import annotations

from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton


class NoticeBar(QFrame):
    def __init__(self, button: str, parent=None):
        super().__init__(parent)
        self.setObjectName("undo_bar")
        lay = QHBoxLayout(self)
        lay.setContentsMargins(6, 2, 6, 2)
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.button = QPushButton(button)
        lay.addWidget(self.label, 1)
        lay.addWidget(self.button)
        self.hide()
