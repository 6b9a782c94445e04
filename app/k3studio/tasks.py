"""One-off background jobs (make the demo model, pack a trunk, validate directories),
modelled on superqt's `thread_worker`: a job runs on its own QThread and reports through
started / progress / returned / errored / aborted / finished signals; `abort()` asks it to
stop at its next check.

The job function receives two keyword arguments it may use: `progress(value)`, throttled
here so a fast producer never floods the GUI's event queue (the last value always gets
through), and `cancelled()`, which returns True once abort() was called.

Connect to the signals before `start()`: a signal emitted before its connection exists
is lost.
"""
from __future__ import annotations

import threading
import time
import traceback
from typing import Any, Callable

from PySide6.QtCore import QObject, Qt, QThread, Signal, Slot

PROGRESS_INTERVAL = 0.05      # seconds between progress signals


class Aborted(Exception):
    """Raise from a job to end it as aborted rather than failed."""


class _Runner(QObject):
    """The part that lives on the task thread; its signals are relayed by Task, which
    lives on the GUI thread, so a receiver connected to Task -- even a lambda, which has no
    thread of its own -- always runs on the GUI thread."""

    started = Signal()
    progress = Signal(object)
    returned = Signal(object)
    errored = Signal(object)
    aborted = Signal()
    finished = Signal()

    def __init__(self, task: "Task"):
        super().__init__()
        self.task = task
        self._last = 0.0
        self._pending: object = None

    def _progress(self, value) -> None:
        now = time.monotonic()
        if now - self._last >= PROGRESS_INTERVAL:
            self._last = now
            self._pending = None
            self.progress.emit(value)
        else:
            self._pending = value

    @Slot()
    def run(self) -> None:
        t = self.task
        self.started.emit()
        try:
            result = t._fn(*t._args, progress=self._progress, cancelled=t._abort.is_set,
                           **t._kwargs)
        except BaseException as e:  # noqa: BLE001 - every failure is reported, none lost
            if self._pending is not None:
                self.progress.emit(self._pending)
            if t._is_abort(e):
                self.aborted.emit()
            else:
                traceback.print_exception(e)
                self.errored.emit(e)
        else:
            if self._pending is not None:
                self.progress.emit(self._pending)
            self.returned.emit(result)
        finally:
            self.finished.emit()


class Task(QObject):
    started = Signal()
    progress = Signal(object)
    returned = Signal(object)
    errored = Signal(object)          # the exception (its traceback printed to stderr)
    aborted = Signal()
    finished = Signal()

    _live: set["Task"] = set()        # keep Python wrappers alive until the thread ends

    def __init__(self, fn: Callable[..., Any], *args, is_abort: Callable[[BaseException], bool]
                 | None = None, **kwargs):
        super().__init__()
        self._fn, self._args, self._kwargs = fn, args, kwargs
        self._abort = threading.Event()
        self._is_abort = is_abort or (lambda e: isinstance(e, Aborted))
        self._thread: QThread | None = None
        self._runner: _Runner | None = None
        self.done = False

    # -- control (GUI thread) -------------------------------------------------------
    def start(self) -> "Task":
        th = QThread()
        th.setObjectName(f"k3studio-task-{getattr(self._fn, '__name__', 'job')}")
        r = _Runner(self)
        r.moveToThread(th)
        th.started.connect(r.run)
        r.started.connect(self._on_started)
        r.progress.connect(self._on_progress)
        r.returned.connect(self._on_returned)
        r.errored.connect(self._on_errored)
        r.aborted.connect(self._on_aborted)
        r.finished.connect(self._on_finished)
        # quit from the task thread itself (QThread.quit is thread-safe); the GUI-side
        # cleanup waits for the thread's own `finished`
        r.finished.connect(th.quit, Qt.DirectConnection)
        th.finished.connect(self._cleanup)
        self._thread, self._runner = th, r
        Task._live.add(self)
        th.start()
        return self

    def abort(self) -> None:
        self._abort.set()

    @property
    def abort_requested(self) -> bool:
        return self._abort.is_set()

    def wait(self, ms: int = 30000) -> bool:
        return self._thread.wait(ms) if self._thread is not None else True

    # -- relays (GUI thread) --------------------------------------------------------
    @Slot()
    def _on_started(self) -> None:
        self.started.emit()

    @Slot(object)
    def _on_progress(self, v) -> None:
        self.progress.emit(v)

    @Slot(object)
    def _on_returned(self, v) -> None:
        self.returned.emit(v)

    @Slot(object)
    def _on_errored(self, e) -> None:
        self.errored.emit(e)

    @Slot()
    def _on_aborted(self) -> None:
        self.aborted.emit()

    @Slot()
    def _on_finished(self) -> None:
        self.done = True
        self.finished.emit()

    @Slot()
    def _cleanup(self) -> None:
        if self._runner is not None:
            self._runner.deleteLater()
        if self._thread is not None:
            self._thread.deleteLater()
        Task._live.discard(self)
