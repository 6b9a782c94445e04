"""Memory panel: preset, budgets, ring, expert replacement and threads, and the live plan
(SYSTEM §5).

`memory.plan` is pure arithmetic, so it is recomputed on every slider move: every term, the
available memory, whether the run would be admitted and, if not, the engine's own refusal
text.  After a run, the planned total is set against the measured peak RSS (the plan is a
forecast; the measurement is what counts).
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Callable

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFormLayout, QGridLayout, QGroupBox,
                               QHBoxLayout, QHeaderView, QLabel, QProgressBar, QPushButton,
                               QSlider, QSpinBox, QTableWidget, QTableWidgetItem, QVBoxLayout,
                               QWidget)

from k3engine.errors import EngineError
from k3engine.memory import AUTO, PRESETS, human

from .checks import EMPTY, ERROR, OK, Check
from .forecast_box import ForecastBox
from .runspec import CUSTOM, RunSpec, make_plan
from .setup_panel import PathRow

SLIDER_STEPS = 1000

# What each plan term is, in words a person can act on (tooltips).
TERM_HELP = {
    "trunk": "The trunk: every layer's attention, norms, router and shared experts. Streamed "
             "from the packed trunk, this is the trunk budget: layers pinned in RAM (largest "
             "first) plus a ring of slots the reader fills ahead of the compute. Every token "
             "re-reads what is not pinned, so a GB here removes the most I/O per token.",
    "tables": "Embedding and lm_head (plus the final norms), kept in RAM in the checkpoint's "
              "BF16. Fixed by the model: 2 x vocab x hidden x 2 bytes.",
    "cache": "The routed-expert cache: slots holding recently used experts so a repeat use "
             "is served from RAM. Capped at the whole expert pool. Below about 36 GB it "
             "buys little on the real model (the router spreads load evenly): fill the trunk "
             "first.",
    "state": "Recurrent state of the KDA layers (a matrix per head plus the short-conv "
             "history), for every bound layer. Fixed by the model.",
    "buffers": "Activations, the AttnRes block stack, per-layer scratch and one logits row, "
               "for every position of the run; and the session's expert trace the What-if "
               "tab replays (a window of the latest requests, 8 bytes each).",
    "kv": "The MLA key/value cache for incremental decode: grows with the context "
          "(positions = prompt + generation + 1). A memory fact, not an engine limit.",
    "baseline": "What this process already holds before the model: the Python interpreter, "
                "NumPy and Qt, measured when the app started (SYSTEM §5.8).",
    "drafter": "The block drafter (--draft-model): its weights, and its keys and values of "
               "every position of the conversation plus a proposal's scratch. It drafts "
               "several tokens the model verifies in one trunk pass; the tokens are the "
               "model's own.",
    "total": "The sum of the terms: what the run is planned to hold.",
    "available": "What this machine can hand out now: MemAvailable, or the tightest cgroup "
                 "headroom when that is smaller.",
    "limit": "A plan may use at most 95% of the available memory; above that the engine "
             "refuses to start (exit 1) rather than be killed half way.",
}


class BudgetSlider(QWidget):
    """A slider and a spin box showing the same GB value; the slider's range follows the
    model so the whole useful range is reachable with the mouse."""

    changed = Signal(float)

    def __init__(self, decimals: int = 3, parent=None):
        super().__init__(parent)
        self.slider = QSlider(Qt.Horizontal)
        self.slider.setRange(0, SLIDER_STEPS)
        self.spin = QDoubleSpinBox()
        self.spin.setDecimals(decimals)
        self.spin.setSuffix(" GB")
        self.spin.setRange(0.0, 100000.0)
        self.spin.setMinimumWidth(110)
        self.spin.setKeyboardTracking(False)
        lay = QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.slider, 1)
        lay.addWidget(self.spin)
        self._max = 1.0
        self._quiet = False
        self.slider.valueChanged.connect(self._from_slider)
        self.spin.valueChanged.connect(self._from_spin)

    def set_range_max(self, gb: float) -> None:
        self._max = max(gb, 1e-4)
        # enough decimals to show a step of a small model (the demo's trunk is 12 MB)
        self.spin.setDecimals(2 if self._max >= 20 else 3 if self._max >= 0.5 else 4)
        step = self._max / SLIDER_STEPS
        self.spin.setSingleStep(max(step, 10 ** -self.spin.decimals()))
        self._sync_slider(self.spin.value())

    @property
    def range_max(self) -> float:
        return self._max

    def value(self) -> float:
        return self.spin.value()

    def set_value(self, gb: float) -> None:
        """Programmatic change: no `changed` signal."""
        self._quiet = True
        try:
            self.spin.setValue(gb)
            self._sync_slider(gb)
        finally:
            self._quiet = False

    def _sync_slider(self, gb: float) -> None:
        self.slider.blockSignals(True)
        self.slider.setValue(int(round(min(gb, self._max) / self._max * SLIDER_STEPS)))
        self.slider.blockSignals(False)

    def _from_slider(self, v: int) -> None:
        gb = v / SLIDER_STEPS * self._max
        self.spin.blockSignals(True)
        self.spin.setValue(gb)
        self.spin.blockSignals(False)
        if not self._quiet:
            self.changed.emit(self.spin.value())

    def _from_spin(self, gb: float) -> None:
        self._sync_slider(gb)
        if not self._quiet:
            self.changed.emit(gb)


MEASURED_EMPTY = "After a run, the measured peak RSS appears here next to the plan."


class MemoryPanel(QWidget):
    """Edits the memory fields of the run; shows the plan for them."""

    changed = Signal()                 # a memory setting changed (the window persists it)
    applyRequested = Signal()         # load the budgets shown (Apply)
    planUpdated = Signal(object)       # memory.Plan (or None without a model)

    def __init__(self, spec_fn: Callable[[], RunSpec], parent=None):
        super().__init__(parent)
        self._spec_fn = spec_fn
        self.figures = None
        self.plan = None
        self.available_override: int | None = None
        self.probe = None
        self.details = False             # the engine's vocabulary shown (window toggle)
        self._measured: tuple[int, int] | None = None    # (planned, measured peak) bytes
        self.baseline_bytes = 0
        self._quiet = False

        # -- controls ---------------------------------------------------------------
        controls = QGroupBox("Budgets")
        form = QFormLayout(controls)
        self.preset = QComboBox()
        for name in (AUTO,) + tuple(PRESETS) + (CUSTOM,):
            self.preset.addItem(name, name)
        tips = {AUTO: "Size both budgets from this machine's free memory, trunk first. "
                      "Recommended.",
                CUSTOM: "The trunk and cache budgets set with the sliders below."}
        for i in range(self.preset.count()):
            name = self.preset.itemData(i)
            p = PRESETS.get(name)
            tip = tips.get(name) or (f"trunk {p.trunk_gb:g} GB / expert cache {p.cache_gb:g} "
                                     f"GB. {p.note}")
            self.preset.setItemData(i, tip, Qt.ToolTipRole)
        self.preset.setToolTip("A preset only sets the two budgets (SYSTEM §5.2); moving a "
                               "slider switches to custom.")
        form.addRow("Preset", self.preset)
        self.trunk = BudgetSlider()
        self.trunk.setToolTip(TERM_HELP["trunk"])
        form.addRow("Trunk budget", self.trunk)
        self.cache = BudgetSlider()
        self.cache.setToolTip(TERM_HELP["cache"])
        form.addRow("Expert cache", self.cache)
        self.ring = QSpinBox()
        self.ring.setRange(1, 8)
        self.ring.setToolTip("Ring slots for streamed layers (--trunk-ring, 1..8). Two or more "
                             "let the reader fetch the next layer while this one computes; "
                             "one slot means no read-ahead.")
        form.addRow("Ring slots", self.ring)
        self.policy = QComboBox()
        self.policy.addItem("LRU (the reference's)", "lru")
        self.policy.addItem("S3-FIFO", "s3fifo")
        self.policy.setToolTip(
            "Which routed expert the cache drops for a new one (--cache-policy). LRU drops the "
            "least recently used; S3-FIFO keeps experts that are used again and again, which "
            "reads fewer experts from disk once the cache holds thousands of K3's (32 GB and "
            "up) and more below ~16 GB. The What-if tab's trace shows which suits a budget. "
            "Never changes the tokens.")
        self.lookahead = QCheckBox("lookahead reads")
        self.lookahead.setToolTip(
            "Lookahead expert reads (--no-lookahead turns them off): at each layer's start "
            "its router is applied to a guess of its input, and the guessed experts that are "
            "not in the cache start reading while the layer's attention computes. A wrong "
            "guess costs bytes, never bits: the tokens and the cache's choices are the same "
            "either way. The plan holds one layer's experts more for the reads in flight.")
        experts_row = QHBoxLayout()          # one row for both: the tab fits 1024x700
        experts_row.addWidget(self.policy, 1)
        experts_row.addWidget(self.lookahead)
        form.addRow("Expert replacement", experts_row)
        self.threads = QSpinBox()
        self.threads.setRange(0, max(os.cpu_count() or 1, 1))
        from k3engine.threads import default_threads
        self.threads.setSpecialValueText(f"engine default ({default_threads()})")
        self.threads.setToolTip("Compute threads (--threads). The default is OMP_NUM_THREADS, "
                                "else the number of physical cores. Never changes the tokens.")
        form.addRow("Threads", self.threads)
        self.drafter = PathRow("optional: block drafter folder (config.json + "
                               "model.safetensors)",
                               "A block drafter (--draft-model) proposes several tokens that "
                               "the model verifies in one trunk pass: fewer trunk reads per "
                               "token, the same tokens. Greedy replies only. The demo's: "
                               "k3 demo --drafter-path.")
        form.addRow("Block drafter", self.drafter)
        self.budget_note = QLabel()
        self.budget_note.setObjectName("hint")
        self.budget_note.setWordWrap(True)
        form.addRow(self.budget_note)

        # -- machine -----------------------------------------------------------------
        machine = QGroupBox("This machine")
        mlay = QVBoxLayout(machine)
        self.available_label = QLabel()
        self.available_label.setWordWrap(True)
        self.available_label.setToolTip(TERM_HELP["available"])
        refresh = QPushButton("Refresh")
        refresh.setToolTip("Probe available memory again (MemAvailable and cgroup limits)")
        refresh.clicked.connect(self.refresh_available)
        row = QHBoxLayout()
        row.addWidget(self.available_label, 1)
        row.addWidget(refresh)
        mlay.addLayout(row)

        # -- the plan ----------------------------------------------------------------
        plan_box = QGroupBox("Memory plan")
        play = QVBoxLayout(plan_box)
        self.verdict = QLabel("Pick a model in Setup to see its plan.")
        self.verdict.setWordWrap(True)
        self.verdict.setTextInteractionFlags(Qt.TextSelectableByMouse)
        play.addWidget(self.verdict)
        # Apply: load these budgets now (the window reloads in place; the conversation stays)
        self.apply_btn = QPushButton("Apply")
        self.apply_btn.setObjectName("primary")
        self.apply_btn.setEnabled(False)
        self.apply_btn.clicked.connect(self.applyRequested)
        play.addWidget(self.apply_btn, 0, Qt.AlignLeft)
        self.usage = QProgressBar()
        self.usage.setRange(0, 1000)
        self.usage.setTextVisible(True)
        self.usage.setToolTip("Planned total as a share of what admission allows (95% of "
                              "available)")
        play.addWidget(self.usage)
        self.table = QTableWidget(0, 3)
        self.table.setHorizontalHeaderLabels(["term", "bytes", "share of total"])
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setSectionResizeMode(0, QHeaderView.Stretch)
        self.table.horizontalHeader().setSectionResizeMode(1, QHeaderView.ResizeToContents)
        self.table.horizontalHeader().setSectionResizeMode(2, QHeaderView.ResizeToContents)
        self.table.setEditTriggers(QTableWidget.NoEditTriggers)
        self.table.setSelectionMode(QTableWidget.NoSelection)
        play.addWidget(self.table, 1)
        self.detail = QLabel()
        self.detail.setWordWrap(True)
        self.detail.setObjectName("hint")
        play.addWidget(self.detail)
        self.measured = QLabel(MEASURED_EMPTY)
        self.measured.setWordWrap(True)
        play.addWidget(self.measured)

        self.forecast_box = ForecastBox()         # the forecast column (forecast_box.py)
        self.forecast_box.machineMeasured.connect(lambda _m: self.refresh())

        grid = QGridLayout(self)
        grid.addWidget(controls, 0, 0)
        grid.addWidget(machine, 1, 0)
        grid.addWidget(self.forecast_box, 2, 0)
        grid.addWidget(plan_box, 0, 1, 3, 1)
        grid.setColumnStretch(0, 2)
        grid.setColumnStretch(1, 3)
        grid.setRowStretch(2, 1)

        self.preset.currentIndexChanged.connect(self._preset_changed)
        self.trunk.changed.connect(self._budget_moved)
        self.cache.changed.connect(self._budget_moved)
        self.ring.valueChanged.connect(self._other_changed)
        self.policy.currentIndexChanged.connect(self._other_changed)
        self.lookahead.toggled.connect(self._other_changed)
        self.threads.valueChanged.connect(self._other_changed)
        self.drafter.edited.connect(self._emit)
        self.refresh_available()

    # -- state in and out ------------------------------------------------------------
    def load_from(self, s) -> None:
        self._quiet = True
        try:
            i = self.preset.findData(s.preset)
            self.preset.setCurrentIndex(i if i >= 0 else self.preset.findData(CUSTOM))
            self.trunk.set_value(s.trunk_gb)
            self.cache.set_value(s.cache_gb)
            self.ring.setValue(s.trunk_ring)
            i = self.policy.findData(s.cache_policy)
            self.policy.setCurrentIndex(max(i, 0))     # an unknown name: the reference's LRU
            self.lookahead.setChecked(bool(s.lookahead))
            self.threads.setValue(s.threads)
            self.drafter.set_text(s.draft_model)
        finally:
            self._quiet = False
        self.refresh()

    def values(self) -> dict:
        return dict(preset=self.preset.currentData(), trunk_gb=self.trunk.value(),
                    cache_gb=self.cache.value(), trunk_ring=self.ring.value(),
                    cache_policy=self.policy.currentData(), lookahead=self.lookahead.isChecked(),
                    threads=self.threads.value(), draft_model=self.drafter.text())

    def set_figures(self, figures) -> None:
        """The model's sizes (None: no model chosen).  Slider ranges follow the model."""
        self.figures = figures
        if figures is not None:
            from k3engine.memory import plan_trunk
            # everything pinned, plus the ring the planner pays for first
            full = plan_trunk(figures.layer_sizes, 10**15, self.ring.value(),
                              figures.widen_bytes).total_bytes
            pool = figures.expert_pool * figures.expert_slot_bytes
            self.trunk.set_range_max(max(full * 1.1, 1e6) / 1e9)
            self.cache.set_range_max(max(pool * 1.1, 1e6) / 1e9)
        self.refresh()

    def set_available_override(self, nbytes: int | None) -> None:
        """Plan against this figure instead of the probe (tests; what-if planning)."""
        self.available_override = nbytes
        self.refresh_available()

    def set_baseline(self, nbytes: int) -> None:
        self.baseline_bytes = int(nbytes)
        self.forecast_box.baseline_bytes = int(nbytes)
        self.refresh()

    def set_budgets(self, trunk_gb: float, cache_gb: float) -> None:
        """Set both budgets as the user would (custom preset; `changed` is emitted)."""
        self._quiet = True
        try:
            self.preset.setCurrentIndex(self.preset.findData(CUSTOM))
            self.trunk.set_value(trunk_gb)
            self.cache.set_value(cache_gb)
        finally:
            self._quiet = False
        self._emit()

    @property
    def available(self):
        """What plan() gets: the override, else the probe itself (fail-closed aware)."""
        return self.available_override if self.available_override is not None else self.probe

    # -- reactions -----------------------------------------------------------------
    def refresh_available(self) -> None:
        if self.available_override is None:
            from k3engine.memory import available_memory
            _, self.probe = available_memory()
        self._show_available()
        self.refresh()

    def _show_available(self) -> None:
        if self.available_override is not None:
            self.available_label.setText(f"<b>{human(self.available_override)}</b> available "
                                         f"(set by hand, not probed)")
            return
        total = f"; {human(self.probe.total)} total" if self.probe.total else ""
        # how the figure was found ("host binds", a cgroup limit) is the engine's vocabulary
        how = self.probe.how if self.details else f"{human(self.probe.bytes)} available"
        self.available_label.setText(f"<b>{how}</b>{total}")

    def set_details(self, on: bool) -> None:
        self.details = on
        if self.probe is not None or self.available_override is not None:
            self._show_available()

    def _preset_changed(self) -> None:
        name = self.preset.currentData()
        if name in PRESETS:
            self.trunk.set_value(PRESETS[name].trunk_gb)
            self.cache.set_value(PRESETS[name].cache_gb)
        self._emit()

    def _budget_moved(self, _v: float) -> None:
        if self._quiet:
            return
        if self.preset.currentData() != CUSTOM:
            self.preset.blockSignals(True)
            self.preset.setCurrentIndex(self.preset.findData(CUSTOM))
            self.preset.blockSignals(False)
        self._emit()

    def _other_changed(self, _v: int) -> None:
        if self.figures is not None and self.sender() is self.ring:
            self.set_figures(self.figures)   # the all-pinned size depends on the ring
        self._emit()

    def _emit(self) -> None:
        if self._quiet:
            return
        self.changed.emit()
        self.refresh()

    # -- the plan ------------------------------------------------------------------
    def refresh(self) -> None:
        if self._quiet:
            return
        if self.figures is None:
            self.plan = None
            self.verdict.setObjectName("")
            self.verdict.setText("Pick a model in Setup to see its plan.")
            self.table.setRowCount(0)
            self.planUpdated.emit(None)
            return
        spec = self._spec_fn()
        try:
            p = make_plan(self.figures, spec, self.available, self.baseline_bytes,
                          (self.probe.total or 0) if self.available_override is None
                          and self.probe else 0)
        except EngineError as e:         # the drafter folder: say why, plan without it
            self.drafter.show_check(Check(ERROR, str(e)))
            spec = replace(spec, draft_model="")
            p = make_plan(self.figures, spec, self.available, self.baseline_bytes,
                          (self.probe.total or 0) if self.available_override is None
                          and self.probe else 0)
        else:
            self.drafter.show_check(Check(OK, f"block drafter: {human(p.drafter_bytes)} "
                                              f"planned") if spec.draft_model else
                                    Check(EMPTY, ""))
        self.plan = p
        if spec.preset == AUTO:              # show what auto chose on the sliders
            self.trunk.set_value(p.trunk_gb)
            self.cache.set_value(p.cache_gb)
        self._show(p, spec)
        self.forecast_box.update_for(p, int(spec.trunk_ring), spec.lookahead)
        self.planUpdated.emit(p)

    def _show(self, p, spec: RunSpec) -> None:
        rows = [("trunk", "trunk (streamed)" if p.streamed else "trunk (resident)",
                 p.trunk_bytes),
                ("tables", "embed + lm_head" + (" (streamed)" if p.ultra else ""),
                 p.model_table_bytes),
                ("cache", "expert cache", p.expert_cache_bytes),
                ("state", "recurrent state", p.recurrent_state_bytes),
                ("buffers", "buffers", p.buffer_bytes),
                ("kv", "KV cache", p.kv_cache_bytes),
                ("drafter", "block drafter", p.drafter_bytes),
                ("baseline", "app baseline (measured)", p.baseline_bytes),
                ("total", "TOTAL", p.total_bytes)]
        if p.available_bytes > 0:
            rows += [("available", "available", p.available_bytes),
                     ("limit", "admission limit (95%)", int(p.limit_bytes))]
        self.table.setRowCount(len(rows))
        total = max(p.total_bytes, 1)
        for r, (key, label, nbytes) in enumerate(rows):
            items = [QTableWidgetItem(label), QTableWidgetItem(human(nbytes)),
                     QTableWidgetItem(f"{100 * nbytes / total:5.1f} %"
                                      if key not in ("total", "available", "limit") else "")]
            items[1].setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
            for c, it in enumerate(items):
                it.setToolTip(TERM_HELP[key])
                if key == "total":
                    f = it.font()
                    f.setBold(True)
                    it.setFont(f)
                self.table.setItem(r, c, it)
        limit = p.limit_bytes
        if limit > 0:
            self.usage.setValue(int(min(1.0, p.total_bytes / limit) * 1000))
            self.usage.setFormat(f"{100 * p.total_bytes / limit:.1f}% of the admission limit")
        else:
            self.usage.setValue(0)
            self.usage.setFormat("available memory unknown: no admission check")
        if p.admitted:
            msg = (f"Fits: {human(p.total_bytes)} planned"
                   + (f", {100 * p.total_bytes / limit:.0f}% of the {human(limit)} a plan may "
                      f"use" if limit > 0 else " (available memory unknown)"))
            if not p.cache_fits_topk:
                msg += (f". But the expert cache holds only {p.expert_slots} slots and top-k "
                        f"needs {p.expert_slots_needed}: loading will fail; raise the cache.")
            over = self._measured_over(p.total_bytes)
            if over:
                # "Fits" is the admission check; the run itself went past the forecast
                msg += f". Measured: {human(over)} over this plan (a forecast)"
            self.verdict.setObjectName("verdict_ok" if p.cache_fits_topk else "verdict_refused")
            self.verdict.setText(msg)
        else:
            first = p.refusals[0]
            self.verdict.setObjectName("verdict_refused")
            self.verdict.setText(f"Refused (k3 would exit {first.exit_code}):\n"
                                 + "\n\n".join(r.message for r in p.refusals))
        self.verdict.style().unpolish(self.verdict)
        self.verdict.style().polish(self.verdict)
        tp = p.trunk_plan
        bits = []
        if tp is not None:
            # the ring the trunk will use: no more slots than layers left to stream (the
            # engine's rule; the header shows the loaded ring, and the two agree)
            ring = min(tp.ring_slots, tp.n_layers - tp.n_pinned)
            # the packed trunk's size as Setup gives it (the plan's trunk term adds the
            # ring and the widening room to the pinned layers: a different figure)
            whole = (f" of the {human(sum(self.figures.layer_sizes[:tp.n_layers]))} packed "
                     f"trunk" if self.figures is not None else "")
            bits.append(f"trunk: {tp.n_pinned}/{tp.n_layers} layers pinned "
                        f"({human(tp.pinned_bytes)}{whole}), ring {ring} x "
                        f"{human(tp.slot_bytes)}; deterministic trunk hit rate "
                        f"{100 * tp.hit_rate:.0f}%")
            if tp.ring_held:
                bits.append(f"ring held at {tp.ring_slots} of {tp.ring_want} slots: raise the "
                            f"trunk budget for more read-ahead")
        else:
            bits.append("trunk resident: pack a trunk in Setup to stream it within a budget")
        bits.append(f"expert cache: {p.expert_slots} slots x {human(p.expert_slot_bytes)}")
        if p.trace_window:
            bits.append(f"buffers include the What-if trace: the latest {p.trace_window:,} "
                        f"expert requests ({human(p.trace_bytes)})")
        bits.append(f"{p.positions} positions planned (generation limit {spec.gen} + 1)")
        if p.auto is not None:
            bits.append(p.auto.line)
        self.detail.setText(" · ".join(bits))
        self.budget_note.setText(
            "Fill the trunk before the cache: a GB of trunk removes ~1.17 GB/token of reads "
            "on the real model; a GB of cache removes little below ~36 GB." if tp else
            "Budgets apply to a streamed trunk; without one the whole trunk is resident.")

    def clear_measured(self) -> None:
        """A new conversation: the last reply's peak is not this one's."""
        self.measured.setText(MEASURED_EMPTY)
        self._measured = None
        self.refresh()

    def _measured_over(self, planned: int) -> int:
        """Bytes the measured peak went over `planned`, when it was measured on that plan."""
        m = self._measured
        return m[1] - m[0] if m and m[0] == planned and m[1] > m[0] else 0

    def show_measured(self, planned: int, peak: int, after_load: int | None = None) -> None:
        """Planned total against the measured peak RSS of this process."""
        self._measured = (int(planned), int(peak))
        self.refresh()                   # the verdict says when the peak went over the plan
        diff = peak - planned
        word = "under" if diff < 0 else "over"
        extra = (f"; {human(after_load)} right after loading the weights"
                 if after_load else "")
        self.measured.setText(
            f"<b>Measured peak RSS {human(peak)}</b> vs planned {human(planned)} "
            f"({human(abs(diff))} {word} the plan){extra}. The plan is a forecast; the peak "
            f"RSS from the OS is the figure to quote.")
