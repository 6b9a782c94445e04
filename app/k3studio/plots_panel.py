"""Telemetry plots (SYSTEM §7.5): what the engine does per token, as it streams.

pyqtgraph's scrolling-plot pattern: every series is a preallocated array that each token
appends one value to; the curves are created once and only get `setData` with views of
those arrays (never rebuilt per token).  Batches of records arrive coalesced from the
worker, so the plots are redrawn once per batch, however fast tokens come.

Plots: RSS (current and peak) against the plan and the available memory; I/O share per
token split into trunk and experts; the TRUE resident hit rate and retention of the
expert cache (with the flattering raw hit rate dashed for contrast); seconds per token;
bytes read per token (trunk + experts).  Plus the trunk map (pinned layers vs the ring)
and an expert heat view from the cache's request histogram.  PNG and CSV export.
"""
from __future__ import annotations

import csv

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QFont, QPainter, QPixmap
from PySide6.QtWidgets import (QFileDialog, QHBoxLayout, QLabel, QMenu, QPushButton,
                               QTabWidget, QVBoxLayout, QWidget)

from k3engine.memory import human, human_seconds

TRUNK_COLOR = "#2f6fe0"       # blue: the trunk, everywhere in the app
EXPERT_COLOR = "#e08a1b"      # amber: the experts
RSS_COLOR = "#7b3fb5"
OK_COLOR = "#2e8b57"
BAD_COLOR = "#c0392b"
EMPTY_TEXT = "no tokens yet"
TITLE_SIZE = "9.5pt"          # short titles at a modest size
# Two or three plots a page, stacked, so each keeps its size in a ~300 px side panel (six
# at once were ~40 px tall at 1024x700, their ticks overlapping)
PAGES = ("Speed", "Memory", "Experts")
INITIAL_CAPACITY = 4096       # one reply at the largest --gen; doubles if a session grows

# CSV columns, in order: the per-token record's keys
CSV_COLUMNS = ("token", "seconds", "rss_bytes", "peak_rss_bytes", "plan_total", "available",
               "trunk_bytes", "expert_bytes", "trunk_read_s", "expert_read_s",
               "io_share_step", "io_trunk_share", "io_expert_share", "true_resident_hit",
               "retention", "raw_hit", "resident_experts", "expert_requests")


class Series:
    """Columns of float64 preallocated once; append one row per token."""

    def __init__(self, columns, capacity: int = INITIAL_CAPACITY):
        self.columns = tuple(columns)
        self.n = 0
        self.data = {c: np.zeros(capacity) for c in self.columns}

    @property
    def capacity(self) -> int:
        return len(next(iter(self.data.values())))

    def append(self, row: dict) -> None:
        if self.n == self.capacity:          # rare: grow once, geometrically
            for c in self.columns:
                grown = np.zeros(self.capacity * 2)
                grown[:self.n] = self.data[c][:self.n]
                self.data[c] = grown
        for c in self.columns:
            self.data[c][self.n] = row.get(c, 0.0) or 0.0
        self.n += 1

    def view(self, c: str) -> np.ndarray:
        return self.data[c][:self.n]

    def keep_last(self, k: int) -> None:
        """Drop all but the newest `k` rows (a scrolling window: once per k appends)."""
        k = min(k, self.n)
        for c in self.columns:
            self.data[c][:k] = self.data[c][self.n - k:self.n]
        self.n = k

    def clear(self) -> None:
        self.n = 0


def chrome(dark: bool) -> tuple[str, str]:
    """The plots' background and foreground for the theme."""
    return ("#1e2128", "#c9cfdd") if dark else ("w", "#2b3245")


def _pen(color, width=2, dash=False):
    p = pg.mkPen(color=color, width=width)
    if dash:
        p.setStyle(Qt.DashLine)
    return p


def _brush(color, alpha=70):
    c = QColor(color)
    c.setAlpha(alpha)
    return pg.mkBrush(c)


