"""What-if tab and the Memory tab's forecast column: the curve of a trace recorded by a real
run (the same replay as `k3 sim-cache`), the current budget marked, splits of the same
total with their forecast, and "use this split" setting the Memory sliders."""
from __future__ import annotations

import pytest

from k3engine import forecast as F
from k3engine.cli import main as k3_main
from k3engine.tools import sim_cache

from .app_helpers import TIMEOUT, load, send

GIVEN = F.MachineFigures(
    identity={"cpu": "test"}, read_bps={"1": 1e9, "4": 2e9, "16": 3e9}, direct=True,
    bf16_bps=10e9, bf16_call_s=50e-6, mxfp4_bps=3e9, mxfp4_call_s=30e-6, call_seconds=5e-6,
    baseline_bytes=40_000_000, threads=1, measured_at="2026-12-01T00:00:00Z", source="given")


@pytest.fixture
def recorded_trace(demo_model, tmp_path):
    """expert_trace.bin from a real CLI run of the demo model (a streamed, evicting plan)."""
    model, trunk = demo_model
    out = tmp_path / "trace"
    out.mkdir()
    assert k3_main([model, "--ids", "5,17,99,123,400,7", "--gen", "6", "--incremental",
                    "--trunk", trunk, "--trunk-gb", "0.005", "--cache-gb", "0.005",
                    "--threads", "1", "--out", str(tmp_path / "o.json"),
                    "--dump-cache-trace", str(out)]) == 0
    return str(out / "expert_trace.bin")


def ready(qtbot, window, demo_model):
    window.memory.forecast_box.set_machine(GIVEN)
    window.whatif.set_machine(GIVEN)
    window.setup.set_paths(*demo_model)
    qtbot.waitUntil(lambda: window.memory.plan is not None
                    and window.whatif.shape is not None, timeout=TIMEOUT)
    return window.whatif


def test_curve_from_a_trace_file_is_sim_cache(qtbot, window, demo_model, recorded_trace):
    w = ready(qtbot, window, demo_model)
    assert w.open_trace(recorded_trace)
    qtbot.waitUntil(lambda: w.curve is not None, timeout=TIMEOUT)
    keys = sim_cache.trace_keys(sim_cache.read_trace(recorded_trace))
    want = sim_cache.hit_curve(keys, w.curve["slots"], s3fifo=True)
    assert w.curve["lru"] == [p.lru for p in want]              # the very same replay
    assert w.curve["s3fifo"] == [p.s3fifo for p in want]
    assert w.curve["belady"] == [p.belady for p in want]
    assert w.curve["ceiling"] == sim_cache.compulsory_ceiling(keys)
    for lru, s3, bel in zip(w.curve["lru"], w.curve["s3fifo"], w.curve["belady"]):
        assert max(lru, s3) <= bel + 1e-9 <= w.curve["ceiling"] + 1e-9
    assert w.curve["lru"] == sorted(w.curve["lru"])             # more slots, more hits
    for curve, name in ((w.lru_curve, "lru"), (w.s3fifo_curve, "s3fifo")):
        xs, ys = curve.getData()
        assert len(xs) == len(w.curve["slots"]) and list(ys) == w.curve[name]
    assert w.ceiling.isVisible()
    # the current budget is marked at the Memory tab's cache budget, in the axis's unit
    # (MB for the demo, whose whole expert pool is a few MB)
    assert w._unit() == ("MB", 1e3)
    assert w.current.value() == pytest.approx(window.memory.plan.cache_gb * 1e3)
    print(f"[cli] what-if curve: {len(keys)} requests, LRU {w.curve['lru'][0]:.1f}..."
          f"{w.curve['lru'][-1]:.1f}%, S3-FIFO {w.curve['s3fifo'][0]:.1f}..."
          f"{w.curve['s3fifo'][-1]:.1f}%, ceiling {w.curve['ceiling']:.1f}%")


