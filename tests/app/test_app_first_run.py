"""The first run on the demo: an empty conversation says what the demo is and is not,
offers prompts from what it was trained on (one click sends), and points to the Download
tab; the "No model yet?" offer is not shown while a model is loaded."""
from __future__ import annotations

from k3engine.tools.demo_corpus import example_prompts, is_test_prompt

from .app_helpers import TIMEOUT, load


def _card(win):
    col = win.chat.column
    cards = [col.itemAt(i).widget() for i in range(col.count())]
    return next((w for w in cards if w is not None and w.role == "welcome"), None)


def test_an_empty_demo_conversation_offers_examples(qtbot, window):
    from k3studio import demo
    model, trunk = demo.make_demo(window.data_dir)
    assert _card(window) is None                       # nothing loaded: nothing offered
    load(qtbot, window, model, trunk)
    card = _card(window)
    assert card is not None and "not Kimi K3" in card.blurb.text()
    prompts = [b.text() for b in card.buttons]
    assert prompts == example_prompts() and len(prompts) >= 3
    assert not any(is_test_prompt(p) for p in prompts)  # what it was trained on
    assert all(b.isEnabled() for b in card.buttons)

    card.download.linkActivated.emit("download")
    assert window.tabs.currentWidget() is window.download
    window.tabs.setCurrentIndex(2)

    with qtbot.waitSignal(window.host.turnFinished, timeout=TIMEOUT) as b:
        card.buttons[1].click()                        # one click sends it
    assert not b.args[0]["failed"]
    users = [m["content"] for m in window.chat.messages if m["role"] == "user"]
    assert users == [prompts[1]]
    assert _card(window) is None                       # the conversation has begun
    with qtbot.waitSignal(window.host.conversation, timeout=TIMEOUT):
        window.actions_by_name["new"].trigger()
    qtbot.waitUntil(lambda: _card(window) is not None, timeout=TIMEOUT)


def test_no_model_offer_while_a_model_is_loaded(qtbot, window, demo_model, tmp_path):
    load(qtbot, window, *demo_model)
    nothing = tmp_path / "not-a-model"
    nothing.mkdir()
    window.setup.set_paths(str(nothing), "", "")
    qtbot.waitUntil(lambda: window.setup.inspection is not None
                    and not window.setup.validating
                    and not window.setup.inspection.model.ok, timeout=TIMEOUT)
    assert window.host.model_loaded
    assert not window.setup.demo_box.isVisibleTo(window.setup)
    window.host.unload()
    qtbot.waitUntil(lambda: not window.host.model_loaded, timeout=TIMEOUT)
    qtbot.waitUntil(lambda: window.setup.demo_box.isVisibleTo(window.setup), timeout=TIMEOUT)