class PlotsPanel(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        pg.setConfigOptions(antialias=True, background="w", foreground="#2b3245")
        self.series = Series(CSV_COLUMNS)
        self.plan_total = 0
        self.available = 0

        self.views = {name: pg.GraphicsLayoutWidget() for name in PAGES}
        self.pages = QTabWidget()
        self.pages.setObjectName("plot_pages")
        self.pages.setDocumentMode(True)
        for name in PAGES:
            self.pages.addTab(self.views[name], name)
        self.view = self.pages
        self.extra_pages: list = []     # pages others add (batch_plots, while serving)
        f = QFont()
        f.setPointSize(9)

        def plot(v, row, title, units=None, left=None):
            p = v.addPlot(row=row, col=0)
            p.setTitle(title, size=TITLE_SIZE)
            p.showGrid(x=True, y=True, alpha=0.25)
            p.setLabel("bottom", "token")
            if left:
                p.setLabel("left", left, units=units)
            p.addLegend(offset=(-8, 8), labelTextSize="8pt")
            p.setMouseEnabled(x=True, y=False)
            p.getAxis("left").setTickFont(f)
            if units is None:             # a share in %: never "% (x0.001)"
                p.getAxis("left").enableAutoSIPrefix(False)
            p.getAxis("bottom").setTickFont(f)
            return p

        # RSS vs plan and available
        speed, memory, experts = (self.views[n] for n in PAGES)
        self.p_rss = plot(memory, 0, "RSS vs plan", "B", "RSS")
        self.c_rss = self.p_rss.plot(name="RSS now", pen=_pen(RSS_COLOR))
        self.c_peak = self.p_rss.plot(name="peak RSS", pen=_pen(RSS_COLOR, 1, dash=True))
        # labels left-aligned just inside the plot, above their line: a label centred at
        # 5 % of the width lost its first digits to the axis ("67.41 MB" for 167.41)
        inside = [(0, 1), (0, 1)]
        self.l_plan = pg.InfiniteLine(angle=0, pen=_pen(OK_COLOR, 1.5, dash=True), movable=False,
                                      label="plan", labelOpts={"position": 0.02,
                                                               "anchors": inside,
                                                               "color": OK_COLOR})
        self.l_avail = pg.InfiniteLine(angle=0, pen=_pen(BAD_COLOR, 1.5, dash=True),
                                       movable=False, label="available",
                                       labelOpts={"position": 0.02, "anchors": inside,
                                                  "color": BAD_COLOR})
        for line in (self.l_plan, self.l_avail):
            line.setVisible(False)
            self.p_rss.addItem(line, ignoreBounds=True)

        # seconds per token
        self.p_spt = plot(speed, 0, "Seconds/token", "s", "time")
        self.c_spt = self.p_spt.plot(name="s/token", pen=_pen("#2b3245"), symbol="o",
                                     symbolSize=3, symbolBrush="#2b3245")

        # I/O share, trunk/expert split (stacked: trunk below, experts on top)
        self.p_io = plot(speed, 1, "I/O share", None, "%")
        self.c_io_total = self.p_io.plot(name="experts", pen=_pen(EXPERT_COLOR),
                                         fillLevel=0, brush=_brush(EXPERT_COLOR))
        self.c_io_trunk = self.p_io.plot(name="trunk", pen=_pen(TRUNK_COLOR),
                                         fillLevel=0, brush=_brush(TRUNK_COLOR, 110))

        # bytes read per token, split
        self.p_gb = plot(memory, 1, "Read/token", "B", "read")
        self.c_gb_total = self.p_gb.plot(name="experts", pen=_pen(EXPERT_COLOR), fillLevel=0,
                                         brush=_brush(EXPERT_COLOR))
        self.c_gb_trunk = self.p_gb.plot(name="trunk", pen=_pen(TRUNK_COLOR), fillLevel=0,
                                         brush=_brush(TRUNK_COLOR, 110))

        # the expert cache: TRUE resident hit rate and retention
        self.p_hit = plot(experts, 0, "Expert cache", None, "%")
        self.p_hit.setYRange(0, 100)
        self.c_true = self.p_hit.plot(name="TRUE resident hit", pen=_pen(OK_COLOR, 2.5))
        self.c_ret = self.p_hit.plot(name="retention", pen=_pen("#2b3245"))
        self.c_raw = self.p_hit.plot(name="raw hit (flattering)", pen=_pen("#9aa2b5", 1,
                                                                           dash=True))

        # expert heat: requests per (layer, expert)
        self.p_heat = experts.addPlot(row=1, col=0)
        self.p_heat.setTitle("Expert heat", size=TITLE_SIZE)
        self.p_heat.setLabel("bottom", "expert")
        self.p_heat.setLabel("left", "layer")
        self.p_heat.invertY(True)
        self.heat_img = pg.ImageItem(axisOrder="row-major")
        self.heat_img.setColorMap(pg.colormap.get("viridis"))
        self.p_heat.addItem(self.heat_img)
        self.heat = None

        # trunk map: pinned vs ring, one cell per layer
        self.p_map = memory.addPlot(row=2, col=0)
        self.p_map.setTitle("Trunk map", size=TITLE_SIZE)
        self.p_map.hideAxis("left")
        self.p_map.setLabel("bottom", "layer")
        self.p_map.setMouseEnabled(x=False, y=False)
        self.p_map.setMaximumHeight(110)
        self.map_bars = pg.BarGraphItem(x=[], height=[], width=0.9, brushes=[])
        self.p_map.addItem(self.map_bars)
        self.map_info: dict | None = None
        memory.ci.layout.setRowStretchFactor(0, 3)
        memory.ci.layout.setRowStretchFactor(1, 3)
        memory.ci.layout.setRowStretchFactor(2, 1)

        # Empty state: a plot without points says so instead of showing pyqtgraph's default
        # 0..1 axes (or a -400..400 x0.001 range for an empty fill curve).
        self._token_plots = (self.p_rss, self.p_spt, self.p_io, self.p_gb, self.p_hit)
        self.empty_items = {}
        for p, text in [(p, EMPTY_TEXT) for p in self._token_plots] + [
                (self.p_heat, "no expert requests yet"), (self.p_map, "no model loaded")]:
            t = pg.TextItem(text, anchor=(0.5, 0.5), color="#8a93a8")
            p.addItem(t, ignoreBounds=True)
            self.empty_items[p] = t
        self._set_empty(self._token_plots, True)
        self._set_empty((self.p_heat, self.p_map), True)
        self.archive: list[tuple[str, Series]] = []   # earlier runs' series (exportable)

        self.curves = {
            "rss": self.c_rss, "peak": self.c_peak, "spt": self.c_spt,
            "io_total": self.c_io_total, "io_trunk": self.c_io_trunk,
            "gb_total": self.c_gb_total, "gb_trunk": self.c_gb_trunk,
            "true_hit": self.c_true, "retention": self.c_ret, "raw_hit": self.c_raw,
        }

        # -- toolbar ------------------------------------------------------------------
        self.summary = QLabel("Plots fill as tokens are generated.")
        self.summary.setObjectName("hint")
        self.summary.setWordWrap(True)
        self.details = QLabel()
        self.details.setObjectName("hint")
        self.details.setWordWrap(True)
        self.show_details = False          # the engine's vocabulary in the summary
        self.map_label = self.heat_label = ""
        self.png_btn = QPushButton("PNG…")
        self.png_btn.setToolTip("Export the plots as a PNG image")
        self.csv_btn = QPushButton("CSV…")
        self.csv_btn.setToolTip("Export one row per token as CSV (the previous model's or "
                                "conversation's series too, from the menu)")
        self.clear_btn = QPushButton("Clear")
        self.png_btn.clicked.connect(self._png_dialog)
        self.csv_btn.clicked.connect(self._csv_dialog)
        self.clear_btn.clicked.connect(self.clear)
        # no title of its own: the side panel's tab says "Telemetry"
        top = QHBoxLayout()
        top.addStretch(1)
        for b in (self.clear_btn, self.png_btn, self.csv_btn):
            b.setObjectName("small")
            top.addWidget(b)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(top)
        lay.addWidget(self.summary)
        lay.addWidget(self.pages, 1)
        lay.addWidget(self.details)

    def set_dark(self, dark: bool) -> None:
        """Plot chrome for the theme (the series colours carry meaning and stay)."""
        bg, fg = chrome(dark)
        for v in self.views.values():
            v.setBackground(bg)
        for p in self._token_plots + (self.p_heat, self.p_map):
            for ax in ("left", "bottom"):
                a = p.getAxis(ax)
                a.setPen(fg)
                a.setTextPen(fg)
            p.titleLabel.setAttr("color", fg)
            p.titleLabel.setText(p.titleLabel.text)
            if p.legend is not None:      # the labels keep their colour until re-rendered
                p.legend.setLabelTextColor(fg)
                for _, label in p.legend.items:
                    label.setText(label.text)
        self.c_spt.setPen(_pen(fg))
        self.c_spt.setSymbolBrush(fg)
        self.c_ret.setPen(_pen(fg))
        for page in self.extra_pages:
            page.set_dark(dark, bg, fg)
        self.dark = dark

    def add_page(self, page, title: str) -> None:
        """Another page of plots (hidden until `show_page`); it follows the theme through
        its `set_dark(dark, bg, fg)`."""
        self.extra_pages.append(page)
        self.pages.setTabVisible(self.pages.addTab(page, title), False)
        if getattr(self, "dark", None) is not None:
            page.set_dark(self.dark, *chrome(self.dark))

    def show_page(self, page, on: bool, alone: bool = False) -> None:
        """Show (and open) or hide an added page; `alone`: the per-token pages are hidden
        meanwhile (nothing feeds them while the app's engine is released to its server)."""
        i = self.pages.indexOf(page)
        self.pages.setTabVisible(i, on)
        for name in PAGES:
            self.pages.setTabVisible(self.pages.indexOf(self.views[name]),
                                     not (on and alone))
        self.pages.setCurrentIndex(i if on else 0)
        if not on:
            self._redraw()                       # the summary line of the per-token series

    def _set_empty(self, plots, empty: bool) -> None:
        for p in plots:
            item = self.empty_items[p]
            if getattr(item, "_shown", None) is empty:
                continue                         # only on a change (this runs per batch)
            item._shown = empty
            item.setVisible(empty)
            if p.legend is not None:
                p.legend.setVisible(not empty)
            for ax in ("left", "bottom"):
                if p is not self.p_map or ax == "bottom":
                    p.showAxis(ax, not empty)
            if empty:
                p.disableAutoRange()
                p.setRange(xRange=(0, 1), yRange=(0, 1), padding=0)
                item.setPos(0.5, 0.5)
            elif p is self.p_hit:
                p.enableAutoRange(x=True)
                p.setYRange(0, 100)
            elif p is not self.p_map:
                p.enableAutoRange()

    def is_empty(self, p) -> bool:
        return bool(self.empty_items[p]._shown)

    # -- inputs -------------------------------------------------------------------------
    def set_model(self, info: dict | None) -> None:
        """The loaded model's shape: trunk map and plan/available lines."""
        self.map_info = info
        if info is None:
            self.map_bars.setOpts(x=[], height=[], brushes=[])
            self.map_label = ""
            self._set_empty((self.p_map,), True)
            self._details()
            return
        self._set_empty((self.p_map,), False)
        n = info["n_layers"]
        pinned = set(info["pinned_layers"])
        brushes = [pg.mkBrush(TRUNK_COLOR) if L in pinned else pg.mkBrush("#c9cfdd")
                   for L in range(n)]
        self.map_bars.setOpts(x=np.arange(n), height=np.ones(n), width=0.9, brushes=brushes)
        self.p_map.setXRange(-0.6, n - 0.4, padding=0)
        self.p_map.setYRange(0, 1.05, padding=0)
        kinds = info.get("layer_kinds") or []
        mla = [str(L) for L, k in enumerate(kinds) if k == "MLA"]
        if info["streamed"]:
            text = (f"trunk map: {len(pinned)}/{n} layers pinned (blue), {n - len(pinned)} "
                    f"streamed through a ring of {info['ring_slots']} x "
                    f"{human(info['slot_bytes'])} (grey)")
            self.p_map.setTitle(f"Trunk map: {len(pinned)}/{n} pinned, ring {info['ring_slots']}")
        else:
            text = f"trunk map: resident, all {n} layers in RAM"
            self.p_map.setTitle("Trunk map: resident")
        if mla:
            text += f"; MLA layers {', '.join(mla)}"
        self.map_label = text
        self._details()
        self.set_plan(info["plan_total"], info["available"])

    def _details(self) -> None:
        bits = [b for b in (self.map_label, self.heat_label) if b]
        self.details.setText(" · ".join(bits))

    def set_plan(self, total: int, available: int) -> None:
        self.plan_total, self.available = int(total), int(available)
        # visible first: a hidden label ignores its new text (the first plan showed as a
        # bare "plan" until the line moved again)
        for line, word, value in ((self.l_plan, "plan", self.plan_total),
                                  (self.l_avail, "available", self.available)):
            line.setVisible(value > 0)
            line.setPos(value)
            line.label.setFormat(f"{word} {human(value)}")
        self._title_rss()

    def _title_rss(self) -> None:
        # the available line is usually far off a small model's scale: say it in the
        # summary line (the plot's title stays short)
        self._redraw()

    def on_records(self, records: list) -> None:
        """One row per generated token; one redraw per batch."""
        s = self.series
        for r in records:
            row = dict(r)
            row["token"] = s.n + 1
            s.append(row)
        self._redraw()

    def set_heat(self, grid: np.ndarray) -> None:
        self.heat = grid
        self._set_empty((self.p_heat,), False)
        self.heat_img.setImage(grid, autoLevels=True)
        self.heat_img.setRect(-0.5, -0.5, grid.shape[1], grid.shape[0])
        routed = grid[grid.sum(axis=1) > 0]    # a dense layer (layer 0) requests none
        self.heat_label = (f"expert heat: {int(grid.sum())} requests over "
                           f"{int((routed > 0).sum())} of {routed.size} (layer, expert) pairs "
                           f"of the {routed.shape[0]} routed layers")
        self._details()

    def clear(self) -> None:
        self.series.clear()
        self._redraw()

    def reset(self, label: str) -> None:
        """A new model or a new conversation: start the token axis at 1 again, keeping the
        previous series (exportable: `export_csv(path, archived=-1)`)."""
        if self.series.n:
            old = Series(CSV_COLUMNS, max(self.series.n, 1))
            for c in CSV_COLUMNS:
                old.data[c][:self.series.n] = self.series.view(c)
            old.n = self.series.n
            self.archive.append((label, old))
            del self.archive[:-4]            # a few earlier runs, not the whole session
        self.heat = None
        self.heat_img.clear()
        self.heat_label = ""
        self._details()
        self._set_empty((self.p_heat,), True)
        self.clear()

    # -- drawing --------------------------------------------------------------------
    def _redraw(self) -> None:
        s = self.series
        x = s.view("token")
        rss, peak = s.view("rss_bytes"), s.view("peak_rss_bytes")
        self.c_rss.setData(x, rss)
        self.c_peak.setData(x, peak)
        self.c_spt.setData(x, s.view("seconds"))
        io_t = s.view("io_trunk_share") * 100
        io_all = io_t + s.view("io_expert_share") * 100
        self.c_io_total.setData(x, io_all)
        self.c_io_trunk.setData(x, io_t)
        gb_t = s.view("trunk_bytes")
        self.c_gb_total.setData(x, gb_t + s.view("expert_bytes"))
        self.c_gb_trunk.setData(x, gb_t)
        self.c_true.setData(x, s.view("true_resident_hit") * 100)
        self.c_ret.setData(x, s.view("retention") * 100)
        self.c_raw.setData(x, s.view("raw_hit") * 100)
        self._set_empty(self._token_plots, s.n == 0)
        if s.n:
            top = max(float(peak.max()), float(self.plan_total))
            # the available line is far above a small model's RSS: keep it out of the scale
            # unless it is close enough to matter
            if self.available and self.available < 3 * top:
                top = max(top, float(self.available))
            self.p_rss.setYRange(0, top * 1.08, padding=0)
            # every axis from 0 to what the data reaches: an all-zero series gets 0..1,
            # not pyqtgraph's centred -0.5..0.5 ("read (mB)" from -400 to 400)
            sec = s.view("seconds")
            read = gb_t + s.view("expert_bytes")
            for p, hi, floor, cap in ((self.p_spt, sec.max(), 1e-3, None),
                                      (self.p_io, io_all.max(), 10.0, 100.0),
                                      (self.p_gb, read.max(), 1.0, None)):
                top = max(float(hi) * 1.12, floor)
                p.setYRange(0, min(top, cap) if cap else top, padding=0)
            text = (f"{s.n} tokens · last {human_seconds(sec[-1])}/token · mean "
                    f"{human_seconds(sec.mean())} · read {human(read[-1])}/token · peak RSS "
                    f"{human(peak[-1])}")
            if self.show_details:
                text += (f" · I/O share {io_all[-1]:.0f}% (trunk {io_t[-1]:.0f}%) · TRUE "
                         f"resident hit {100 * s.view('true_resident_hit')[-1]:.1f}% · "
                         f"retention {100 * s.view('retention')[-1]:.1f}%"
                         + (f" · available {human(self.available)}" if self.available
                            else ""))
            self.summary.setText(text)
        else:
            self.summary.setText("Plots fill as tokens are generated." + (
                f" Available memory {human(self.available)}." if self.available else ""))

    def set_details(self, on: bool) -> None:
        self.show_details = on
        self.details.setVisible(on)          # the trunk map's and heat map's own terms
        self._redraw()

    def point_counts(self) -> dict[str, int]:
        """How many points each curve holds (tests: one per generated token)."""
        out = {}
        for name, c in self.curves.items():
            xs, _ = c.getData()
            out[name] = 0 if xs is None else len(xs)
        return out

    # -- export ---------------------------------------------------------------------
    def export_png(self, path: str) -> bool:
        """Every page, one under the other (a page not shown is laid out at the shown
        one's size first)."""
        size = self.pages.currentWidget().size()
        shots = []
        for v in self.views.values():
            if v.size() != size:
                v.resize(size)
            shots.append(v.grab())
        out = QPixmap(size.width(), sum(p.height() for p in shots))
        out.fill(Qt.white)
        painter = QPainter(out)
        y = 0
        for p in shots:
            painter.drawPixmap(0, y, p)
            y += p.height()
        painter.end()
        return out.save(path, "PNG")

    def export_csv(self, path: str, archived: int | None = None) -> None:
        """The current series, or `archived` (an index into `archive`, -1 the latest)."""
        s = self.series if archived is None else self.archive[archived][1]
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(CSV_COLUMNS)
            for i in range(s.n):
                w.writerow([int(s.data["token"][i])] + [f"{s.data[c][i]:.9g}"
                                                          for c in CSV_COLUMNS[1:]])

    def _png_dialog(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Export plots", "k3-telemetry.png",
                                              "PNG image (*.png)")
        if path:
            self.export_png(path)

    def _csv_dialog(self) -> None:
        archived = None
        if self.archive:              # which series: the current one or an earlier run's
            menu = QMenu(self)
            menu.addAction("Current series").setData(None)
            for i, (label, old) in enumerate(self.archive):
                menu.addAction(f"Earlier: {label} ({old.n} tokens)").setData(i)
            chosen = menu.exec(self.csv_btn.mapToGlobal(self.csv_btn.rect().bottomLeft()))
            if chosen is None:
                return
            archived = chosen.data()
        path, _ = QFileDialog.getSaveFileName(self, "Export telemetry", "k3-telemetry.csv",
                                              "CSV (*.csv)")
        if path:
            self.export_csv(path, archived)
