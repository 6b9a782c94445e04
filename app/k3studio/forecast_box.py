"""The Memory tab's forecast column: what the plan on the sliders will cost on this machine
(k3engine.forecast), recomputed with every slider move, each figure with its assumptions.

The machine's figures come from the forecast's cache; when this machine has none yet, the
"Measure this machine" button runs the device test and kernel calibration and caches them,
as `k3 forecast` does on its first run.  It runs in a child process: its phases show as
they start, Cancel ends it, and the gigabytes the calibration streams through go back to
the system when it exits (in the app's own process they stayed in its RSS).
"""
from __future__ import annotations

import os
import sys
import time

from PySide6.QtCore import QProcess, QProcessEnvironment, Qt, QTimer, Signal
from PySide6.QtWidgets import (QFrame, QGroupBox, QHBoxLayout, QLabel, QProgressBar,
                               QPushButton, QScrollArea, QVBoxLayout)

from k3engine import forecast as F
from k3engine.memory import human, human_seconds, trace_window


PROMPT_LEN = 64          # the forecast column speaks of a typical chat turn
GEN = 32
# Below this the forecast's terms (disk reads, matrix work) are smaller than what it does
# not model (the interpreter, thread hand-offs: a few ms a token, the demo's measured
# decode): its figure would be "0.00 s/token", true of nothing.
TOO_SMALL_S = 0.05
# the child: measure, print each phase as it starts, write the forecast's cache (which the
# app then reads); SIGTERM unwinds through the read test's cleanup (its scratch file)
MEASURE = """
import signal, sys
signal.signal(signal.SIGTERM, lambda *_a: sys.exit(3))
from k3engine import forecast as F
F.machine_figures(sys.argv[1], refresh=True, progress=lambda what: print(what, flush=True))
"""


