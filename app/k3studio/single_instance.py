"""One K3 Studio per data folder: a second start raises the first window and exits.

Two instances on one data folder would write the same settings, conversations and demo
model.  The first instance listens on a local socket whose name is derived from the data
folder (and the user); a later start connects to it, asks it to raise its window, and
quits.  A socket left by a crashed instance is removed before listening."""
from __future__ import annotations

import hashlib
import os

from PySide6.QtCore import QObject, Signal
from PySide6.QtNetwork import QLocalServer, QLocalSocket

RAISE = b"raise\n"
WAIT_MS = 2000


def server_name(data_dir: str) -> str:
    key = f"{os.getuid() if hasattr(os, 'getuid') else ''}:{os.path.realpath(data_dir)}"
    return "k3studio-" + hashlib.sha256(key.encode()).hexdigest()[:20]


def raise_running(data_dir: str) -> bool:
    """True when an instance on this data folder is running (it was asked to raise its
    window)."""
    sock = QLocalSocket()
    sock.connectToServer(server_name(data_dir))
    if not sock.waitForConnected(WAIT_MS):
        return False
    sock.write(RAISE)
    sock.waitForBytesWritten(WAIT_MS)
    sock.disconnectFromServer()
    return True


class InstanceServer(QObject):
    """The first instance's listener; `raiseRequested` when a later start asks."""

    raiseRequested = Signal()

    def __init__(self, data_dir: str, parent=None):
        super().__init__(parent)
        self.server = QLocalServer(self)
        self.server.setSocketOptions(QLocalServer.UserAccessOption)
        name = server_name(data_dir)
        QLocalServer.removeServer(name)          # a crashed instance's stale socket
        self.listening = self.server.listen(name)
        self.server.newConnection.connect(self._accept)

    def _accept(self) -> None:
        while self.server.hasPendingConnections():
            sock = self.server.nextPendingConnection()
            sock.readyRead.connect(lambda s=sock: self._read(s))
            sock.disconnected.connect(sock.deleteLater)

    def _read(self, sock) -> None:
        if RAISE.strip() in bytes(sock.readAll()):
            self.raiseRequested.emit()


def raise_window(win) -> None:
    win.showNormal() if win.isMinimized() else win.show()
    win.raise_()
    win.activateWindow()
