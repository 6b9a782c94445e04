"""Setup's backend choice: this machine's engine, or a remote OpenAI-compatible endpoint
(base URL, model id from its /v1/models, API key).  The key goes to secrets_store (the
OS keyring or a 0600 file: the panel says which), never to the settings file.  Connecting
runs on a thread: an unreachable URL is shown here as an error and nothing else changes."""
from __future__ import annotations

import threading

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (QCheckBox, QComboBox, QGroupBox, QHBoxLayout, QLabel,
                               QLineEdit, QPushButton, QRadioButton, QSizePolicy, QSpinBox,
                               QVBoxLayout)

from .secrets_store import KeyStore


class BackendPanel(QGroupBox):
    remoteReady = Signal(str, str, str)     # base URL, key, model id
    useLocal = Signal()
    changed = Signal()
    serveToggled = Signal(bool)             # the local server (local_server.py) on/off
    _listed = Signal(object, object)        # (models | None, error | None) from the thread

    def __init__(self, data_dir: str, parent=None):
        super().__init__("Backend", parent)
        self.keys = KeyStore(data_dir)
        self.local = QRadioButton("This machine's engine (loaded above)")
        self.remote = QRadioButton("Remote OpenAI-compatible endpoint (vLLM, SGLang, "
                                   "k3 serve…)")
        self.local.setChecked(True)
        self.url = QLineEdit()
        self.url.setPlaceholderText("http://127.0.0.1:8000/v1")
        self.key = QLineEdit()
        self.key.setEchoMode(QLineEdit.Password)
        self.key.setPlaceholderText("API key (empty if the server needs none)")
        self.key.setToolTip(f"Kept in {self.keys.where()}, never in the settings file")
        self.connect_btn = QPushButton("Connect")
        self.model = QComboBox()
        self.model.setToolTip("The model ids the endpoint lists at /v1/models")
        self.state = QLabel("Using this machine's engine.")
        self.state.setTextInteractionFlags(Qt.TextSelectableByMouse)
        # a long URL or error must not widen the window: the label is clipped, and the
        # whole text is its tooltip
        self.state.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        where = f"API key storage: {self.keys.where()}"
        self.where = QLabel(where)          # shown as the key field's and panel's tooltip
        self.setToolTip(where)
        self.serve = QCheckBox("Serve this model to other apps")
        self.serve.setToolTip("Runs k3 serve on 127.0.0.1 with the model, trunk and memory "
                              "settings above, and the app releases its own engine: one copy "
                              "of the model answers other apps and this window's chat (one "
                              "of the server's slots)")
        self.slots = QSpinBox()
        self.slots.setRange(0, 64)
        self.slots.setSpecialValueText("auto")
        self.slots.setPrefix("slots ")
        self.slots.setToolTip("Conversations the server decodes together (k3 serve "
                              "--parallel), this window's among them; auto: the most the "
                              "memory plan fits, up to 4.  Applies when Serve starts.")
        self.serve_url = QLineEdit()
        self.serve_url.setReadOnly(True)
        self.serve_url.setPlaceholderText("not serving")
        copy = QPushButton("Copy URL")
        copy.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.serve_url.text()))
        # four compact rows: the window must stay usable at 1024x700 (test_app_look)
        rows = [QHBoxLayout() for _ in range(4)]
        rows[0].addWidget(self.local)
        rows[0].addWidget(self.remote, 1)
        rows[1].addWidget(QLabel("Base URL"))
        rows[1].addWidget(self.url, 2)
        rows[1].addWidget(QLabel("API key"))
        rows[1].addWidget(self.key, 1)
        rows[1].addWidget(self.connect_btn)
        rows[2].addWidget(QLabel("Model"))
        rows[2].addWidget(self.model, 1)
        rows[2].addWidget(self.state, 3)
        rows[3].addWidget(self.serve)
        rows[3].addWidget(self.slots)
        rows[3].addWidget(self.serve_url, 1)
        rows[3].addWidget(copy)
        lay = QVBoxLayout(self)
        lay.setSpacing(4)
        for r in rows:
            lay.addLayout(r)
        lay.addStretch(1)                   # the rows stay together when the tab is tall
        self.serve.toggled.connect(self.serveToggled)
        self.slots.valueChanged.connect(lambda _v: self.changed.emit())
        self.connect_btn.clicked.connect(self.connect_remote)
        self.local.toggled.connect(self._choice)
        self.model.currentTextChanged.connect(self._model_chosen)
        self._listed.connect(self._on_listed)
        self._models_for = ""
        self._saved_model = ""
        self._locked = False
        self._fields_enabled()

    # -- settings -------------------------------------------------------------------
    def load_from(self, s) -> None:
        self.url.setText(s.remote_url)
        self._saved_model = s.remote_model
        if s.remote_url:
            self.key.setText(self.keys.get(s.remote_url))
        (self.remote if s.backend == "remote" else self.local).setChecked(True)
        self.slots.setValue(s.serve_slots)
        self._fields_enabled()

    def values(self) -> dict:
        return dict(backend="remote" if self.remote.isChecked() else "local",
                    remote_url=self.url.text().strip(),
                    remote_model=self.model.currentText() or self._saved_model,
                    serve_slots=self.slots.value())

    # -- actions --------------------------------------------------------------------
    def lock(self, locked: bool) -> None:
        """While serving, the chat's backend and the slot count stay as they are."""
        self._locked = locked
        for w in (self.local, self.remote, self.slots):
            w.setEnabled(not locked)
        self._fields_enabled()

    def _fields_enabled(self) -> None:
        on = self.remote.isChecked() and not self._locked
        for w in (self.url, self.key, self.connect_btn, self.model):
            w.setEnabled(on)

    def _choice(self, local: bool) -> None:
        self._fields_enabled()
        self.changed.emit()
        if local:
            self._say("Using this machine's engine.")
            self.useLocal.emit()

    def connect_remote(self) -> None:
        """List the endpoint's models on a thread; the first (or the saved one) is used."""
        from .remote_client import Endpoint, RemoteError
        url, key = self.url.text().strip(), self.key.text()
        try:
            ep = Endpoint(url, key)
        except RemoteError as e:
            self._show_error(str(e))
            return
        self.connect_btn.setEnabled(False)
        self._say(f"Connecting to {url} …")
        self._models_for = url

        def job():
            try:
                self._listed.emit(ep.models(), None)
            except RemoteError as e:
                self._listed.emit(None, str(e))
            except Exception as e:            # noqa: BLE001 - shown, never lost
                self._listed.emit(None, f"{type(e).__name__}: {e}")
        threading.Thread(target=job, name="k3studio-models", daemon=True).start()

    def _on_listed(self, models, error) -> None:
        self.connect_btn.setEnabled(self.remote.isChecked())
        if error is not None:
            self._show_error(error)
            return
        if not models:
            self._show_error(f"{self._models_for} lists no models at /v1/models")
            return
        url, key = self._models_for, self.key.text()
        self.keys.set(url, key)
        self.model.blockSignals(True)
        self.model.clear()
        self.model.addItems(models)
        if self._saved_model in models:
            self.model.setCurrentText(self._saved_model)
        self.model.blockSignals(False)
        self.state.setStyleSheet("")
        self._say(f"Connected to {url}: chat uses {self.model.currentText()} there. "
                  f"Memory and I/O plots are local-only.")
        self.changed.emit()
        self.remoteReady.emit(url, key, self.model.currentText())

    def _model_chosen(self, model: str) -> None:
        if model and self._models_for:
            self._saved_model = model
            self.changed.emit()
            self.remoteReady.emit(self._models_for, self.key.text(), model)

    def _show_error(self, message: str) -> None:
        self.state.setStyleSheet("color: #b3261e;")
        self._say(f"Not connected: {message}")

    def _say(self, text: str) -> None:
        self.state.setText(text)
        self.state.setToolTip(text)