def model_shape(model_dir: str, figures, streamed: bool) -> F.ModelShape | None:
    """The forecast's model from the Setup inspection's figures and the config (read
    only: nothing is indexed again); None when the config cannot be read."""
    from k3engine.config import ConfigError
    from k3engine.loading import read_config
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
        self.proc: QProcess | None = None
        self.phase = ""
        self._t0 = 0.0
        self._cancelled = False
        self._tick = QTimer(self)
        self._tick.setInterval(500)
        self._tick.timeout.connect(self._show_progress)
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
        self.bar = QProgressBar()
        self.bar.setRange(0, 0)                  # busy: the phases' lengths vary by machine
        self.bar.setMaximumHeight(8)
        self.bar.setTextVisible(False)
        self.bar.setVisible(False)
        lay.addWidget(self.bar)
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

    @property
    def measuring(self) -> bool:
        return self.proc is not None

    def measure_machine(self) -> None:
        """The button: start measuring, or cancel the measurement under way."""
        if self.proc is not None:
            self.cancel_measure()
            return
        if not self.device:
            return
        p = self.proc = QProcess(self)
        env = QProcessEnvironment.systemEnvironment()
        # the child imports the engine from wherever this process found it
        env.insert("PYTHONPATH", os.pathsep.join(x for x in sys.path if x))
        p.setProcessEnvironment(env)
        p.setProcessChannelMode(QProcess.SeparateChannels)
        p.readyReadStandardOutput.connect(self._read_phase)
        p.finished.connect(self._measure_ended)
        p.errorOccurred.connect(self._measure_error)
        self.phase, self._t0, self._cancelled = "starting", time.monotonic(), False
        self.measure.setText("Cancel")
        self.bar.setVisible(True)
        self._tick.start()
        self._show_progress()
        p.start(sys.executable, ["-c", MEASURE, self.device])

    def cancel_measure(self) -> None:
        if self.proc is None:
            return
        self._cancelled = True
        self.proc.terminate()
        if not self.proc.waitForFinished(5000):
            self.proc.kill()
            self.proc.waitForFinished(5000)

    def _read_phase(self) -> None:
        out = bytes(self.proc.readAllStandardOutput()).decode(errors="replace")
        lines = [x.strip() for x in out.splitlines() if x.strip()]
        if lines:
            self.phase = lines[-1]
            self._show_progress()

    def _show_progress(self) -> None:
        from k3engine.memory import human_seconds
        self.figures.setText(f"Measuring this machine: {self.phase}… "
                             f"({human_seconds(time.monotonic() - self._t0)} so far; Cancel "
                             f"stops it)")

    def _measure_error(self, err) -> None:
        if err == QProcess.FailedToStart:
            self._measure_ended(-1, QProcess.CrashExit)

    def _measure_ended(self, code: int, _status) -> None:
        p, self.proc = self.proc, None
        if p is None:
            return
        self._tick.stop()
        self.bar.setVisible(False)
        self.measure.setText("Measure this machine")
        err = bytes(p.readAllStandardError()).decode(errors="replace").strip()
        p.deleteLater()
        m = F.cached_machine_figures(self.device) if code == 0 else None
        if m is not None:
            self._measured(m)
        elif self._cancelled:
            self.figures.setText("Measurement cancelled: nothing was kept.")
        else:
            last = err.splitlines()[-1] if err else f"exit code {code}"
            self.figures.setText(f"Could not measure: {last}")

    def _measured(self, m) -> None:
        self.machine = m
        self.machineMeasured.emit(m)

    def update_for(self, plan, trunk_ring: int, lookahead: bool = False) -> F.Forecast | None:
        """Forecast the plan on the sliders (None without a model or machine figures), with
        lookahead reads at an assumed recall when they are on, and block drafting at the
        published drafters' acceptances."""
        self.forecast = None
        if self.proc is not None:
            return None                  # the measurement's progress stays on show
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
            trace_window=trace_window(),      # the session trace the app's runs keep
            lookahead_recall=F.ASSUMED_RECALL if lookahead else None,
            accept=F.PUBLISHED_ACCEPTANCE[0])
        small = fc.s_per_token < TOO_SMALL_S
        # its list of assumptions would only explain a figure not shown: the room goes to
        # the sentence
        self.assumptions_view.setVisible(not small)
        if small:
            self.figures.setText(
                f"<b>This model is too small to forecast meaningfully:</b> its disk reads "
                f"and matrix work come to {human_seconds(fc.s_per_token)} a token, less than "
                f"the engine's own cost per token, which the forecast does not model. Each "
                f"reply's stats give the measured speed.")
        else:
            self.figures.setText(
                f"<b>{human_seconds(fc.s_per_token)}/token</b> decoding · first token "
                f"<b>{human_seconds(fc.ttft_s)}</b> for a {PROMPT_LEN}-token prompt<br>"
                f"reads {human(fc.bytes_read_per_token)} per token (trunk "
                f"{human(fc.trunk_bytes_per_token)} + experts "
                f"{human(fc.expert_bytes_per_token)} at {100 * fc.hit_rate:.1f}% hit) · "
                f"peak RSS ≈ {human(fc.peak_rss_bytes)}<br>" + extras_text(fc))
        self.assumptions.setText("Computed from: " + "; ".join(fc.assumptions))
        self.figures.setToolTip("\n".join(fc.assumptions))
        return fc


def extras_text(fc: F.Forecast) -> str:
    """The forecast's lookahead and block-drafting lines (one source for the Memory tab and
    What-if): what they would change, labelled as a forecast."""
    parts = []
    la, bd = fc.lookahead, fc.block
    if la:
        parts.append(f"with lookahead reads (a guess naming {100 * la['recall']:.0f}% of a "
                     f"layer's experts, assumed): {human_seconds(la['s_per_token'])}/token, "
                     f"{human(la['wasted_bytes_per_token'])} a token read for nothing")
    if bd:
        rates = " / ".join(f"{human_seconds(bd['pass_s'] / (a + 1))}"
                           for a in F.PUBLISHED_ACCEPTANCE)
        parts.append(f"with a block drafter ({bd['block']}-position passes) accepting "
                     f"{' / '.join(f'{a:g}' for a in F.PUBLISHED_ACCEPTANCE)} drafts a pass: "
                     f"{rates}/token")
    return ("<i>forecast:</i> " + " · ".join(parts)) if parts else ""
