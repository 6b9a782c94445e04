"""What-if panel: from a recorded expert trace, the expert cache's hit-rate curve over cache
sizes and the predicted s/token of every trunk/cache split of the same total memory.

The curve is `k3 sim-cache`'s computation (`sim_cache.hit_curve`): LRU and S3-FIFO (the two
replacement policies the Memory tab offers) replayed through the engine's own policy
classes, Belady's optimal eviction as the ceiling, and the compulsory ceiling no policy
passes.  The splits are `forecast.splits` with the trace's hit rate under the Memory tab's
policy.
"Use this split" hands the chosen budgets to the Memory tab (the `useSplit` signal).
"""
from __future__ import annotations

import os

import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (QFileDialog, QGroupBox, QHBoxLayout, QHeaderView, QLabel,
                               QPushButton, QTableWidget, QTableWidgetItem, QVBoxLayout,
                               QWidget)

from k3engine import forecast as F
from k3engine.experts import POLICIES
from k3engine.memory import TRACE_PAIR_BYTES, human, human_seconds
from k3engine.tools import sim_cache

from .tasks import Task

CURVE_POINTS = 14
REFILL_MS = 250          # splits are recomputed once the sliders rest (a trace replay each)
SPLIT_ROWS = 10
SPLIT_COLUMNS = ["trunk", "cache", "pinned", "slots", "hit", "read/token",
                 "time/token (forecast)"]


def slot_series(min_slots: int, max_slots: int, n: int = CURVE_POINTS) -> list[int]:
    """Cache sizes for the curve: geometric from top-k + 1 to the largest useful size."""
    lo, hi = max(1, min_slots), max(min_slots + 1, max_slots)
    out = sorted({int(round(lo * (hi / lo) ** (i / (n - 1)))) for i in range(n)})
    return [s for s in out if s >= lo]


def compute_curve(keys: list[int], slots: list[int], **_) -> dict:
    """The curve (run on a task thread: Belady over a long trace takes seconds)."""
    pts = sim_cache.hit_curve(keys, slots, s3fifo=True)
    return {"slots": [p.slots for p in pts], "lru": [p.lru for p in pts],
            "s3fifo": [p.s3fifo for p in pts], "belady": [p.belady for p in pts],
            "ceiling": sim_cache.compulsory_ceiling(keys)}


