"""Which engine the chat panel talks to: this machine's (worker.EngineHost) or a remote
endpoint (remote_host.RemoteHost).  `ChatBackend` has the interface both hosts implement
(chat_host.ChatHost) and relays the active host's observations only, so switching never
mixes two conversations.
`attach(window)` puts the backend choice into Setup and wires it."""
from __future__ import annotations

from PySide6.QtCore import QObject, Signal

from .chat_host import REQUESTS as FORWARDED
from .chat_host import SIGNALS as RELAYED
from .remote_host import LOCAL_ONLY


class ChatBackend(QObject):
    busyChanged = Signal(bool)
    conversation = Signal(object)
    turnStarted = Signal(object)
    records = Signal(object)
    prefillProgress = Signal(object)
    turnFinished = Signal(object)
    pendingChanged = Signal(object)

    def __init__(self, local, remote, parent=None):
        super().__init__(parent)
        self.local, self.remote = local, remote
        self.active = local
        for src in (local, remote):
            self.add(src)
        for name in FORWARDED:
            setattr(self, name, lambda *a, n=name: getattr(self.active, n)(*a))

    def add(self, src) -> None:
        """Another host the chat may talk to (the local server's slot, shared_engine.py):
        its observations are relayed while it is the active one."""
        for name in RELAYED:
            getattr(src, name).connect(
                lambda *a, s=src, n=name: s is self.active and getattr(self, n).emit(*a))

    @property
    def busy(self) -> bool:
        return self.active.busy

    @property
    def messages(self) -> list[dict]:
        return self.active.messages

    @property
    def is_remote(self) -> bool:
        return self.active is self.remote

    def use(self, host) -> None:
        if host is self.active:
            return
        if self.active.busy:
            self.active.stop()
        self.active = host
        host.refresh_conversation()
        self.pendingChanged.emit(dict(host.pending) if getattr(host, "pending", None)
                                 else None)
        self.busyChanged.emit(host.busy)


def attach(window) -> None:
    """The backend panel in Setup, and its effects on the chat and the plots."""
    from .backend_panel import BackendPanel
    panel = window.backend_panel = BackendPanel(window.data_dir)
    window.setup.layout().addWidget(panel, 2, 0, 1, 2)
    panel.load_from(window.settings)
    backend, remote = window.backend, window.remote

    def remote_ready(url: str, key: str, model: str) -> None:
        fresh = not remote.connected
        remote.configure(url, key, model)
        if fresh:
            remote.new_conversation(window.settings.system_prompt)
        # remote chats are saved and listed like local ones, the endpoint in their meta
        window.library.follow("remote", {"kind": "remote", "url": url, "model": model})
        backend.use(remote)
        window.chat.set_model(f"<b>{model}</b> · remote endpoint {url} · {LOCAL_ONLY}", True)
        window.plots.set_model(None)
        window.plots.summary.setText(f"Remote endpoint: {LOCAL_ONLY}. Each reply's stats "
                                     f"show time to first token, tokens/s and token counts.")

    def use_local() -> None:
        window.library.follow("local")
        backend.use(window.host)
        if window.host.loaded_info is not None:
            window._loaded(window.host.loaded_info)
        else:
            window._unloaded()

    def changed() -> None:
        for k, v in panel.values().items():
            setattr(window.settings, k, v)

    def local_loaded(_info) -> None:      # after the window's own handler: keep the label
        if backend.is_remote:
            remote_ready(remote.base_url, remote.api_key, remote.model)

    # Serve: one engine for the window and other apps (shared_engine.py)
    from .shared_engine import SharedEngine
    window.shared = SharedEngine(window, panel)
    window.local_server = window.shared.server

    panel.remoteReady.connect(remote_ready)
    window.host.loaded.connect(local_loaded)
    panel.useLocal.connect(use_local)
    panel.changed.connect(changed)
    remote.errored.connect(window._errored)
    remote.status.connect(lambda s: window.statusBar().showMessage(s, 10000))
