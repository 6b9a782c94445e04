"""Memory panel: the plan follows every control, refusals are shown with the engine's
text, and planned vs measured RSS after a run."""
from __future__ import annotations

from .app_helpers import TIMEOUT, load, send
from PySide6.QtCore import Qt

from k3engine.memory import PRESETS


def ready(qtbot, window, demo_model):
    window.setup.set_paths(*demo_model)
    qtbot.waitUntil(lambda: window.memory.plan is not None, timeout=TIMEOUT)
    return window.memory


def test_plan_updates_as_sliders_move(qtbot, window, demo_model):
    mem = ready(qtbot, window, demo_model)
    mem.set_available_override(None)
    seen = []
    mem.planUpdated.connect(lambda p: seen.append(p))
    mem.trunk.slider.setValue(0)
    low = mem.plan
    mem.trunk.slider.setValue(mem.trunk.slider.maximum())
    high = mem.plan
    assert len(seen) >= 2
    assert high.trunk_plan.n_pinned > low.trunk_plan.n_pinned
    assert high.trunk_plan.n_pinned == high.trunk_plan.n_layers     # the whole trunk fits
    assert mem.preset.currentData() == "custom"
    # every term is in the table, with the total
    labels = [mem.table.item(r, 0).text() for r in range(mem.table.rowCount())]
    for term in ("trunk (streamed)", "embed + lm_head", "expert cache", "recurrent state",
                 "buffers", "KV cache", "app baseline (measured)", "TOTAL", "available"):
        assert term in labels
    total_row = labels.index("TOTAL")
    from k3engine.memory import human
    assert mem.table.item(total_row, 1).text() == human(high.total_bytes)
    # and each term has a tooltip saying what it is
    assert "pinned" in mem.table.item(0, 0).toolTip()
    # cache slider: more slots
    mem.cache.slider.setValue(10)
    few = mem.plan.expert_slots
    mem.cache.slider.setValue(900)
    assert mem.plan.expert_slots > few
    # ring slots and the generation limit (KV positions) feed the plan too
    mem.trunk.slider.setValue(0)
    mem.ring.setValue(1)
    assert mem.plan.trunk_plan.ring_want == 1
    window.chat.limit.setValue(500)
    assert mem.plan.positions == 501


def test_a_big_budget_is_refused_against_small_available(qtbot, window, demo_model):
    """A pretend machine with a few MB to spare: small budgets fit, dragging the cache
    slider to its end is refused with the engine's text, and dragging back fits again."""
    mem = ready(qtbot, window, demo_model)
    mem.trunk.slider.setValue(0)
    mem.cache.spin.setValue(0.0004)                                 # ~10 expert slots
    assert mem.plan.cache_fits_topk
    small = mem.plan.total_bytes
    mem.set_available_override(int((small + 4_000_000) / 0.95))   # 4 MB of headroom
    assert mem.plan.admitted, mem.plan.reasons
    assert mem.verdict.objectName() == "verdict_ok" and mem.verdict.text().startswith("Fits")
    mem.cache.slider.setValue(mem.cache.slider.maximum())           # the whole expert pool
    assert mem.plan.expert_cache_bytes > 4_000_000 + mem.figures.expert_slot_bytes
    assert not mem.plan.admitted
    assert mem.verdict.objectName() == "verdict_refused"
    assert "REFUSING TO START" in mem.verdict.text() and "exit 1" in mem.verdict.text()
    assert mem.usage.value() == 1000
    mem.cache.spin.setValue(0.0004)
    assert mem.plan.admitted and mem.verdict.objectName() == "verdict_ok"
    # below top-k + 1 slots the engine cannot load: said up front
    mem.cache.spin.setValue(0.0001)
    assert not mem.plan.cache_fits_topk and "loading will fail" in mem.verdict.text()
    # the probe again: the demo fits this machine easily
    mem.set_available_override(None)
    assert mem.plan.admitted


def test_presets_set_both_budgets(qtbot, window, demo_model):
    mem = ready(qtbot, window, demo_model)
    mem.preset.setCurrentIndex(mem.preset.findData("desktop"))
    assert mem.trunk.value() == PRESETS["desktop"].trunk_gb
    assert mem.cache.value() == PRESETS["desktop"].cache_gb
    assert window.settings.preset == "desktop"
    assert "--preset desktop" in window.command_line()
    tip = mem.preset.itemData(mem.preset.findData("laptop"), Qt.ToolTipRole)
    assert "8.2 GB" in tip
    mem.preset.setCurrentIndex(mem.preset.findData("auto"))
    assert mem.plan.auto is not None and "auto budget" in mem.detail.text()


def test_planned_vs_measured_after_a_run(qtbot, window, demo_model):
    load(qtbot, window, *demo_model)
    info = send(qtbot, window, "Hello")
    assert not info["failed"]
    text = window.memory.measured.text()
    assert "Measured peak RSS" in text and "planned" in text
    # the verdict does not say only "Fits" when the run went over its plan
    mem = window.memory
    planned = mem.plan.total_bytes
    mem.show_measured(planned, planned + 70_000_000)
    assert mem.verdict.text().startswith("Fits") and "70.00 MB over this plan" in \
        mem.verdict.text()
    mem.show_measured(planned, planned - 1_000_000)
    assert "over this plan" not in mem.verdict.text()


def test_refused_plan_at_load_is_an_error_and_the_app_stays_usable(qtbot, window, demo_model):
    window.setup.set_paths(*demo_model)
    qtbot.waitUntil(lambda: window.setup.load_btn.isEnabled(), timeout=TIMEOUT)
    window.memory.set_available_override(50_000_000)
    with qtbot.waitSignal(window.host.errored, timeout=TIMEOUT) as b:
        window.setup.load_btn.click()
    err = b.args[0]
    assert err["code"] == 1 and err["kind"] == "PlanRefused"
    assert err["message"].startswith("k3: REFUSING TO START")
    assert window.errors.isVisible() and "REFUSING TO START" in window.errors.text.text()
    assert not window.host.model_loaded
    window.memory.set_available_override(None)
    qtbot.waitUntil(lambda: not window.host.busy, timeout=TIMEOUT)
    with qtbot.waitSignal(window.host.loaded, timeout=TIMEOUT):
        window.setup.load_btn.click()


def test_the_ring_in_the_plan_is_the_ring_loaded(qtbot, window, demo_model):
    """With every layer pinned the engine streams nothing and keeps no ring: the header
    said "ring 0" while the Memory tab said ring 2."""
    import re
    window.memory.set_budgets(1.0, 0.005)             # room for the whole trunk
    info = load(qtbot, window, *demo_model)
    assert info["streamed"] and len(info["pinned_layers"]) == info["n_layers"]
    window.chat.details_toggle.setChecked(True)       # how the trunk is held: a detail
    header = re.search(r"ring (\d+)", window.chat.model_label.text()).group(1)
    planned = re.search(r"ring (\d+) x", window.memory.detail.text()).group(1)
    assert header == planned == str(info["ring_slots"]) == "0"
