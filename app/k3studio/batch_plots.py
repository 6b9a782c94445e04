"""The telemetry panel's Batch page: while the app serves its model (shared_engine.py),
what the one engine's steps do for all the conversations it holds, from the server's
`GET /k3/steps` (steps_feed.py).

Two plots: tokens/s in all with each slot's share beside it, one line per slot (the
window's conversation is one of them), all over the same last few steps (so a join's prompt
step does not hide the trend, and the slots' rates add up to the whole: a slot's rate since
it began beside a recent total read as a contradiction); and the batch size of each step.  pyqtgraph's
scrolling pattern as on the other pages: preallocated columns, curves made once and only
given `setData` per poll; the newest WINDOW steps are kept.  The key to the lines is the
summary above them (each slot's rate in its line's colour): a legend inside a plot ~300 px
wide covered the lines and lost its last entries.
"""
from __future__ import annotations

from collections import deque

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QFont
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from k3engine.memory import human

from .plots_panel import TITLE_SIZE, Series, _pen

MAX_SLOTS = 8                 # lines made up front; a server with more shows the first 8
WINDOW = 2048                 # steps kept on the plot
MEAN_STEPS = 8                # the aggregate rate: tokens over the last few steps' seconds
IDLE_S = 0.5                  # a longer pause between steps: the engine was idle
SLOT_COLORS = ("#2f6fe0", "#e08a1b", "#2e8b57", "#c0392b", "#7b3fb5", "#0e9aa7",
               "#b5651d", "#d63384")
EMPTY = ("Not serving. Serve this model (Setup) to see the rates of every conversation "
         "the engine holds.")


