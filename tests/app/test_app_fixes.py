"""Errors that say what to do: each refusal a person can cause, made for real (a file, a
folder, a budget), gets one sentence of cause and one of fix, with the engine's message
kept as the detail."""
from __future__ import annotations

import os
import shutil

import pytest

from k3studio import checks
from k3studio.fixes import advice

from .app_helpers import TIMEOUT


def _case(name, tmp_path, demo_model, model_copy):
    """(check level message, advice cause words) for one refusal."""
    from k3engine.tools.make_checkpoint import dims_config, make_checkpoint
    from k3engine.trunk import pack_trunk
    model, trunk = demo_model
    if name == "not a folder":
        f = tmp_path / "file.txt"
        f.write_text("x")
        return checks.inspect(str(f)).model
    if name == "not a model":
        d = tmp_path / "notes"
        d.mkdir()
        (d / "readme.txt").write_text("not a model\n")
        return checks.inspect(str(d)).model
    if name == "incomplete download":
        with open(os.path.join(model_copy, "model.safetensors"), "r+b") as f:
            f.truncate(os.path.getsize(f.name) // 2)
        return checks.inspect(model_copy).model
    if name == "trunk of another model":
        other = tmp_path / "tiny"
        make_checkpoint(str(other), dims_config("tiny"), seed=2)
        pack_trunk(str(other), str(tmp_path / "tiny-trunk"))
        return checks.inspect(model, str(tmp_path / "tiny-trunk")).trunk
    if name == "trunk out of date":
        t = tmp_path / "trunk"
        shutil.copytree(trunk, t)
        with open(t / "trunk.bin", "r+b") as f:
            f.truncate(4096)
        return checks.inspect(model, str(t)).trunk
    if name == "tokenizer missing":
        os.unlink(os.path.join(model_copy, "tiktoken.model"))
        return checks.inspect(model_copy).tok
    raise AssertionError(name)


@pytest.mark.parametrize("name,words", [
    ("not a folder", "not a folder"), ("not a model", "not a model"),
    ("incomplete download", "incomplete"), ("trunk of another model", "another model"),
    ("trunk out of date", "damaged"), ("tokenizer missing", "tokenizer")])
def test_each_refusal_has_a_cause_and_a_fix(name, words, tmp_path, demo_model, model_copy):
    check = _case(name, tmp_path, demo_model, model_copy)
    assert check.level == checks.ERROR, check
    a = advice(check.message)
    print(f"[fix] {name}: {check.message!r} -> {a.cause if a else None} / "
          f"{a.fix if a else None}")
    assert a is not None and words in a.cause.lower()
    assert a.fix.endswith(".") and a.cause.endswith(".") and a.detail == check.message


def test_an_unknown_message_gets_no_guess():
    assert advice("k3: internal error: ZeroDivisionError: division by zero") is None


def test_the_banner_says_cause_and_fix_with_the_detail_folded(qtbot, window, demo_model):
    window.setup.set_paths(*demo_model)
    qtbot.waitUntil(lambda: window.setup.load_btn.isEnabled(), timeout=TIMEOUT)
    window.memory.set_available_override(50_000_000)        # budget over memory
    with qtbot.waitSignal(window.host.errored, timeout=TIMEOUT):
        window.setup.load_btn.click()
    banner = window.errors
    assert banner.isVisible()
    assert "more than the machine has available" in banner.headline.text()
    assert "Memory tab" in banner.headline.text()
    assert not banner.text.isVisibleTo(banner)               # the detail is folded
    banner.details_btn.click()
    assert banner.text.isVisibleTo(banner) and "REFUSING TO START" in banner.text.text()
    window.memory.set_available_override(None)
    qtbot.waitUntil(lambda: not window.host.busy, timeout=TIMEOUT)


def test_the_setup_check_leads_with_the_fix(qtbot, window, tmp_path):
    d = tmp_path / "notes"
    d.mkdir()
    (d / "readme.txt").write_text("x\n")
    window.setup.set_paths(str(d), "", "")
    qtbot.waitUntil(lambda: window.setup.inspection is not None
                    and not window.setup.validating, timeout=TIMEOUT)
    qtbot.waitUntil(lambda: "not a model" in window.setup.model.check.text(), timeout=TIMEOUT)
    text = window.setup.model.check.text()
    # cause and fix first, the engine's words (naming the file) after them
    assert text.index("not a model") < text.index("refusing to guess")