def test_splits_and_use_this_split(qtbot, window, demo_model, recorded_trace):
    w = ready(qtbot, window, demo_model)
    w.open_trace(recorded_trace)
    qtbot.waitUntil(lambda: w.curve is not None, timeout=TIMEOUT)
    p = window.memory.plan
    total = p.trunk_gb + p.cache_gb
    qtbot.waitUntil(lambda: w.rows and sum(w.rows[0][:2]) == pytest.approx(total, abs=2e-3),
                    timeout=TIMEOUT)
    assert w.table.rowCount() == len(w.rows) > 2
    for t, c, fc in w.rows:
        assert t + c == pytest.approx(total, abs=2e-3)
        assert fc.s_per_token > 0
        assert "LRU replay" in " ".join(fc.assumptions)          # the trace's hit rate
    # the Memory tab's S3-FIFO: the splits replay the trace with it
    window.memory.policy.setCurrentIndex(window.memory.policy.findData("s3fifo"))
    assert w.policy == "s3fifo" and w.table.rowCount() == len(w.rows) > 2
    assert w.table.horizontalHeaderItem(4).text() == "S3-FIFO hit"
    assert all("S3-FIFO replay" in " ".join(fc.assumptions) for _, _, fc in w.rows)
    window.memory.policy.setCurrentIndex(window.memory.policy.findData("lru"))
    assert all("LRU replay" in " ".join(fc.assumptions) for _, _, fc in w.rows)
    assert not w.use_btn.isEnabled()
    row = len(w.rows) - 1
    w.table.selectRow(row)
    assert w.use_btn.isEnabled()
    with qtbot.waitSignal(window.memory.changed, timeout=TIMEOUT):
        w.use_btn.click()
    t, c, _ = w.rows[row]
    assert window.memory.trunk.value() == pytest.approx(t, abs=1e-3)
    assert window.memory.cache.value() == pytest.approx(c, abs=1e-3)
    assert window.memory.preset.currentData() == "custom"
    assert window.memory.plan.trunk_gb == pytest.approx(t, abs=1e-3)
    assert window.settings.trunk_gb == pytest.approx(t, abs=1e-3)        # persisted


def test_forecast_column_moves_with_the_sliders(qtbot, window, demo_model):
    ready(qtbot, window, demo_model)
    box = window.memory.forecast_box
    first = box.forecast
    # the demo's forecast is a fraction of a millisecond: said to be too small, not shown
    # as "0.00 s/token ... reads 0.00 B"
    assert first is not None and "too small to forecast meaningfully" in box.figures.text()
    assert "0.00 s/token" not in box.figures.text()
    assert "Computed from" in box.assumptions.text()
    window.memory.cache.slider.setValue(window.memory.cache.slider.maximum())
    more = box.forecast
    assert more.plan.cache_gb > first.plan.cache_gb
    assert more.bytes_read_per_token <= first.bytes_read_per_token


def test_trace_of_a_real_turn_reaches_the_panel(qtbot, window, demo_model):
    w = ready(qtbot, window, demo_model)
    load(qtbot, window, demo_model[0], demo_model[1], demo_model[0])
    res = send(qtbot, window, "hello")
    assert not res.get("failed")
    qtbot.waitUntil(lambda: w.curve is not None, timeout=TIMEOUT)
    assert w.trace_label == "this session's runs" and len(w.keys) > 0
    box = window.memory.forecast_box
    assert isinstance(box.hits, F.TraceRouting)
    assert box.hits.description.startswith("LRU replay of this session's runs")
    # another replacement policy: the forecast column replays the session with it
    window.memory.policy.setCurrentIndex(window.memory.policy.findData("s3fifo"))
    assert box.hits.description.startswith("S3-FIFO replay of this session's runs")
    assert "S3-FIFO replay" in box.assumptions.text()