class BatchPlots(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.slots = 1
        self.fg = "#2b3245"
        self.series = Series(("t", "all", "batch", *(f"s{i}" for i in range(MAX_SLOTS))),
                             WINDOW)
        # (tokens, seconds, {slot: tokens}) of the last steps; the requests' token counts
        self._recent: deque = deque(maxlen=MEAN_STEPS)
        self._had: dict[int, int] = {}                    # request -> its tokens so far
        self._seen: set[int] = set()                       # slots busy at some step
        self.summary = QLabel(EMPTY)
        self.summary.setTextFormat(Qt.RichText)
        self.summary.setObjectName("hint")
        self.summary.setWordWrap(True)
        self.view = pg.GraphicsLayoutWidget()
        f = QFont()
        f.setPointSize(9)

        def plot(row, title, left):
            p = self.view.addPlot(row=row, col=0)
            p.setTitle(title, size=TITLE_SIZE)
            p.showGrid(x=True, y=True, alpha=0.25)
            p.setLabel("bottom", "server time", units="s")
            p.setLabel("left", left)
            p.setMouseEnabled(x=True, y=False)
            for ax in ("left", "bottom"):
                p.getAxis(ax).setTickFont(f)
                p.getAxis(ax).enableAutoSIPrefix(False)
            return p

        self.p_rate = plot(0, "Tokens/s: all, per slot", "tokens/s")
        self.c_all = self.p_rate.plot(pen=_pen(self.fg, 2.5), connect="finite")
        self.c_slot = [self.p_rate.plot(pen=_pen(c, 1.5), connect="finite")
                       for c in SLOT_COLORS]
        self.p_batch = plot(1, "Batch size per step", "slots")
        self.p_batch.getAxis("left").setTickSpacing(1, 1)        # whole slots only
        self.c_batch = self.p_batch.plot(pen=_pen("#5b6478", 1.5), stepMode="right")
        self.plot_items = (self.p_rate, self.p_batch)
        self.view.ci.layout.setRowStretchFactor(0, 3)
        self.view.ci.layout.setRowStretchFactor(1, 3)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.summary)
        lay.addWidget(self.view, 1)
        self.reset(1, serving=False)

    def reset(self, slots: int, serving: bool = True) -> None:
        """A server (re)started with `slots` slots, or none (`serving` False)."""
        self.slots = max(1, int(slots))
        self.series.clear()
        self._recent.clear()
        self._had.clear()
        self._seen.clear()
        self.summary.setText(f"Serving with {self.slots} slot{'s' * (self.slots > 1)}: "
                             f"the plots fill as they generate." if serving else EMPTY)
        self._redraw()

    def on_steps(self, steps: list) -> None:
        """Records from GET /k3/steps, in order: one row each, one redraw."""
        s = self.series
        for st in steps:
            if s.n and st["t"] - s.view("t")[-1] > max(IDLE_S, 5 * st["seconds"]):
                # the engine was idle: the lines break and the batch drops to 0, instead
                # of a straight line across the gap
                self._append({"t": s.view("t")[-1] + 1e-3, "batch": 0, "all": np.nan})
                self._recent.clear()
            # tokens this step: the growth of each request's count (a request is in every
            # step that gives it a token, so the last step's counts are all it needs)
            got = {x["slot"]: x["tokens"] - self._had.get(x["request"], 0)
                   for x in st["slots"]}
            self._had = {x["request"]: x["tokens"] for x in st["slots"]}
            self._recent.append((st["tokens"], st["seconds"], got))
            secs = sum(x for _, x, _ in self._recent)
            row = {"t": st["t"], "batch": st["batch"],
                   "all": sum(n for n, _, _ in self._recent) / secs if secs > 0 else 0.0}
            for x in st["slots"]:
                if x["slot"] < MAX_SLOTS and secs > 0:
                    n = sum(g.get(x["slot"], 0) for _, _, g in self._recent)
                    row[f"s{x['slot']}"] = n / secs
            self._append(row)
        if steps:
            self._seen.update(x["slot"] for st in steps for x in st["slots"]
                              if x["slot"] < MAX_SLOTS)
            self._say(steps[-1])
        self._redraw()

    def _append(self, row: dict) -> None:
        s = self.series
        if s.n == s.capacity:
            s.keep_last(WINDOW // 2)
        s.append({**{f"s{i}": np.nan for i in range(MAX_SLOTS)}, **row})

    def _say(self, last: dict) -> None:
        """The key and the latest figures: all (bold, the thick line's colour), then each
        busy slot's rate in its line's colour."""
        busy = sorted(x["slot"] for x in last["slots"] if x["slot"] < MAX_SLOTS)
        rates = "".join(
            f" · <span style='color:{SLOT_COLORS[k % MAX_SLOTS]}'>&#9632; slot "
            f"{k + 1} {self.series.view(f's{k}')[-1]:.1f}</span>" for k in busy)
        self.summary.setText(
            f"{last['batch']} of {self.slots} slots busy · <b>all "
            f"{self.series.view('all')[-1]:.1f} tokens/s</b>{rates} · read "
            f"{human(last['trunk_bytes'] + last['expert_bytes'])}/step")

    def _redraw(self) -> None:
        s = self.series
        t = s.view("t")
        self.c_all.setData(t, s.view("all"))
        for i, c in enumerate(self.c_slot):
            c.setData(t, s.view(f"s{i}"))
        if s.n:
            # stepMode "right": each step's size holds until the next step
            self.c_batch.setData(t, s.view("batch"))
            top = max(float(np.nanmax(s.view("all"))), 1e-3)
            self.p_rate.setYRange(0, top * 1.15, padding=0)
        else:
            self.c_batch.setData([], [])
            self.p_rate.setYRange(0, 1, padding=0)
        self.p_batch.setYRange(0, self.slots + 0.5, padding=0)

    def set_dark(self, dark: bool, bg: str, fg: str) -> None:
        self.fg = fg
        self.view.setBackground(bg)
        for p in (self.p_rate, self.p_batch):
            for ax in ("left", "bottom"):
                p.getAxis(ax).setPen(fg)
                p.getAxis(ax).setTextPen(fg)
            p.titleLabel.setAttr("color", fg)
            p.titleLabel.setText(p.titleLabel.text)
        self.c_all.setPen(_pen(fg, 2.5))

    def point_counts(self) -> dict[str, int]:
        """Points per curve (tests: one per step polled)."""
        xs, _ = self.c_all.getData()
        out = {"all": 0 if xs is None else len(xs), "batch": self.series.n}
        for i in self._seen:
            xs, ys = self.c_slot[i].getData()
            out[f"slot {i + 1}"] = int(np.isfinite(ys).sum()) if ys is not None else 0
        return out


__all__ = ["BatchPlots", "MAX_SLOTS", "WINDOW"]
