"""The local server's engine steps, polled for the plots: `GET /k3/steps?since=N` on the
app's own `k3 serve` (loopback), every POLL_MS while it serves.

Qt's network manager does the requests on the event loop (no thread, no blocking): one
request in flight at a time, so a slow answer makes the polls sparser, never a queue.
Each answer's steps are emitted in one list (the plots redraw once per poll, however many
steps it brought); an answer that is not the endpoint's (the server starting or stopping)
is skipped and the next poll asks again.
"""
from __future__ import annotations

import json

from PySide6.QtCore import QObject, QTimer, QUrl, Signal
from PySide6.QtNetwork import QNetworkAccessManager, QNetworkReply, QNetworkRequest

POLL_MS = 500


class StepsFeed(QObject):
    steps = Signal(object)            # list of step records (server/steps.py), in order

    def __init__(self, parent=None):
        super().__init__(parent)
        self.net = QNetworkAccessManager(self)
        self.timer = QTimer(self)
        self.timer.setInterval(POLL_MS)
        self.timer.timeout.connect(self.poll)
        self.root = ""
        self.since = 0
        self._reply: QNetworkReply | None = None

    def start(self, base_url: str) -> None:
        """`base_url`: the server's …/v1 URL."""
        self.root = base_url.removesuffix("/v1")
        self.since = 0
        self.timer.start()
        self.poll()

    def stop(self) -> None:
        self.timer.stop()
        if self._reply is not None:
            self._reply.abort()

    @property
    def running(self) -> bool:
        return self.timer.isActive()

    def poll(self) -> None:
        if self._reply is not None or not self.root:
            return
        r = self._reply = self.net.get(QNetworkRequest(QUrl(
            f"{self.root}/k3/steps?since={self.since}")))
        r.finished.connect(lambda: self._answered(r))

    def _answered(self, reply: QNetworkReply) -> None:
        self._reply = None
        reply.deleteLater()
        if reply.error() != QNetworkReply.NoError:
            return
        try:
            got = json.loads(bytes(reply.readAll().data()))
            steps, self.since = got["steps"], int(got["next"])
        except (ValueError, KeyError, TypeError):
            return
        if steps and self.timer.isActive():
            self.steps.emit(steps)


__all__ = ["StepsFeed", "POLL_MS"]