class WhatIfPanel(QWidget):
    useSplit = Signal(float, float)          # trunk GB, cache GB

    def __init__(self, parent=None):
        super().__init__(parent)
        self.shape: F.ModelShape | None = None
        self.machine: F.MachineFigures | None = None
        self.keys: list[int] | None = None
        self.trace_label = ""
        self.total_requests = 0              # > len(keys): only the latest window is shown
        self.budget = (0.0, 0.0, 2)          # trunk GB, cache GB, ring
        self.curve: dict | None = None
        self.rows: list = []
        self.hits: F.TraceRouting | None = None    # one per trace: its replays are memoised
        self.policy = "lru"                         # the Memory tab's replacement policy
        self._task: Task | None = None
        self._refill = QTimer(self)
        self._refill.setSingleShot(True)
        self._refill.setInterval(REFILL_MS)
        self._refill.timeout.connect(self._fill_splits)

        top = QHBoxLayout()
        self.open_btn = QPushButton("Open trace…")
        self.open_btn.setToolTip("expert_trace.bin written by k3 --dump-cache-trace DIR")
        self.open_btn.clicked.connect(self._browse)
        self.source = QLabel("No trace: run the model (or open a trace file) to see the curve.")
        self.source.setWordWrap(True)
        top.addWidget(self.open_btn)
        top.addWidget(self.source, 1)

        pg.setConfigOptions(antialias=True, background="w", foreground="#2b3245")
        self.plot = pg.PlotWidget()
        # no SI prefix: pyqtgraph would scale GB into "mGB" or "(x0.001)" on the demo
        self.plot.setLabel("bottom", "expert cache (GB)")
        self.plot.getAxis("bottom").enableAutoSIPrefix(False)
        self.plot.setLabel("left", "hit rate", units="%")
        self.plot.addLegend(offset=(10, 10))
        self.plot.showGrid(x=True, y=True, alpha=0.2)
        self.lru_curve = self.plot.plot([], [], pen=pg.mkPen("#1f6feb", width=2), symbol="o",
                                        symbolSize=5, name="LRU (the default)")
        # the other replacement the Memory tab offers: where it crosses LRU is the budget
        # from which it reads fewer experts
        self.s3fifo_curve = self.plot.plot([], [], pen=pg.mkPen("#bf8700", width=2),
                                           symbol="t", symbolSize=6, name="S3-FIFO")
        self.belady_curve = self.plot.plot([], [], pen=pg.mkPen("#8250df", width=2,
                                                                style=Qt.DashLine),
                                           name="Belady (ceiling)")
        self.ceiling = pg.InfiniteLine(angle=0, pen=pg.mkPen("#cf222e", width=1.5,
                                                             style=Qt.DotLine),
                                       label="compulsory ceiling", movable=False,
                                       labelOpts={"position": 0.35})   # right of the legend
        self.current = pg.InfiniteLine(angle=90, pen=pg.mkPen("#1a7f37", width=2),
                                       label="current budget", movable=False,
                                       labelOpts={"position": 0.08})   # below the ceiling's
        self.plot.addItem(self.ceiling)
        self.plot.addItem(self.current)
        self.ceiling.setVisible(False)

        splits = QGroupBox("Trunk / cache splits of the same total")
        slay = QVBoxLayout(splits)
        self.total_label = QLabel()
        self.total_label.setWordWrap(True)
        slay.addWidget(self.total_label)
        self.table = QTableWidget(0, len(SPLIT_COLUMNS))
        self.table.setHorizontalHeaderLabels(SPLIT_COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.Stretch)
        self.table.setEditTriggers(QTableWidget.NoEditTriggers)
        self.table.setSelectionBehavior(QTableWidget.SelectRows)
        self.table.setSelectionMode(QTableWidget.SingleSelection)
        slay.addWidget(self.table, 1)
        row = QHBoxLayout()
        self.use_btn = QPushButton("Use this split")
        self.use_btn.setToolTip("Set the Memory tab's trunk and cache budgets to the selected "
                                "row (applies at the next load)")
        self.use_btn.setEnabled(False)
        self.use_btn.clicked.connect(self._use)
        self.assumptions = QLabel()
        self.assumptions.setObjectName("hint")
        self.assumptions.setWordWrap(True)
        row.addWidget(self.assumptions, 1)
        row.addWidget(self.use_btn)
        slay.addLayout(row)
        self.table.itemSelectionChanged.connect(
            lambda: self.use_btn.setEnabled(bool(self.table.selectedItems())))

        lay = QVBoxLayout(self)
        lay.addLayout(top)
        lay.addWidget(self.plot, 3)
        lay.addWidget(splits, 2)

    # -- inputs --------------------------------------------------------------------
    def set_model(self, shape: F.ModelShape | None) -> None:
        self.shape = shape
        self.curve = None
        self.recompute()

    def set_machine(self, machine: F.MachineFigures | None) -> None:
        self.machine = machine
        self._fill_splits()

    def set_policy(self, name: str) -> None:
        """The Memory tab's replacement policy: the splits replay the trace with it."""
        if name != self.policy:
            self.policy = name
            self.hits = F.TraceRouting(self.keys, self.trace_label, name) if self.keys else None
            self._fill_splits()
        self.table.horizontalHeaderItem(SPLIT_COLUMNS.index("hit")).setText(
            f"{POLICIES[name].title} hit")

    def set_budget(self, trunk_gb: float, cache_gb: float, ring: int = 2) -> None:
        """The Memory tab's budgets.  Kept as set; what the view uses is `in_force`: a
        budget above what the model can hold buys nothing (the max preset's 109 GB cache
        is the demo's 3.67 MB pool)."""
        self.budget = (float(trunk_gb), float(cache_gb), int(ring))
        self._mark_current()
        self._refill.start()

    def model_max_gb(self) -> tuple[float, float]:
        """(trunk, cache) GB that hold the whole model: every layer pinned (with the
        binder's widening room), every (layer, expert) pair in the cache."""
        from k3engine.memory import plan_trunk
        f = self.shape.figures
        trunk = plan_trunk(f.layer_sizes, 10**15, self.budget[2], f.widen_bytes).total_bytes
        return trunk / 1e9, f.expert_pool * f.expert_slot_bytes / 1e9

    @property
    def in_force(self) -> tuple[float, float, int]:
        trunk, cache, ring = self.budget
        if self.shape is None:
            return self.budget
        t_max, c_max = self.model_max_gb()
        return min(trunk, t_max), min(cache, c_max), ring

    def _unit(self) -> tuple[str, float]:
        """The cache axis in MB for a model whose whole pool is under a GB (the demo)."""
        if self.shape is not None and self.model_max_gb()[1] < 1.0:
            return "MB", 1e3
        return "GB", 1.0

    def set_dark(self, dark: bool) -> None:
        bg, fg = ("#1e2128", "#c9cfdd") if dark else ("w", "#2b3245")
        self.plot.setBackground(bg)
        for ax in ("left", "bottom"):
            self.plot.getAxis(ax).setPen(fg)
            self.plot.getAxis(ax).setTextPen(fg)
        legend = self.plot.getPlotItem().legend
        if legend is not None:
            legend.setLabelTextColor(fg)
            for _, label in legend.items:
                label.setText(label.text)

    def set_trace(self, keys: list[int] | None, label: str = "",
                  total: int | None = None) -> None:
        """`total`: the requests the trace covered, when `keys` is only the latest window
        of them (the session trace): the view then says so."""
        self.keys = list(keys) if keys else None
        self.trace_label = label
        self.total_requests = max(total or 0, len(self.keys or ()))
        self.hits = F.TraceRouting(self.keys, label, self.policy) if self.keys else None
        self.curve = None
        self.recompute()

    def open_trace(self, path: str) -> bool:
        try:
            pairs = sim_cache.read_trace(path)
        except (OSError, sim_cache.TraceError) as e:
            self.source.setText(f"Cannot read {path}: {e}")
            return False
        if not len(pairs):
            self.source.setText(f"{path}: the trace is empty")
            return False
        self.set_trace(sim_cache.trace_keys(pairs), f"trace {os.path.basename(path)}")
        return True

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open expert trace", "",
                                              "Expert trace (expert_trace.bin);;All files (*)")
        if path:
            self.open_trace(path)

    # -- the curve -----------------------------------------------------------------
    def recompute(self) -> None:
        if self.keys is None or self.shape is None:
            for c in (self.lru_curve, self.s3fifo_curve, self.belady_curve):
                c.setData([], [])
            self.ceiling.setVisible(False)
            self._fill_splits()
            return
        f = self.shape.figures
        top = max(f.topk + 1, min(f.expert_pool, int(len(set(self.keys)) * 1.2)))
        slots = slot_series(f.topk + 1, top)
        self.source.setText(f"{self._what()}; replaying…")
        if self._task is not None and not self._task.done:
            self._task.abort()
        t = self._task = Task(compute_curve, self.keys, slots)
        t.returned.connect(lambda c, t=t: self._curve_ready(t, c))
        t.errored.connect(lambda e: self.source.setText(f"replay failed: {e}"))
        t.start()

    @property
    def windowed(self) -> bool:
        """The keys are only the latest window of the trace's requests."""
        return self.keys is not None and self.total_requests > len(self.keys)

    def _what(self) -> str:
        n = len(self.keys)
        head = (f"{self.trace_label}: only the latest {n:,} of {self.total_requests:,} "
                f"requests (the session trace keeps a window of "
                f"{human(n * TRACE_PAIR_BYTES)})" if self.windowed else
                f"{self.trace_label}: {n:,} requests")
        return f"{head}, {len(set(self.keys)):,} distinct experts"

    def _curve_ready(self, task: Task, curve: dict) -> None:
        if task is not self._task or self.shape is None:
            return                              # a newer trace or no model any more
        self.curve = curve
        sb = self.shape.figures.expert_slot_bytes
        unit, scale = self._unit()
        self.plot.setLabel("bottom", f"expert cache ({unit})")
        gb = [s * sb / 1e9 * scale for s in curve["slots"]]
        self.lru_curve.setData(gb, curve["lru"])
        self.s3fifo_curve.setData(gb, curve["s3fifo"])
        self.belady_curve.setData(gb, curve["belady"])
        self.ceiling.setValue(curve["ceiling"])
        self.ceiling.setVisible(True)
        self.source.setText(f"{self._what()}; compulsory ceiling {curve['ceiling']:.1f}% "
                            f"(the same replay as k3 sim-cache)")
        self._mark_current()
        self._fill_splits()

    def _mark_current(self) -> None:
        self.current.setValue(self.in_force[1] * self._unit()[1])

    # -- the splits ----------------------------------------------------------------
    def _fill_splits(self) -> None:
        self.table.setRowCount(0)
        self.rows = []
        if self.shape is None:
            self.total_label.setText("Pick a model in Setup to see the predicted s/token of "
                                     "each split.")
            return
        if self.machine is None:
            self.total_label.setText("Measure this machine (Memory tab) to see the predicted "
                                     "s/token of each split.")
            return
        trunk, cache, ring = self.in_force
        total = trunk + cache
        if total <= 0:
            self.total_label.setText("Set a budget in the Memory tab.")
            return
        self.rows = F.splits(self.shape, self.machine, total, steps=SPLIT_ROWS, hits=self.hits,
                             trunk_ring=ring, streamed=self.shape.streamed)
        best = min(range(len(self.rows)), key=lambda i: self.rows[i][2].s_per_token)
        self.table.setRowCount(len(self.rows))
        for r, (t, c, fc) in enumerate(self.rows):
            tp = fc.plan.trunk_plan
            cells = [human(t * 1e9), human(c * 1e9),
                     f"{tp.n_pinned}/{tp.n_layers}" if tp else "resident",
                     str(fc.plan.expert_slots), f"{100 * fc.hit_rate:.1f}%",
                     human(fc.bytes_read_per_token), human_seconds(fc.s_per_token)]
            for col, text in enumerate(cells):
                it = QTableWidgetItem(text)
                it.setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
                if r == best:
                    f = it.font()
                    f.setBold(True)
                    it.setFont(f)
                self.table.setItem(r, col, it)
        self.total_label.setText(
            f"Total {human(total * 1e9)} (the trunk {human(trunk * 1e9)} + cache "
            f"{human(cache * 1e9)} in force: budgets above what the model holds buy nothing); "
            f"fastest forecast in bold." + ("" if self.shape.streamed else
                                             " The trunk is resident: pack a trunk to stream it."))
        fc0 = self.rows[0][2]
        self.assumptions.setText(" · ".join(a for a in fc0.assumptions
                                            if a.startswith(("expert hit", "device", "compute"))))
        self.assumptions.setToolTip("\n".join(fc0.assumptions))

    def _use(self) -> None:
        sel = self.table.selectedItems()
        if not sel or not self.rows:
            return
        t, c, _ = self.rows[sel[0].row()]
        self.useSplit.emit(t, c)


