"""File → Save benchmark datapoint…: the shareable record of `k3 datapoint` / `k3 doctor
--datapoint` (machine, model, plan, measured s/token, time to first token, hit rate, peak
RSS, version; nothing personal), made from this session's last measured reply.

The app records what the engine already reported for the reply -- the load's plan event,
the per-step records (the step event's keys) and the turn's summary -- and hands them to
the engine's own datapoint code (`datapoint.turn_events` → `build` → `write`): the same
sections, the same Markdown, the same personal-data refusal, the same atomic write.  The
machine's figures are the forecast column's when it has them (else the forecast's cache,
measured once per machine), so saving never starts a second measurement needlessly.
"""
from __future__ import annotations

import os

from PySide6.QtCore import QObject, QStandardPaths, Signal
from PySide6.QtWidgets import (QDialog, QDialogButtonBox, QFileDialog, QLabel,
                               QPlainTextEdit, QTabWidget, QTextBrowser, QVBoxLayout)

from k3engine.tools import datapoint as D

from .tasks import Task


def make_record(turn: dict, device: str | None, figures, paths: list[str]) -> dict:
    """The record and its files (task thread): config, machine, the engine's build and
    write.  Raises OSError / ValueError (PersonalDataError included) with nothing written."""
    from k3engine.loading import read_config
    cfg, _ = read_config(turn["model_dir"], None)
    events = D.turn_events(turn["plan"], turn["steps"], turn["ids"], turn["prompt_ids"],
                           turn["reused"], turn["seconds"], turn["peak_rss_bytes"])
    rec = D.build(cfg, events, D.machine_section(device, turn["threads"], figures),
                  turn["threads"], D.SOURCE_APP)
    written = D.write(rec, turn["path"], paths)
    with open(written[1], encoding="utf-8") as f:
        md = f.read()
    with open(written[0], encoding="utf-8") as f:
        js = f.read()
    return {"record": rec, "paths": written, "markdown": md, "json": js}


class DatapointDialog(QDialog):
    """The saved record, whole: rendered Markdown and the JSON, with where it went."""

    def __init__(self, result: dict, parent=None):
        super().__init__(parent)
        self.setWindowTitle("Benchmark datapoint")
        self.resize(760, 560)
        where = QLabel("Saved " + " and ".join(result["paths"]) + ". Nothing in it names "
                       "you, this computer or a folder: it is safe to share.")
        where.setWordWrap(True)
        self.markdown = QTextBrowser()
        self.markdown.setMarkdown(result["markdown"])
        self.json = QPlainTextEdit(result["json"])
        self.json.setReadOnly(True)
        tabs = QTabWidget()
        tabs.addTab(self.markdown, "Markdown")
        tabs.addTab(self.json, "JSON")
        buttons = QDialogButtonBox(QDialogButtonBox.Close)
        buttons.rejected.connect(self.reject)
        lay = QVBoxLayout(self)
        lay.addWidget(where)
        lay.addWidget(tabs, 1)
        lay.addWidget(buttons)


class DatapointAction(QObject):
    """Keeps the session's last measured reply and saves its datapoint on request."""

    saved = Signal(dict)          # {"record", "paths", "markdown", "json"}
    failed = Signal(str)
    availableChanged = Signal(bool)

    def __init__(self, window):
        super().__init__(window)
        self.win = window
        self.plan_event: dict | None = None
        self.turn: dict | None = None          # the last measured reply, plain values
        self._steps: list[dict] = []
        self.dialog: DatapointDialog | None = None
        self.task: Task | None = None
        h = window.host
        h.planned.connect(self._planned)
        h.turnStarted.connect(self._started)
        h.records.connect(self._records)
        h.turnFinished.connect(self._finished)
        h.unloaded.connect(self._forget)

    # -- what the engine reported ------------------------------------------------------
    def _planned(self, ev: dict) -> None:
        self.plan_event = dict(ev)

    def _forget(self) -> None:
        self.turn = None
        self.availableChanged.emit(False)

    def _started(self, _info: dict) -> None:
        self._steps = []

    def _records(self, recs: list) -> None:
        self._steps.extend(recs)

    def _finished(self, info: dict) -> None:
        # A stopped-and-continued reply has no first token of its own (no prefill) and a
        # failed one no summary: neither is a datapoint; the previous reply stays.
        if info.get("failed") or not info.get("n") or info.get("continued") \
                or self.plan_event is None or len(self._steps) != info["n"]:
            return
        spec = self.win.loaded_spec or self.win.spec()
        loaded = self.win.host.loaded_info or {}
        self.turn = dict(plan=self.plan_event, steps=list(self._steps),
                         ids=list(info["ids"]), prompt_ids=info["prompt_ids"],
                         reused=info["reused"], seconds=info["seconds"],
                         peak_rss_bytes=info["peak_rss_bytes"], model_dir=spec.model_dir,
                         trunk_dir=spec.trunk_dir, tok_dir=spec.tok_dir,
                         threads=loaded.get("threads"))
        self.availableChanged.emit(True)

    # -- saving ------------------------------------------------------------------------
    def save_dialog(self) -> None:
        if self.turn is None:
            self.win.statusBar().showMessage("A datapoint records a measured reply: chat "
                                             "once with a loaded model, then save it.", 10000)
            return
        docs = QStandardPaths.writableLocation(QStandardPaths.DocumentsLocation) \
            or os.path.expanduser("~")
        path, _ = QFileDialog.getSaveFileName(
            self.win, "Save benchmark datapoint", os.path.join(docs, D.DEFAULT_PATH + ".json"),
            "Datapoint (*.json *.md);;All files (*)")
        if path:
            self.save(path)

    def save(self, path: str) -> Task | None:
        """Write PATH.json and PATH.md (PATH without its suffix) on a task thread."""
        if self.turn is None or (self.task is not None and not self.task.done):
            return None
        t, win = self.turn, self.win
        box = win.memory.forecast_box
        device = (t["trunk_dir"] or t["model_dir"]) or None
        # every folder of the session the record must not name (the user, home and host
        # names are added by check_impersonal itself)
        paths = [t["model_dir"], t["trunk_dir"], t["tok_dir"], win.data_dir,
                 win.library.path]
        task = self.task = Task(lambda progress, cancelled: make_record(
            dict(t, path=path), device, box.machine, [p for p in paths if p]))
        task.returned.connect(self._saved)
        task.errored.connect(self._failed)
        win.statusBar().showMessage("Saving the benchmark datapoint…", 5000)
        task.start()
        return task

    def _saved(self, result: dict) -> None:
        self.win.statusBar().showMessage("Saved " + " and ".join(result["paths"]), 10000)
        self.dialog = DatapointDialog(result, self.win)
        self.dialog.open()
        self.saved.emit(result)

    def _failed(self, e: BaseException) -> None:
        why = str(e) if isinstance(e, D.PersonalDataError) else \
            f"{getattr(e, 'strerror', None) or e}" + (f": {e.filename}"
                                                      if getattr(e, "filename", None) else "")
        msg = f"The datapoint was not saved: {why}"
        self.win.statusBar().showMessage(msg, 15000)
        self.failed.emit(msg)


def attach_datapoint(window) -> None:
    """The File menu's Save benchmark datapoint… action, enabled once a reply was
    measured."""
    window.datapoint = DatapointAction(window)
    act = window.actions_by_name["datapoint"]
    act.setEnabled(False)
    window.datapoint.availableChanged.connect(act.setEnabled)
