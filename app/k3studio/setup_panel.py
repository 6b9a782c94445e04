"""Setup panel: choose the checkpoint, its packed trunk and the tokenizer, validated live
through the engine's own readers; make the demo model on a first start; pack a trunk; and a
doctor view of this machine (SYSTEM §10.1)."""
from __future__ import annotations

import os

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (QFileDialog, QFormLayout, QFrame, QGridLayout, QGroupBox,
                               QHBoxLayout, QLabel, QLineEdit, QProgressBar, QPushButton,
                               QVBoxLayout, QWidget)

from k3engine.memory import human

from . import checks, demo
from .fixes import check_text
from .tasks import Task

DEBOUNCE_MS = 250
ICON = {checks.OK: "✔", checks.WARN: "⚠", checks.ERROR: "✖", checks.EMPTY: "•"}


class PathRow(QWidget):
    """A directory field with Browse and the live check's verdict under it."""

    edited = Signal()

    def __init__(self, placeholder: str, tip: str, parent=None):
        super().__init__(parent)
        self.edit = QLineEdit()
        self.edit.setPlaceholderText(placeholder)
        self.edit.setToolTip(tip)
        self.edit.setClearButtonEnabled(True)
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        self.check = QLabel()
        self.check.setWordWrap(True)
        self.check.setTextInteractionFlags(Qt.TextSelectableByMouse)
        top = QHBoxLayout()
        top.addWidget(self.edit, 1)
        top.addWidget(browse)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(2)
        lay.addLayout(top)
        lay.addWidget(self.check)
        self.edit.textChanged.connect(self.edited)

    def _browse(self) -> None:
        d = QFileDialog.getExistingDirectory(self, "Choose a directory",
                                             self.edit.text() or os.path.expanduser("~"))
        if d:
            self.edit.setText(d)

    def text(self) -> str:
        return self.edit.text().strip()

    def set_text(self, t: str) -> None:
        self.edit.setText(t)

    def show_check(self, c: checks.Check | None) -> None:
        if c is None:
            self.check.setText("checking…")
            self.check.setObjectName("check_empty")
        else:
            text = check_text(c.message) if c.level == checks.ERROR else c.message
            self.check.setText(f"{ICON[c.level]} {text}" if c.message else "")
            self.check.setObjectName(f"check_{c.level}")
        self.check.style().unpolish(self.check)
        self.check.style().polish(self.check)


