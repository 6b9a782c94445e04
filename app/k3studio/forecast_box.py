"""The Memory tab's forecast column: what the plan on the sliders will cost on this machine
(k3engine.forecast), recomputed with every slider move, each figure with its assumptions.

The machine's figures come from the forecast's cache; when this machine has none yet, the
"Measure this machine" button runs the short device test and kernel calibration on a task
thread (a few seconds) and caches them, as `k3 forecast` does on its first run.
"""
from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QFrame, QGroupBox, QHBoxLayout, QLabel, QPushButton,
                               QScrollArea, QVBoxLayout)

from k3engine import forecast as F
from k3engine.memory import human, human_seconds, trace_window

from .tasks import Task

PROMPT_LEN = 64          # the forecast column speaks of a typical chat turn
GEN = 32
# Below this the forecast's terms (disk reads, matrix work) are smaller than what it does
# not model (the interpreter, thread hand-offs: a few ms a token, the demo's measured
# decode): its figure would be "0.00 s/token", true of nothing.
TOO_SMALL_S = 0.05


def model_shape(model_dir: str, figures, streamed: bool) -> F.ModelShape | None:
    """The forecast's model from the Setup inspection's figures and the config (read
    only: nothing is indexed again); None when the config cannot be read."""
    from k3engine.config import ConfigError
    from k3engine.session import read_config
    try:
        cfg, _ = read_config(model_dir, None)
    except (ConfigError, OSError):
        return None
    return F.shape_from(cfg, figures, streamed, "the Setup tab's inspection")


class ForecastBox(QGroupBox):
    machineMeasured = Signal(object)         # MachineFigures

    def __init__(self, parent=None):
        super().__init__("Forecast on this machine", parent)
        self.shape: F.ModelShape | None = None
        self.machine: F.MachineFigures | None = None
        self.hits: F.HitModel | None = None
        self.forecast: F.Forecast | None = None
        self.device: str | None = None
        self.baseline_bytes: int | None = None
        self._task: Task | None = None
        lay = QVBoxLayout(self)
        self.figures = QLabel("Pick a model in Setup to see the forecast.")
        self.figures.setWordWrap(True)
        self.figures.setTextInteractionFlags(Qt.TextSelectableByMouse)
        lay.addWidget(self.figures)
        self.assumptions = QLabel()
        self.assumptions.setObjectName("hint")
        self.assumptions.setWordWrap(True)
        self.assumptions.setTextInteractionFlags(Qt.TextSelectableByMouse)
        # the list is long (each figure says what it came from): it scrolls, never clips
        self.assumptions_view = QScrollArea()
        self.assumptions_view.setWidget(self.assumptions)
        self.assumptions_view.setWidgetResizable(True)
        self.assumptions_view.setFrameShape(QFrame.NoFrame)
        lay.addWidget(self.assumptions_view, 1)
        row = QHBoxLayout()
        self.measure = QPushButton("Measure this machine")
        self.measure.setToolTip("A short read test on the model's disk and a calibration of "
                                "the engine's matvec kernels (a few seconds; cached)")
        self.measure.clicked.connect(self.measure_machine)
        row.addStretch(1)
        row.addWidget(self.measure)
        lay.addLayout(row)

    def set_inputs(self, shape: F.ModelShape | None, device: str | None,
                   hits: F.HitModel | None = None) -> None:
        self.shape, self.device, self.hits = shape, device, hits
        if self.machine is None and device:
            self.machine = F.cached_machine_figures(device)

    def set_machine(self, machine: F.MachineFigures | None) -> None:
        self.machine = machine

    def measure_machine(self) -> None:
        if not self.device or (self._task is not None and not self._task.done):
            return
        self.measure.setEnabled(False)
        self.figures.setText("Measuring this machine (device read test, kernel calibration)…")
        t = self._task = Task(lambda progress, cancelled: F.machine_figures(self.device,
                                                                            refresh=True))
        t.returned.connect(self._measured)
        t.errored.connect(lambda e: self.figures.setText(f"Could not measure: {e}"))
        t.finished.connect(lambda: self.measure.setEnabled(True))
        t.start()

    def _measured(self, m) -> None:
        self.machine = m
        self.machineMeasured.emit(m)

    def update_for(self, plan, trunk_ring: int) -> F.Forecast | None:
        """Forecast the plan on the sliders (None without a model or machine figures)."""
        self.forecast = None
        if plan is None or self.shape is None:
            self.figures.setText("Pick a model in Setup to see the forecast.")
            self.assumptions.setText("")
            return None
        if self.machine is None:
            self.figures.setText("This machine has not been measured yet: press Measure.")
            self.assumptions.setText("")
            return None
        fc = self.forecast = F.forecast(
            self.shape, self.machine, trunk_gb=plan.trunk_gb, cache_gb=plan.cache_gb,
            trunk_ring=trunk_ring, streamed=plan.streamed, ultra=plan.ultra,
            prompt_len=PROMPT_LEN, gen=GEN, hits=self.hits, baseline_bytes=self.baseline_bytes,
            trace_window=trace_window())      # the session trace the app's runs keep
        if fc.s_per_token < TOO_SMALL_S:
            self.figures.setText(
                f"<b>This model is too small to forecast meaningfully.</b> The forecast adds "
                f"up disk reads and matrix work, here {human_seconds(fc.s_per_token)} a "
                f"token: less than the engine's fixed cost per token, which it does not "
                f"model. The stats under each reply give the measured speed.")
        else:
            self.figures.setText(
                f"<b>{human_seconds(fc.s_per_token)}/token</b> decoding · first token "
                f"<b>{human_seconds(fc.ttft_s)}</b> for a {PROMPT_LEN}-token prompt<br>"
                f"reads {human(fc.bytes_read_per_token)} per token (trunk "
                f"{human(fc.trunk_bytes_per_token)} + experts "
                f"{human(fc.expert_bytes_per_token)} at {100 * fc.hit_rate:.1f}% hit) · "
                f"peak RSS ≈ {human(fc.peak_rss_bytes)}")
        self.assumptions.setText("Computed from: " + "; ".join(fc.assumptions))
        self.figures.setToolTip("\n".join(fc.assumptions))
        return fc
