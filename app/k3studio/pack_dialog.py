"""The "Pack trunk" dialog: `pack_trunk` on a background task with progress, a time and
space estimate, and Cancel (the engine's pack is atomic, so a cancelled pack leaves
nothing that looks valid)."""
from __future__ import annotations

import os
import shutil
import time

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QDialog, QDialogButtonBox, QFileDialog, QFormLayout,
                               QHBoxLayout, QLabel, QLineEdit, QProgressBar, QPushButton,
                               QVBoxLayout)

from k3engine.memory import human, human_seconds

from .tasks import Task

# A first guess for the estimate, replaced by the measured rate once bytes move.
ASSUMED_COPY_BYTES_PER_S = 500e6


def default_trunk_dir(model_dir: str) -> str:
    model_dir = os.path.normpath(model_dir)
    return model_dir + "-trunk"


class PackDialog(QDialog):
    packed = Signal(str)               # the trunk directory, after a complete pack

    def __init__(self, model_dir: str, trunk_bytes: int, n_layers: int = 0, parent=None):
        super().__init__(parent)
        self.setWindowTitle("Pack the trunk")
        self.setMinimumWidth(560)
        self.model_dir, self.trunk_bytes, self.n_layers = model_dir, trunk_bytes, n_layers
        self.task: Task | None = None
        self.result_dir: str | None = None
        self.outcome = ""              # "", "done", "cancelled", "failed"

        intro = QLabel("Packing copies every layer's trunk (all but the routed experts) into "
                       "one file, aligned for direct reads, so the engine can stream it "
                       "within a memory budget. The checkpoint is not changed.")
        intro.setWordWrap(True)
        self.dest = QLineEdit(default_trunk_dir(model_dir))
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        row = QHBoxLayout()
        row.addWidget(self.dest, 1)
        row.addWidget(browse)
        form = QFormLayout()
        form.addRow("Checkpoint", QLabel(model_dir))
        form.addRow("Trunk directory", row)
        self.estimate = QLabel()
        self.estimate.setWordWrap(True)
        form.addRow("Estimate", self.estimate)
        self.bar = QProgressBar()
        self.bar.setRange(0, 1000)
        self.status = QLabel("Ready.")
        self.status.setWordWrap(True)
        self.buttons = QDialogButtonBox()
        self.start_btn = self.buttons.addButton("Start packing", QDialogButtonBox.AcceptRole)
        self.start_btn.setObjectName("primary")
        self.cancel_btn = self.buttons.addButton("Cancel", QDialogButtonBox.RejectRole)
        self.start_btn.clicked.connect(self.start)
        self.cancel_btn.clicked.connect(self.cancel)
        lay = QVBoxLayout(self)
        lay.addWidget(intro)
        lay.addLayout(form)
        lay.addWidget(self.bar)
        lay.addWidget(self.status)
        lay.addWidget(self.buttons)
        self.dest.textChanged.connect(self._estimate)
        self._estimate()
        self._t0 = 0.0

    def _browse(self) -> None:
        d = QFileDialog.getExistingDirectory(self, "Trunk directory", self.dest.text())
        if d:
            self.dest.setText(d)

    def _free(self, path: str) -> int | None:
        d = os.path.abspath(path)
        while d and not os.path.exists(d):
            d = os.path.dirname(d)
        try:
            return shutil.disk_usage(d).free
        except OSError:
            return None

    def _estimate(self) -> None:
        free = self._free(self.dest.text())
        secs = self.trunk_bytes / ASSUMED_COPY_BYTES_PER_S
        text = (f"{human(self.trunk_bytes)} to write; about "
                f"{human_seconds(max(secs, 1))} at {human(ASSUMED_COPY_BYTES_PER_S)}/s "
                f"(refined from the measured rate once packing starts). ")
        ok = True
        if free is not None:
            text += f"{human(free)} free at the destination."
            if free < self.trunk_bytes * 1.02:
                text += " NOT ENOUGH SPACE."
                ok = False
        self.estimate.setText(text)
        self.start_btn.setEnabled(ok and self.task is None and bool(self.dest.text().strip()))

    def start(self) -> None:
        if self.task is not None:
            return
        from k3engine.trunk import PackCancelled, pack_trunk
        dest = os.path.expanduser(self.dest.text().strip())
        self.status.setText("Packing…")
        self.outcome = ""
        self._t0 = time.monotonic()

        def job(progress, cancelled):
            return pack_trunk(self.model_dir, dest,
                              progress=lambda L, done, total: progress((L, done, total)),
                              cancel=cancelled)
        self.task = Task(job, is_abort=lambda e: isinstance(e, PackCancelled))
        self.task.progress.connect(self._progress)
        self._dest = dest
        self.task.returned.connect(self._returned)
        self.task.aborted.connect(self._aborted)
        self.task.errored.connect(self._failed)
        self.start_btn.setEnabled(False)
        self.dest.setEnabled(False)
        self.task.start()

    def cancel(self) -> None:
        if self.task is not None and not self.task.done:
            self.status.setText("Cancelling after the chunk in flight…")
            self.task.abort()
        else:
            self.reject()

    def _progress(self, value) -> None:
        layers, done, total = value
        self.bar.setValue(int(1000 * done / total) if total else 0)
        dt = time.monotonic() - self._t0
        rate = done / dt if dt > 0 else 0
        left = (total - done) / rate if rate > 0 else 0
        self.status.setText(f"layer {layers}/{self.n_layers or '?'}: {human(done)} of "
                            f"{human(total)} ({human(rate)}/s, about {human_seconds(left)} left)")

    def _finish(self) -> None:
        self.task = None
        self.cancel_btn.setText("Close")
        self.dest.setEnabled(True)

    def _returned(self, _manifest) -> None:
        self._done(self._dest)

    def _done(self, dest: str) -> None:
        self.bar.setValue(1000)
        self.outcome, self.result_dir = "done", dest
        self.status.setText(f"Packed into {dest} in {human_seconds(time.monotonic() - self._t0)}.")
        self._finish()
        self.packed.emit(dest)

    def _aborted(self) -> None:
        self.outcome = "cancelled"
        self.status.setText("Cancelled: nothing was left under the final names.")
        self._finish()
        self._estimate()

    def _failed(self, e: BaseException) -> None:
        self.outcome = "failed"
        self.status.setText(f"k3: {e}")
        self._finish()
        self._estimate()

    def reject(self) -> None:
        if self.task is not None and not self.task.done:
            self.cancel()
            return
        super().reject()