class SetupPanel(QWidget):
    changed = Signal()                 # a directory changed (the window persists it)
    inspected = Signal(object)         # checks.Inspection
    loadRequested = Signal()
    unloadRequested = Signal()
    demoReady = Signal(str, str)       # model_dir, trunk_dir
    resumeDownload = Signal(object, str)   # download.DownloadState, its directory

    def __init__(self, data_dir: str, parent=None):
        super().__init__(parent)
        self.data_dir = data_dir
        self.inspection: checks.Inspection | None = None
        self._gen = 0
        self._task: Task | None = None
        self.demo_task: Task | None = None
        self.verify_task: Task | None = None
        self.pack_dialog = None
        self.model_loaded = False
        self.busy = False

        # -- first start: the demo offer ---------------------------------------------
        self.demo_box = QFrame()
        self.demo_box.setObjectName("bubble_system")
        dlay = QHBoxLayout(self.demo_box)
        self.demo_text = QLabel(
            "<b>No model yet?</b> Set up the built-in demo model: a 7 MB checkpoint in the "
            "released layout, <b>a tiny model trained on a small corpus, not Kimi K3</b> "
            "(it answers greetings, sums, days and questions about K3 Studio), plus its "
            "packed trunk. It shows every part of the machinery in seconds.")
        self.demo_text.setWordWrap(True)
        self.demo_btn = QPushButton("Create the demo model")
        self.demo_btn.setObjectName("primary")
        self.demo_btn.clicked.connect(self.create_demo)
        self.demo_bar = QProgressBar()
        self.demo_bar.setRange(0, 1000)
        self.demo_bar.setVisible(False)
        dcol = QVBoxLayout()
        dcol.addWidget(self.demo_text)
        dcol.addWidget(self.demo_bar)
        dlay.addLayout(dcol, 1)
        dlay.addWidget(self.demo_btn)

        # -- the three directories -----------------------------------------------------
        box = QGroupBox("Model")
        form = QFormLayout(box)
        self.model = PathRow("checkpoint directory: config.json + *.safetensors",
                             "The released checkpoint (or one made by k3 make-checkpoint).")
        self.trunk = PathRow("optional: packed trunk directory (trunk.json + trunk.bin)",
                             "Made by Pack trunk (k3 pack-trunk). Without it the trunk is held "
                             "in RAM; with it the trunk streams within the trunk budget.")
        self.tok = PathRow("optional: tokenizer directory (default: the checkpoint directory)",
                           "tiktoken.model + tokenizer_config.json; the released checkpoint "
                           "ships them beside the shards.")
        form.addRow("Checkpoint", self.model)
        form.addRow("Packed trunk", self.trunk)
        form.addRow("Tokenizer", self.tok)
        self.demo_badge = QLabel(demo.DEMO_LABEL)
        self.demo_badge.setObjectName("demo_badge")
        self.demo_badge.setVisible(False)
        form.addRow(self.demo_badge)
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        self.summary.setObjectName("hint")
        form.addRow(self.summary)

        buttons = QHBoxLayout()
        self.resume_btn = QPushButton("Resume download")
        self.resume_btn.setObjectName("primary")
        self.resume_btn.setToolTip("Continue this folder's unfinished download in the Download "
                                   "tab, from the bytes already fetched (k3 download).")
        self.resume_btn.clicked.connect(self._resume_download)
        self.resume_btn.setVisible(False)
        buttons.addWidget(self.resume_btn)
        self.pack_btn = QPushButton("Pack trunk…")
        self.pack_btn.setToolTip("Write a packed trunk for this checkpoint so it can stream "
                                 "within a memory budget (k3 pack-trunk).")
        self.pack_btn.clicked.connect(self.open_pack_dialog)
        self.load_btn = QPushButton("Load model")
        self.load_btn.setObjectName("primary")
        self.load_btn.setToolTip("Plan, check and load with the memory settings; then chat.")
        self.load_btn.clicked.connect(self.loadRequested)
        self.unload_btn = QPushButton("Unload")
        self.unload_btn.clicked.connect(self.unloadRequested)
        self.verify_btn = QPushButton("Verify files")
        self.verify_btn.setToolTip("Read every shard (and the packed trunk) and check it "
                                   "against its recorded SHA-256, as k3 doctor --verify does; "
                                   "a damaged file is named.")
        self.verify_btn.clicked.connect(self.verify_files)
        buttons.addWidget(self.pack_btn)
        buttons.addWidget(self.verify_btn)
        buttons.addStretch(1)
        buttons.addWidget(self.unload_btn)
        buttons.addWidget(self.load_btn)
        form.addRow(buttons)
        self.load_state = QLabel("No model loaded.")
        self.load_state.setWordWrap(True)
        form.addRow(self.load_state)
        self.verify_state = QLabel()
        self.verify_state.setWordWrap(True)
        self.verify_state.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.verify_state.setVisible(False)
        form.addRow(self.verify_state)

        # -- doctor --------------------------------------------------------------------
        doctor = QGroupBox("Doctor: this machine")
        self.doctor = QLabel()
        self.doctor.setWordWrap(True)
        self.doctor.setTextFormat(Qt.RichText)
        self.doctor.setTextInteractionFlags(Qt.TextSelectableByMouse)
        refresh = QPushButton("Check again")
        refresh.clicked.connect(self.refresh_doctor)
        dl = QVBoxLayout(doctor)
        dl.addWidget(self.doctor)
        dl.addStretch(1)
        dl.addWidget(refresh, 0, Qt.AlignRight)

        grid = QGridLayout(self)
        grid.addWidget(self.demo_box, 0, 0, 1, 2)
        grid.addWidget(box, 1, 0)
        grid.addWidget(doctor, 1, 1)
        grid.setColumnStretch(0, 3)
        grid.setColumnStretch(1, 2)
        grid.setRowStretch(2, 1)

        self._debounce = QTimer(self)
        self._debounce.setSingleShot(True)
        self._debounce.setInterval(DEBOUNCE_MS)
        self._debounce.timeout.connect(self.inspect_now)
        for row in (self.model, self.trunk, self.tok):
            row.edited.connect(self._edited)
        self.refresh_doctor()
        self._update_buttons()

    # -- state in and out -----------------------------------------------------------
    def load_from(self, s) -> None:
        for row, v in ((self.model, s.model_dir), (self.trunk, s.trunk_dir),
                       (self.tok, s.tok_dir)):
            row.edit.blockSignals(True)
            row.set_text(v)
            row.edit.blockSignals(False)
        self.inspect_now()

    def values(self) -> dict:
        return dict(model_dir=self.model.text(), trunk_dir=self.trunk.text(),
                    tok_dir=self.tok.text())

    def set_paths(self, model_dir: str, trunk_dir: str = "", tok_dir: str = "") -> None:
        for row, v in ((self.model, model_dir), (self.trunk, trunk_dir), (self.tok, tok_dir)):
            row.edit.blockSignals(True)
            row.set_text(v)
            row.edit.blockSignals(False)
        self.changed.emit()
        self.inspect_now()

    # -- live validation ------------------------------------------------------------
    def _edited(self) -> None:
        self.changed.emit()
        self._debounce.start()

    def inspect_now(self) -> None:
        """Validate on a background task; a newer edit makes older results stale."""
        self._debounce.stop()
        self._gen += 1
        gen = self._gen
        for row in (self.model, self.trunk, self.tok):
            row.show_check(None)
        v = self.values()

        def job(progress, cancelled):
            return checks.inspect(v["model_dir"], v["trunk_dir"], v["tok_dir"])
        t = Task(job)
        t.gen = gen
        # bound methods, not lambdas: Qt drops the connection if this panel is deleted
        # while a check is still running
        t.returned.connect(self._inspection_returned)
        t.errored.connect(self._inspection_failed)
        self._task = t
        t.start()

    def _inspection_returned(self, insp: checks.Inspection) -> None:
        self._inspected(getattr(self.sender(), "gen", -1), insp)

    def _inspection_failed(self, e: BaseException) -> None:
        self._inspected(getattr(self.sender(), "gen", -1), checks.Inspection(
            checks.Check(checks.ERROR, f"{type(e).__name__}: {e}"),
            checks.Check(checks.EMPTY, ""), checks.Check(checks.EMPTY, "")))

    def _inspected(self, gen: int, insp: checks.Inspection) -> None:
        if gen != self._gen:
            return                       # a newer edit is being checked
        self.inspection = insp
        self.model.show_check(insp.model)
        self.trunk.show_check(insp.trunk)
        self.tok.show_check(insp.tok)
        self.summary.setText(insp.summary)
        is_demo = demo.is_demo(self.model.text())
        self.demo_badge.setVisible(is_demo)
        self._show_demo_offer()
        self._update_buttons()
        self.refresh_doctor()
        self.inspected.emit(insp)

    @property
    def validating(self) -> bool:
        return self._task is not None and not self._task.done

    # -- buttons --------------------------------------------------------------------
    def set_engine_state(self, loaded: bool, busy: bool, text: str | None = None) -> None:
        self.model_loaded, self.busy = loaded, busy
        if text is not None:
            self.load_state.setText(text)
        self._show_demo_offer()
        self._update_buttons()

    def _show_demo_offer(self) -> None:
        """"No model yet?" is for someone without one: a folder that is no model and
        nothing loaded (not while a model, the demo say, is loaded and another folder is
        being typed), never for a download under way."""
        insp = self.inspection
        self.demo_box.setVisible(self.demo_task is not None or (
            not self.model_loaded and insp is not None and not insp.model.ok
            and insp.download is None))

    def _update_buttons(self) -> None:
        insp = self.inspection
        runnable = insp is not None and insp.runnable
        self.resume_btn.setVisible(insp is not None and insp.download is not None)
        self.load_btn.setEnabled(runnable and not self.busy)
        self.load_btn.setText("Reload model" if self.model_loaded else "Load model")
        self.unload_btn.setEnabled(self.model_loaded and not self.busy)
        self.pack_btn.setEnabled(insp is not None and insp.model.ok)
        # a damaged shard may fail the check: verify whatever folder is chosen
        self.verify_btn.setEnabled(bool(self.model.text()) and self.verify_task is None)

    # -- verify -------------------------------------------------------------------
    def verify_files(self) -> None:
        """Every byte of the shards (and of the packed trunk, when chosen) against its
        recorded digest, on a background task; the result names what is damaged."""
        from k3engine.integrity import verify_shards, verify_trunk
        v = self.values()
        if self.verify_task is not None or not v["model_dir"]:
            return

        def job(progress, cancelled):
            problems, what = verify_shards(v["model_dir"], progress)
            if v["trunk_dir"]:
                problems += verify_trunk(v["trunk_dir"], progress)
                what += " and the packed trunk's layers"
            return problems, what
        self.verify_state.setVisible(True)
        self.verify_state.setText("Verifying: reading every byte…")
        t = Task(job)
        t.progress.connect(self._verify_progress)
        t.returned.connect(self._verified)
        t.errored.connect(self._verify_failed)
        self.verify_task = t
        self._update_buttons()
        t.start()

    def _verify_progress(self, line) -> None:
        self.verify_state.setText(f"Verifying: {str(line).strip()}")

    def _verified(self, result) -> None:
        problems, what = result
        if problems:
            self.verify_state.setText(f"{ICON[checks.ERROR]} {len(problems)} problem(s): "
                                      + "; ".join(problems))
        elif "not verified" in what:
            self.verify_state.setText(f"{ICON[checks.WARN]} {what}")
        else:
            self.verify_state.setText(f"{ICON[checks.OK]} every file matches: {what}")
        self._verify_ended()

    def _verify_failed(self, e: BaseException) -> None:
        self.verify_state.setText(f"{ICON[checks.ERROR]} could not verify: {e}")
        self._verify_ended()

    def _verify_ended(self) -> None:
        self.verify_task = None
        self._update_buttons()

    def _resume_download(self) -> None:
        insp = self.inspection
        if insp is not None and insp.download is not None:
            self.resumeDownload.emit(insp.download, self.model.text())

    # -- demo -----------------------------------------------------------------------
    def create_demo(self) -> None:
        if self.demo_task is not None:
            return
        self.demo_btn.setEnabled(False)
        self.demo_bar.setVisible(True)
        self.demo_bar.setValue(0)
        self.demo_text.setText(f"Creating the demo model in {self.data_dir} …")
        from k3engine.trunk import PackCancelled

        from .tasks import Aborted

        def job(progress, cancelled):
            return demo.make_demo(self.data_dir, progress=progress, cancelled=cancelled)
        t = Task(job, is_abort=lambda e: isinstance(e, (Aborted, PackCancelled)))
        t.progress.connect(self._demo_progress)
        t.returned.connect(self._demo_done)
        t.errored.connect(self._demo_failed)
        t.aborted.connect(self._demo_aborted)
        self.demo_task = t
        t.start()

    def _demo_progress(self, value) -> None:
        phase, done, total = value
        frac = done / total if total else 0
        # the checkpoint is ~70% of the work, the trunk copy the rest
        self.demo_bar.setValue(int(1000 * (0.7 * frac if phase == "model" else 0.7 + 0.3 * frac)))
        what = "writing the checkpoint" if phase == "model" else "packing its trunk"
        self.demo_text.setText(f"Creating the demo model: {what}, {human(done)} of {human(total)}")

    def _demo_done(self, paths) -> None:
        model, trunk = paths
        self.demo_task = None
        self.demo_bar.setValue(1000)
        self.demo_text.setText(f"Demo model ready in {model} (a tiny trained model, not Kimi K3).")
        self.demo_btn.setEnabled(True)
        self.set_paths(model, trunk, "")
        self.demoReady.emit(model, trunk)

    def _demo_aborted(self) -> None:
        self._demo_failed("cancelled")

    def _demo_failed(self, e) -> None:
        self.demo_task = None
        self.demo_btn.setEnabled(True)
        self.demo_bar.setVisible(False)
        self.demo_text.setText(f"Could not create the demo model: {e}")

    # -- pack -----------------------------------------------------------------------
    def open_pack_dialog(self):
        from .pack_dialog import PackDialog
        insp = self.inspection
        if insp is None or not insp.model.ok:
            return None
        dlg = PackDialog(self.model.text(), insp.trunk_bytes, insp.n_layers, self)
        dlg.packed.connect(self._packed)
        self.pack_dialog = dlg
        dlg.open()
        return dlg

    def _packed(self, trunk_dir: str) -> None:
        self.set_paths(self.model.text(), trunk_dir, self.tok.text())

    # -- doctor ---------------------------------------------------------------------
    def refresh_doctor(self) -> None:
        from k3engine.memory import available_memory
        from k3engine.threads import default_threads, physical_cores
        _, probe = available_memory()
        name, why = checks.recommend_preset(probe.bytes if probe.known else 0)
        # how the figure was found ("host binds", a cgroup limit) is the engine's vocabulary:
        # in the tooltip, the figure in the text
        lines = [f"<b>Available memory:</b> {human(probe.bytes)}" if probe.known else
                 f"<b>Available memory:</b> {probe.how}"]
        self.doctor.setToolTip(f"Available memory: {probe.how}")
        if probe.total:
            lines.append(f"<b>Total memory:</b> {human(probe.total)}")
        lines.append(f"<b>CPU:</b> {os.cpu_count()} logical, {physical_cores()} physical "
                     f"cores; engine default {default_threads()} threads")
        lines.append(f"<b>Full Kimi K3:</b> {why}")
        insp = self.inspection
        if insp is not None and insp.figures is not None:
            from k3engine.memory import plan
            p = plan(insp.figures, preset="auto", streamed=insp.trunk.level == checks.OK,
                     incremental=True, positions=257, available_bytes=probe,
                     total_memory=probe.total or 0)
            if p.admitted:
                # what the plan holds, not auto's budgets (GBs a 3 MB trunk cannot fill)
                lines.append(f"<b>This model:</b> fits; <i>auto</i> plans {human(p.total_bytes)}"
                             f" (trunk {human(p.trunk_bytes)} / expert cache "
                             f"{human(p.expert_cache_bytes)}).")
            else:
                lines.append(f"<b>This model:</b> auto refuses: {p.refusals[0].message}")
            if insp.trunk.level != checks.OK:
                lines.append("Next step: <b>Pack trunk…</b> so the trunk streams within a "
                             "budget (both --trunk and --tok are needed for the real model).")
        try:
            import PySide6
            lines.append(f"<b>Toolkit:</b> PySide6 {PySide6.__version__}")
        except Exception:  # noqa: BLE001 - informational only
            pass
        self.doctor.setText("<br>".join(lines))
        self.recommended = name