def session_trace(host) -> tuple[list[int], int] | None:
    """(keys, requests) of the loaded model's request trace (the app's LoadSpec keeps the
    latest window of it): the kept requests in order, and how many the session made in all
    (more than the keys once the window has moved on).  Read after a turn, while the
    worker is idle; None without a model or a trace."""
    engine = getattr(getattr(host, "worker", None), "engine", None)
    kept = engine.kept_trace() if engine is not None else None
    if kept is None:
        return None
    pairs, requests = kept
    return sim_cache.trace_keys(pairs), requests


def attach_whatif(window) -> None:
    """Wire the what-if panel and the Memory tab's forecast column into the window: the
    inspected model, the plan on the sliders, the trace after each turn, "use this split"."""
    from .forecast_box import model_shape
    w, mem = window.whatif, window.memory

    def inspected(insp) -> None:
        s = window.settings
        ok = insp.model.ok and insp.figures is not None
        shape = model_shape(s.model_dir, insp.figures, insp.trunk.ok and bool(s.trunk_dir)) \
            if ok else None
        device = (s.trunk_dir if insp.trunk.ok and s.trunk_dir else s.model_dir) or None
        mem.forecast_box.set_inputs(shape, device, mem.forecast_box.hits)
        w.set_model(shape)
        w.set_machine(mem.forecast_box.machine)
        mem.refresh()

    def planned(p) -> None:
        if p is not None:
            w.set_budget(p.trunk_gb, p.cache_gb, mem.ring.value())

    session: list[list[int]] = []                   # the latest session trace's keys

    def session_hits() -> None:
        if session:
            mem.forecast_box.hits = F.TraceRouting(session[0], "this session's runs",
                                                   mem.policy.currentData())

    def turn_done(info: dict) -> None:
        if info.get("failed"):
            return
        got = session_trace(window.host)
        if got:
            keys, total = got
            session[:] = [keys]
            w.set_trace(keys, "this session's runs", total)
            session_hits()
            mem.refresh()

    def policy_changed(_i: int) -> None:            # both forecasts replay with the policy
        w.set_policy(mem.policy.currentData())
        if session:
            session_hits()
            mem.refresh()

    window.setup.inspected.connect(inspected)
    mem.planUpdated.connect(planned)
    mem.policy.currentIndexChanged.connect(policy_changed)
    w.set_policy(mem.policy.currentData())          # the one the settings restored
    mem.forecast_box.machineMeasured.connect(w.set_machine)
    window.host.turnFinished.connect(turn_done)
    w.useSplit.connect(mem.set_budgets)