def test_the_session_trace_is_a_bounded_window(qtbot, window, demo_model, monkeypatch,
                                               tmp_path, capsys):
    """The app keeps only the latest window of the session's expert requests (a window of
    400 here, so one turn overflows it): the plan counts the window, the What-if view says
    it shows only the latest window, and its curve is `k3 sim-cache` over those requests."""
    from k3engine import memory as M
    monkeypatch.setattr(M, "TRACE_WINDOW_BYTES", M.TRACE_PAIR_BYTES * 400)
    w = ready(qtbot, window, demo_model)
    plan = window.memory.plan
    assert plan.trace_window == 400 and plan.trace_bytes == M.TRACE_PAIR_BYTES * 400
    assert "What-if trace: the latest 400" in window.memory.detail.text()
    load(qtbot, window, demo_model[0], demo_model[1], demo_model[0])
    res = send(qtbot, window, "hello, what day comes after monday?")
    assert not res.get("failed")
    qtbot.waitUntil(lambda: w.curve is not None and w.keys is not None, timeout=TIMEOUT)
    trace = window.host.worker.engine.lm.experts.trace
    assert trace.requests > 400 and trace.kept == 400 == len(w.keys)
    assert w.windowed and w.total_requests == trace.requests
    assert f"only the latest 400 of {trace.requests:,} requests" in w.source.text()
    # the same requests as the engine's own dump, replayed by k3 sim-cache
    trace.dump(tmp_path)
    dumped = sim_cache.read_trace(tmp_path / "expert_trace.bin")
    keys = sim_cache.trace_keys(dumped)
    assert keys == w.keys
    want = sim_cache.hit_curve(keys, w.curve["slots"])
    assert w.curve["lru"] == [p.lru for p in want]
    assert w.curve["belady"] == [p.belady for p in want]
    slots = [s for s in w.curve["slots"] if s >= sim_cache.MIN_SLOTS]
    assert slots, w.curve["slots"]
    capsys.readouterr()
    caps = ",".join(f"{(s + 0.5) / 1000:.4f}" for s in slots)    # 1 MB experts: s slots each
    assert k3_main(["sim-cache", str(tmp_path / "expert_trace.bin"), "--capacities", caps,
                    "--expert-bytes", "1000000"]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        parts = line.split()
        # "0.0205 GB       20     4.00%    19.75%     8.00% ...": size, slots, LRU, BELADY
        if len(parts) >= 6 and parts[1] == "GB" and parts[2].isdigit():
            rows[int(parts[2])] = (float(parts[3][:-1]), float(parts[4][:-1]))
    assert sorted(rows) == slots
    for s, lru, bel in zip(w.curve["slots"], w.curve["lru"], w.curve["belady"]):
        if s in rows:
            assert abs(rows[s][0] - lru) <= 0.005 + 1e-9 and abs(rows[s][1] - bel) <= 0.005 + 1e-9
    print(f"[app] what-if window: {trace.requests} requests, latest 400 replayed; "
          f"k3 sim-cache agrees at {len(slots)} sizes")


def test_what_if_after_the_max_preset_stays_within_the_model(qtbot, window, demo_model,
                                                            recorded_trace):
    """The max preset's budgets (tens of GB) on a model of a few MB: the budget line, the
    axis and the splits are the model's, not 110 GB of nothing."""
    w = ready(qtbot, window, demo_model)
    assert w.open_trace(recorded_trace)
    qtbot.waitUntil(lambda: w.curve is not None, timeout=TIMEOUT)
    mem = window.memory
    mem.preset.setCurrentIndex(mem.preset.findData("max"))
    qtbot.waitUntil(lambda: w.budget[1] > 10, timeout=TIMEOUT)       # GBs asked for
    t_max, c_max = w.model_max_gb()
    assert c_max < 0.1                                               # the demo's pool: MB
    assert w.current.value() == pytest.approx(c_max * 1e3)           # MB axis, at the pool
    xs, _ = w.lru_curve.getData()
    assert w.plot.getViewBox().viewRange()[0][1] < 2 * c_max * 1e3  # not to 110 GB
    qtbot.waitUntil(lambda: bool(w.rows), timeout=TIMEOUT)
    for t, c, _ in w.rows:
        assert t + c <= t_max + c_max + 2e-3
    assert "109" not in w.total_label.text() and "219" not in w.total_label.text()


def test_what_if_says_what_is_missing(qtbot, window, demo_model):
    window.setup.set_paths(*demo_model)
    qtbot.waitUntil(lambda: window.whatif.shape is not None, timeout=TIMEOUT)
    window.whatif.set_machine(None)
    # a model is chosen: not "Pick a model"
    assert "Measure this machine" in window.whatif.total_label.text()


def test_measure_this_machine_shows_progress_and_cancels(qtbot, window, demo_model,
                                                         tmp_path):
    """It ran in the app's process for ~80 s behind a static "Measuring…" and kept its
    gigabytes of RSS afterwards: now a child process, its phases shown, Cancel ends it."""
    import os

    from k3engine.telemetry import rss_bytes
    box = window.memory.forecast_box
    device = tmp_path / "device"
    device.mkdir()
    box.device = str(device)
    before = rss_bytes()
    box.measure.click()
    assert box.measuring and box.measure.text() == "Cancel" and box.bar.isVisibleTo(box)
    qtbot.waitUntil(lambda: box.phase != "starting", timeout=TIMEOUT)
    shown = box.figures.text()
    assert box.phase in shown and "Measuring this machine" in shown
    box.measure.click()                                  # Cancel
    qtbot.waitUntil(lambda: not box.measuring, timeout=TIMEOUT)
    assert "cancelled" in box.figures.text() and not box.bar.isVisibleTo(box)
    assert box.measure.text() == "Measure this machine"
    assert os.listdir(device) == []                      # no scratch file left behind
    assert rss_bytes() - before < 100_000_000            # the work was the child's
