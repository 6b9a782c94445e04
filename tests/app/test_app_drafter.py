"""The Memory tab's block drafter folder (--draft-model): the plan counts it, the command
line carries it, a folder that cannot be used says why beside the field, and a reply with
it has the ids of a reply without it."""
from __future__ import annotations

import os
import sys

from .app_helpers import TIMEOUT, load, send

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from drafter_helpers import make_drafter  # noqa: E402


def test_the_memory_tab_takes_a_block_drafter(qtbot, window, demo_model, tmp_path):
    from k3engine.config import load_config
    from k3engine.memory import human
    model, trunk = demo_model
    folder = make_drafter(tmp_path / "drafter", load_config(os.path.join(model, "config.json")),
                          [1, 3], block=4)
    first = load(qtbot, window, model, trunk)
    plain = send(qtbot, window, "Hello")
    mem = window.memory
    mem.drafter.set_text(str(tmp_path / "nowhere"))
    qtbot.waitUntil(lambda: "config.json" in mem.drafter.check.text(), timeout=TIMEOUT)
    refused = (mem.drafter.check.text(), mem.plan.drafter_bytes)
    mem.drafter.set_text(folder)
    qtbot.waitUntil(lambda: mem.plan.drafter_bytes > 0, timeout=TIMEOUT)
    labels = [mem.table.item(r, 0).text() for r in range(mem.table.rowCount())]
    row = mem.table.item(labels.index("block drafter"), 1).text()
    command = window.chat.command.text()
    window._collect()
    assert window.spec().draft_model == folder and window.spec().gen_spec().spec == 3
    load(qtbot, window, model, trunk)
    window.new_conversation()                 # the same first message as the plain reply
    got = send(qtbot, window, "Hello")
    print(f"[gate] app: bad folder -> {refused[0]!r} (plan without it: {refused[1]} B); "
          f"drafter row {row} = {human(mem.plan.drafter_bytes)}; command has --draft-model: "
          f"{'--draft-model ' + folder in command}; reply ids equal the plain reply's "
          f"{got['ids'] == plain['ids']}, spec_drafted {got['spec_drafted']}")
    assert first and refused[1] == 0 and "file not found" in refused[0]
    assert row == human(mem.plan.drafter_bytes) and "--draft-model " + folder in command
    assert not got["failed"] and got["spec_drafted"] > 0 and got["ids"] == plain["ids"]
