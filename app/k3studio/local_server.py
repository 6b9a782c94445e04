"""`k3 serve` started from the app: this machine's model offered to other apps on loopback.

It runs as its own process with the run's model, trunk, tokenizer and memory flags
(runspec.model_flags) and `--parallel N`, on 127.0.0.1, so it is exactly the CLI's server.
The app releases its own engine first and chats through this server as one of its N slots
(shared_engine.py): one copy of the model, whoever asks.  The port is the one it had last
time (kept in the settings, so other apps' configured URL stays right when the toggle is
switched off and on); a free one the first time, or when that port is taken.  The URL
comes from the server's own `listening on` line.  Stop sends SIGTERM (uvicorn shuts down,
the engine stops at a safe point); a process that does not end in 10 s is killed.  The QProcess is parented to the
window, and Qt kills a still-running child when it is destroyed.
"""
from __future__ import annotations

import re
import sys

from PySide6.QtCore import QObject, QProcess, Signal

LISTENING = re.compile(r"k3 serve: listening on (http://\S+)")


def serve_argv(spec, port: int = 0, cache_dir: str | None = None,
               parallel: int = 1) -> list[str]:
    """`cache_dir`: the prompt cache on disk (a folder in the app's data folder), so the
    server, restarted, skips the prefill of a conversation it has seen; `parallel`: the
    slots (requests decoded together, the app's own chat one of them)."""
    from .runspec import model_flags
    return ["-m", "k3engine", "serve", spec.model_dir, *model_flags(spec),
            "--host", "127.0.0.1", "--port", str(int(port)), "--parallel", str(int(parallel)),
            *(["--prompt-cache-dir", cache_dir] if cache_dir else [])]


class LocalServer(QObject):
    started = Signal(str)             # the base URL (…/v1)
    stopped = Signal(int, str)        # exit code, the last lines it printed

    def __init__(self, parent=None, cache_dir: str | None = None):
        super().__init__(parent)
        self.cache_dir = cache_dir
        self.proc: QProcess | None = None
        self.url = ""
        self.port = 0                     # the port to ask for (0: any free one)
        self._out: list[str] = []
        self._spec = None
        self._asked = 0
        self.parallel = 1                 # the slots of the running (or next) server

    @property
    def running(self) -> bool:
        return self.proc is not None

    def start(self, spec, parallel: int = 1) -> None:
        if self.proc is not None:
            return
        self.parallel = int(parallel)
        self._out, self.url = [], ""
        self._spec, self._asked = spec, self.port
        p = self.proc = QProcess(self)
        p.setProcessChannelMode(QProcess.MergedChannels)
        p.readyReadStandardOutput.connect(self._read)
        p.finished.connect(self._finished)
        p.start(sys.executable, serve_argv(spec, self.port, self.cache_dir, self.parallel))

    def stop(self) -> None:
        p = self.proc
        if p is None:
            return
        p.terminate()
        if not p.waitForFinished(10000):
            p.kill()
            p.waitForFinished(5000)

    def _read(self) -> None:
        text = bytes(self.proc.readAllStandardOutput().data()).decode("utf-8", "replace")
        for line in text.splitlines():
            self._out = (self._out + [line])[-20:]
            m = LISTENING.search(line)
            if m and not self.url:
                self.url = m.group(1) + "/v1"
                port = re.search(r":(\d+)$", m.group(1))
                if port:
                    self.port = int(port.group(1))
                self.started.emit(self.url)

    def _finished(self, code: int, status) -> None:
        never_listened = not self.url
        if status == QProcess.CrashExit:      # its own last line would be "listening on"
            self._out.append("the server process was killed or crashed")
        self.proc, self.url = None, ""
        if never_listened and code != 0 and self._asked:
            self.port = 0                 # the remembered port is taken: any free one
            self.start(self._spec, self.parallel)
            return
        self.stopped.emit(code, "\n".join(self._out[-6:]))
