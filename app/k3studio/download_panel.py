"""Download panel: the checkpoint from a Hugging Face hub with the engine's own downloader
(`k3 download`, tools/download.py): the same resolve, resumable Range fetches, free-space
refusal and verification, driven from a task thread.

The panel sees the download through a `download.Out` of its own: every log line and every
chunk's progress land in a lock-protected mailbox that a GUI timer drains (nothing is
dropped, nothing floods the event queue).  Pause raises from the progress hook, which stops
the fetch with its partial file kept (DEST/.k3-download), so Resume -- in this session or
after a restart -- continues from the byte it reached.  After a failed verification the
failing files are named and "Re-fetch failed" removes them and fetches them again.

HF_TOKEN is entered once and stored in the OS keyring where `keyring` has a usable backend,
else in a 0600 file in the app's config folder; it is never shown or logged (the
downloader masks it in every line).
"""
from __future__ import annotations

import argparse
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from PySide6.QtCore import QTimer, Signal
from PySide6.QtWidgets import (QFileDialog, QFormLayout, QGroupBox, QHBoxLayout, QHeaderView,
                               QLabel, QLineEdit, QPlainTextEdit, QProgressBar, QPushButton,
                               QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget)

from k3engine.atomic import write_atomic
from k3engine.inputfile import InputFileError, read_regular_file
from k3engine.memory import human, human_seconds
from k3engine.tools import download as dl

from .damaged import DamagedFile, check_regular
from .tasks import Task

POLL_MS = 100
KEYRING_SERVICE = "k3studio"
KEYRING_USER = "HF_TOKEN"
TOKEN_FILE = "hf_token"
TRUNK_SHARE = 108.81e9 / 1.561e12   # the packed trunk needs ~7 % of the checkpoint (§2.8)


class Paused(Exception):
    """Raised from the progress hook: stop now, keep the partial file."""


# ---- the token ---------------------------------------------------------------------------

def _keyring():
    """The keyring module when it has a usable backend, else None."""
    try:
        import keyring
        from keyring.backends import fail
    except ImportError:
        return None
    try:
        if isinstance(keyring.get_keyring(), fail.Keyring):
            return None
    except Exception:  # noqa: BLE001 - a broken backend is no backend
        return None
    return keyring


def token_file(config_dir: str | None = None) -> Path:
    if config_dir is None:
        from PySide6.QtCore import QStandardPaths
        config_dir = QStandardPaths.writableLocation(QStandardPaths.AppConfigLocation)
    return Path(config_dir) / TOKEN_FILE


def save_token(token: str, config_dir: str | None = None) -> str:
    """Store the token; returns where ("keyring" or the file's path)."""
    kr = _keyring()
    if kr is not None:
        kr.set_password(KEYRING_SERVICE, KEYRING_USER, token)
        return "keyring"
    path = token_file(config_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    # created 0600 from the start, and never through a link planted in the config folder
    # (the fixed temp name "<file>.tmp" was opened O_TRUNC, following one: issue 47)
    write_atomic(path, token.encode(), mode=0o600, inside=path.parent)
    return str(path)


def load_token(config_dir: str | None = None) -> str | None:
    kr = _keyring()
    if kr is not None:
        try:
            got = kr.get_password(KEYRING_SERVICE, KEYRING_USER)
        except Exception:  # noqa: BLE001 - fall back to the file
            got = None
        if got:
            return got
    path = token_file(config_dir)
    try:
        check_regular(str(path), 1 << 16)      # a FIFO or /dev/zero never reached
        return read_regular_file(path, 1 << 16, "token").decode("utf-8", "replace").strip() \
            or None
    except (DamagedFile, InputFileError):
        return None


# ---- the downloader's output, as seen by the GUI ---------------------------------------

@dataclass
class Progress:
    lines: list = field(default_factory=list)
    files: dict = field(default_factory=dict)       # name -> [have, size]
    current: str | None = None


class PanelOut(dl.Out):
    """download.Out for the panel: lines and per-chunk progress into a mailbox."""

    def __init__(self, token: str | None, pause: threading.Event):
        super().__init__([token])
        self.box = Progress()
        self.lock = threading.Lock()
        self.pause = pause

    def say(self, msg: str = "") -> None:
        with self.lock:
            self.box.lines.append(self.mask(msg))

    def err(self, msg: str) -> None:
        self.say(msg)

    def progress(self, name: str, have: int, size: int) -> None:
        with self.lock:
            self.box.files[name] = [have, size]
            self.box.current = name
        if self.pause.is_set():
            raise Paused(name)

    def take(self) -> Progress:
        with self.lock:
            box, self.box = self.box, Progress(files=dict(self.box.files),
                                               current=self.box.current)
        return box


def run_download(dest: str, repo: str, endpoint: str | None, token: str | None,
                 out: PanelOut, progress=None, cancelled=None) -> dict:
    """The `k3 download` run itself (download._run, the same code path), then -- if it
    failed -- the verification again, to name the files that failed."""
    a = argparse.Namespace(dest=dest, repo=repo, revision=None, endpoint=endpoint or None,
                           layers=None, verify_only=False, skip_checksum=False)
    try:
        code = dl._run(a, token, out)
    except dl.DownloadError as e:
        out.err(f"k3 download: FAIL {e}")
        code = dl.EXIT_FAIL
    bad: list[str] = []
    if code != dl.EXIT_OK:
        exp = dl.load_manifest(Path(dest), repo)
        if exp is not None:
            quiet = dl.Out([token])
            quiet.say = quiet.err = lambda *_a, **_k: None
            bad = dl.verify(Path(dest), exp, list(exp.files), True, quiet).bad
    return {"code": code, "bad": bad}


# ---- the panel -------------------------------------------------------------------------

class DownloadPanel(QWidget):
    finished = Signal(dict)           # {"code", "bad", "dest"} after a run (not after pause)
    paused = Signal()

    def __init__(self, config_dir: str | None = None, parent=None):
        super().__init__(parent)
        self.config_dir = config_dir
        self.out: PanelOut | None = None
        self.task: Task | None = None
        self._pause = threading.Event()
        self.result: dict | None = None
        self.state = "idle"               # idle, running, paused, done, failed
        self._expected = None             # download.Expected, once the run has saved it
        self._t0 = 0.0
        self._bytes0 = 0

        form_box = QGroupBox("Download a checkpoint")
        form = QFormLayout(form_box)
        self.repo = QLineEdit(dl.REAL_REPO_ID)
        form.addRow("Repository", self.repo)
        self.endpoint = QLineEdit()
        self.endpoint.setPlaceholderText("https://huggingface.co (default)")
        form.addRow("Hub", self.endpoint)
        row = QHBoxLayout()
        self.dest = QLineEdit()
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        row.addWidget(self.dest, 1)
        row.addWidget(browse)
        form.addRow("Destination", row)
        self.free = QLabel()
        self.free.setWordWrap(True)
        form.addRow(self.free)
        trow = QHBoxLayout()
        self.token = QLineEdit()
        self.token.setEchoMode(QLineEdit.Password)
        self.token.setPlaceholderText("HF_TOKEN (entered once, stored safely)")
        self.remember = QPushButton("Remember")
        self.remember.clicked.connect(self._remember)
        trow.addWidget(self.token, 1)
        trow.addWidget(self.remember)
        form.addRow("Access token", trow)
        self.token_note = QLabel()
        self.token_note.setObjectName("hint")
        form.addRow(self.token_note)

        btns = QHBoxLayout()
        self.start_btn = QPushButton("Start")
        self.pause_btn = QPushButton("Pause")
        self.refetch_btn = QPushButton("Re-fetch failed")
        self.pause_btn.setEnabled(False)
        self.refetch_btn.setEnabled(False)
        self.start_btn.clicked.connect(self.start)
        self.pause_btn.clicked.connect(self.pause)
        self.refetch_btn.clicked.connect(self.refetch_failed)
        for b in (self.start_btn, self.pause_btn, self.refetch_btn):
            btns.addWidget(b)
        btns.addStretch(1)

        self.overall = QProgressBar()
        self.overall.setRange(0, 1000)
        self.status = QLabel("Nothing downloading.")
        self.status.setWordWrap(True)
        self.files = QTableWidget(0, 3)
        self.files.setHorizontalHeaderLabels(["file", "size", "progress"])
        self.files.verticalHeader().setVisible(False)
        self.files.horizontalHeader().setSectionResizeMode(0, QHeaderView.Stretch)
        self.files.setEditTriggers(QTableWidget.NoEditTriggers)
        self.log = QPlainTextEdit()
        self.log.setReadOnly(True)
        self.log.setMaximumBlockCount(2000)

        lay = QVBoxLayout(self)
        lay.addWidget(form_box)
        lay.addLayout(btns)
        lay.addWidget(self.overall)
        lay.addWidget(self.status)
        lay.addWidget(self.files, 2)
        lay.addWidget(self.log, 1)

        self.timer = QTimer(self)
        self.timer.setInterval(POLL_MS)
        self.timer.timeout.connect(self._drain)
        self.dest.textChanged.connect(self._show_free)
        stored = load_token(config_dir)
        self.token_note.setText("A stored token will be used." if stored else
                                "No token stored (public repositories need none).")

    # -- token and destination ---------------------------------------------------------
    def _browse(self) -> None:
        d = QFileDialog.getExistingDirectory(self, "Download into")
        if d:
            self.dest.setText(d)

    def _remember(self) -> None:
        t = self.token.text().strip()
        if not t:
            return
        where = save_token(t, self.config_dir)
        self.token.clear()
        self.token_note.setText("Token stored in the OS keyring." if where == "keyring" else
                                "Token stored in a file only you can read (no keyring "
                                "backend on this system).")

    def _show_free(self) -> None:
        d = self.dest.text().strip()
        probe = Path(d)
        while probe != probe.parent and not probe.exists():
            probe = probe.parent
        try:
            free = dl.free_bytes(probe)
        except OSError:
            self.free.setText("")
            return
        need = dl.RELEASED_TOTAL if hasattr(dl, "RELEASED_TOTAL") else 1.561e12
        self.free.setText(f"{human(free)} free there; the released checkpoint needs "
                          f"{human(need)} and its packed trunk {human(need * TRUNK_SHARE)} "
                          f"more (checked against the hub's figures when you start)")

    # -- running -----------------------------------------------------------------------
    def start(self) -> None:
        if self.state == "running":          # (task.done flips only after `returned`)
            return
        dest = self.dest.text().strip()
        if not dest:
            self.status.setText("Choose a destination first.")
            return
        token = self.token.text().strip() or load_token(self.config_dir) \
            or os.environ.get("HF_TOKEN") or None
        self._pause.clear()
        self.out = PanelOut(token, self._pause)
        self.result = None
        self._expected = None
        self.state = "running"
        self._t0, self._bytes0 = time.monotonic(), None
        self.start_btn.setEnabled(False)
        self.pause_btn.setEnabled(True)
        self.refetch_btn.setEnabled(False)
        self.status.setText("Resolving the repository…")
        t = self.task = Task(run_download, dest, self.repo.text().strip(),
                             self.endpoint.text().strip(), token, self.out,
                             is_abort=lambda e: isinstance(e, Paused))
        t.returned.connect(self._returned)
        t.aborted.connect(self._paused)
        t.errored.connect(self._errored)
        t.finished.connect(self._drain)
        self.timer.start()
        t.start()

    def pause(self) -> None:
        if self.state == "running":
            self._pause.set()
            self.status.setText("Pausing after the chunk in flight…")

    def refetch_failed(self) -> None:
        """Remove the files that failed verification, then fetch them again."""
        bad = (self.result or {}).get("bad") or []
        dest = Path(self.dest.text().strip())
        for name in bad:
            p = dest / name
            if p.is_file():
                p.unlink()
        self.log.appendPlainText(f"removed {', '.join(bad)}; fetching again")
        self.start()

    def _returned(self, res: dict) -> None:
        self.result = dict(res, dest=self.dest.text().strip())
        ok = res["code"] == dl.EXIT_OK
        self.state = "done" if ok else "failed"
        self._drain()
        if ok:
            self.status.setText("Downloaded and verified. Next: pack the trunk (Setup → Pack "
                                "trunk) so it can be streamed.")
        elif res["bad"]:
            self.status.setText(f"Verification failed: {', '.join(res['bad'])}. Press "
                                f"Re-fetch failed to fetch {'it' if len(res['bad']) == 1 else 'them'}"
                                f" again.")
        else:
            self.status.setText("The download failed (see the log); Start resumes it.")
        self.refetch_btn.setEnabled(bool(res["bad"]))
        self._idle()
        self.finished.emit(self.result)

    def _paused(self) -> None:
        self.state = "paused"
        self._drain()
        self.status.setText("Paused. The partial file is kept: Start resumes from it, now or "
                            "after a restart.")
        self._idle()
        self.paused.emit()

    def _errored(self, e) -> None:
        self.state = "failed"
        self.status.setText(f"Failed: {type(e).__name__}: {e}")
        self._idle()
        self.finished.emit({"code": dl.EXIT_FAIL, "bad": [], "dest": self.dest.text()})

    def _idle(self) -> None:
        self.timer.stop()
        self.start_btn.setEnabled(True)
        self.start_btn.setText("Resume" if self.state in ("paused", "failed") else "Start")
        self.pause_btn.setEnabled(False)

    # -- progress ------------------------------------------------------------------------
    def _all_files(self, seen: dict) -> dict:
        """Every file of the download (the manifest the downloader saves before fetching):
        those in flight from the hook, the others from the disk (done, partial or not yet
        started), so the overall bar covers the whole checkpoint, not the files seen."""
        dest = Path(self.dest.text().strip())
        if self._expected is None:
            self._expected = dl.load_manifest(dest, self.repo.text().strip())
        if self._expected is None:
            return dict(seen)
        out = {}
        for name, fig in self._expected.files.items():
            if name in seen:
                out[name] = seen[name]
            elif dl._complete(dest / name, fig):
                out[name] = [fig.size, fig.size]
            else:
                part = dl.part_path(dest, fig)
                out[name] = [part.stat().st_size if part.exists() else 0, fig.size]
        return out

    def _drain(self) -> None:
        if self.out is None:
            return
        box = self.out.take()
        for line in box.lines:
            self.log.appendPlainText(line)
        files = self._all_files(box.files)
        if not files:
            return
        box.files = files
        names = sorted(box.files, key=lambda n: (bool(dl.SHARD_RE.match(n)), n))
        if self.files.rowCount() != len(names):
            self.files.setRowCount(len(names))
        have = sum(h for h, _ in box.files.values())
        size = sum(s for _, s in box.files.values())
        for r, n in enumerate(names):
            h, s = box.files[n]
            self.files.setItem(r, 0, QTableWidgetItem(n))
            self.files.setItem(r, 1, QTableWidgetItem(human(s)))
            bar = self.files.cellWidget(r, 2)
            if not isinstance(bar, QProgressBar):
                bar = QProgressBar()
                bar.setRange(0, 1000)
                self.files.setCellWidget(r, 2, bar)
            bar.setValue(int(1000 * h / s) if s else 1000)
        if self._bytes0 is None:
            self._bytes0 = have
        secs = max(time.monotonic() - self._t0, 1e-6)
        rate = (have - self._bytes0) / secs
        self.overall.setValue(int(1000 * have / size) if size else 0)
        eta = (size - have) / rate if rate > 0 else float("inf")
        if self.state == "running":
            self.status.setText(f"{box.current}: {human(have)} of {human(size)} overall, "
                                f"{human(rate)}/s" + (f", about {human_seconds(eta)} left"
                                                      if eta != float("inf") else ""))


def attach_download(window) -> None:
    """A Download tab; a verified download becomes the Setup tab's model (whose Pack trunk
    button is the next step); an unfinished one Setup meets is resumed here."""
    panel = window.download = DownloadPanel()
    window.tabs.addTab(panel, "Download")

    def done(res: dict) -> None:
        if res.get("code") == dl.EXIT_OK and res.get("dest"):
            window.setup.set_paths(res["dest"], "", "")
            window.tabs.setCurrentWidget(window.setup)

    def resume(state, dest: str) -> None:
        """Setup found an unfinished download: continue it here, from its manifest's hub."""
        if panel.state == "running":
            window.tabs.setCurrentWidget(panel)
            return
        panel.repo.setText(state.repo)
        panel.endpoint.setText(state.endpoint or "")
        panel.dest.setText(dest)
        window.tabs.setCurrentWidget(panel)
        panel.start()

    panel.finished.connect(done)
    window.setup.resumeDownload.connect(resume)
