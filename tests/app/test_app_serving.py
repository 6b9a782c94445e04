"""Serving with one engine (shared_engine.py): with Serve on, the app releases its engine,
`k3 serve --parallel N` holds the only copy of the model, and the window's chat is one of
its slots while another app's request streams; Serve off brings the engine back.  Real
widgets, a real server process, the official openai client for the other app."""
from __future__ import annotations

import json
import threading
import urllib.request

import psutil

from .app_helpers import TIMEOUT, load, send

GEN = 48                  # the window's reply: long enough that both requests overlap


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def serve(qtbot, win, on: bool) -> None:
    win.backend_panel.serve.setChecked(on)
    qtbot.waitUntil(lambda: win.shared.state == ("serving" if on else "off"),
                    timeout=TIMEOUT)


def long_turn(qtbot, win, text: str) -> list:
    """Ready a 2,000-token turn (the caller presses Send); returns the list its streamed
    records go to."""
    win.chat.limit.setValue(2000)
    win.chat.input.setPlainText(text)
    qtbot.waitUntil(lambda: win.chat.send_btn.isEnabled(), timeout=TIMEOUT)
    records: list = []
    win.backend.records.connect(lambda r: records.extend(r))
    return records


def other_app(base_url: str, model: str, out: dict, first: threading.Event) -> None:
    """Another app: a long streamed chat request (the random-weight demo never closes its
    reply, so it runs its 2,000 tokens unless it is closed)."""
    from openai import OpenAI
    client = OpenAI(base_url=base_url, api_key="none", max_retries=0)
    try:
        stream = client.chat.completions.create(
            model=model, max_tokens=2000, stream=True,
            messages=[{"role": "user", "content": "Tell me a long story"}])
        out["stream"] = stream
        for i, _ in enumerate(stream):
            out["chunks"] = i + 1
            first.set()
            if out.get("leave"):
                stream.close()
                return
    except Exception as e:  # noqa: BLE001 - reported by the test
        out["error"] = e
    finally:
        first.set()


def test_serving_shares_one_engine_with_the_window(qtbot, window, demo_model):
    me = psutil.Process()
    load(qtbot, window, *demo_model)
    window.chat.limit.setValue(GEN)
    alone = send(qtbot, window, "Name a colour")            # the turn without serving
    assert not alone["failed"] and alone["n"] == GEN
    before = [dict(m) for m in window.backend.messages]
    pending_before = dict(window.chat.pending)
    rss_loaded = me.memory_info().rss

    window.backend_panel.slots.setValue(2)
    serve(qtbot, window, True)
    url = window.backend_panel.serve_url.text()
    root = url.removesuffix("/v1")
    # one copy of the model: the app's engine is released, the server holds it
    assert not window.host.model_loaded and window.backend.active is window.shared.served
    rss_released = me.memory_info().rss
    args = window.local_server.proc.arguments()
    assert args[args.index("--parallel") + 1] == "2"
    # the conversation stays in the pane, with its incomplete reply
    qtbot.waitUntil(lambda: window.backend.messages == before, timeout=TIMEOUT)
    assert window.chat.pending["ids"] == pending_before["ids"]
    assert "served at" in window.chat.model_label.text()
    assert window.plots.pages.isTabVisible(window.plots.pages.indexOf(window.shared.plots))

    # another app streams while the window's chat asks the same question as before
    out: dict = {}
    first = threading.Event()
    t = threading.Thread(target=other_app, args=(url, window.shared.served.model, out, first),
                         daemon=True)
    t.start()
    assert first.wait(300) and "error" not in out, out
    window.new_conversation()
    qtbot.waitUntil(lambda: window.backend.messages == [], timeout=TIMEOUT)
    shared = send(qtbot, window, "Name a colour", via=window.backend)
    shared_ids = list(window.chat.pending["ids"])
    steps = get(root + "/k3/steps?since=0")["steps"]
    both = [s for s in steps if s["batch"] == 2]
    # a long turn of the window beside the other app's: /health shows both slots busy,
    # and Stop ends the window's alone
    pieces = long_turn(qtbot, window, "Go on, at length")
    with qtbot.waitSignal(window.backend.turnFinished, timeout=TIMEOUT) as stopped:
        window.chat.send_btn.click()
        health: dict = {}

        def both_generating() -> bool:       # each slot past its first token, and the
            if len(pieces) < 2:              # window's text arriving
                return False
            health.update(get(root + "/health"))
            return health["slots_busy"] == 2 and all(
                f["tokens"] > 1 for f in health["slot_figures"])
        qtbot.waitUntil(both_generating, timeout=TIMEOUT)
        window.chat.stop_btn.click()
    other_going = out.get("chunks", 0)
    qtbot.waitUntil(lambda: out.get("chunks", 0) > other_going, timeout=TIMEOUT)
    out["leave"] = True
    t.join(300)
    print(f"[app-serve] RSS loaded {rss_loaded / 1e6:.1f} MB, engine released "
          f"{rss_released / 1e6:.1f} MB; window's reply while serving: {shared['n']} tokens, "
          f"ids equal the reply without serving: {shared_ids == alone['ids']};"
          f" {len(both)} of {len(steps)} steps had both; /health during the long turn: "
          f"slots_busy {health['slots_busy']}, {health['slot_figures']}; the window's long "
          f"turn stopped after {stopped.args[0]['n']} tokens, the other app went on")
    assert rss_released < rss_loaded
    assert not shared["failed"] and shared["n"] == GEN
    assert shared_ids == alone["ids"]                        # greedy: the same reply
    assert len(both) >= GEN - 1
    assert health["slots_busy"] == 2 and len(health["slot_figures"]) == 2
    assert stopped.args[0]["interrupted"] and "error" not in out
    # the Batch page plotted the server's steps, a line per slot
    qtbot.waitUntil(lambda: window.shared.plots.series.n >= len(steps) - 1, timeout=TIMEOUT)
    counts = window.shared.plots.point_counts()
    assert counts.get("slot 1", 0) > 0 and counts.get("slot 2", 0) >= GEN - 1, counts
    assert "of 2 slots busy" in window.shared.plots.summary.text()
    # Load is refused while the server holds the model
    window.load_model()
    assert not window.host.busy and not window.host.model_loaded

    served_messages = [dict(m) for m in window.backend.messages]
    with qtbot.waitSignal(window.host.loaded, timeout=TIMEOUT):
        serve(qtbot, window, False)
    assert window.backend.active is window.host and not window.local_server.running
    qtbot.waitUntil(lambda: window.backend.messages == served_messages, timeout=TIMEOUT)
    assert not window.plots.pages.isTabVisible(window.plots.pages.indexOf(window.shared.plots))
    qtbot.waitUntil(lambda: not window.host.busy, timeout=TIMEOUT)
    # the app's own engine answers again, in the same conversation (the stopped reply
    # answered as it is)
    window.chat.limit.setValue(GEN)
    again = send(qtbot, window, "And another one?")
    assert not again["failed"] and again["n"] == GEN
    assert [m["role"] for m in window.backend.messages] == ["user", "assistant"] * 2 + ["user"]


def test_serve_waits_for_the_reply_in_progress_and_sizes_its_slots(qtbot, window,
                                                                    demo_model):
    """Serve switched on mid-reply: the reply ends first (here: Stop), then the engine is
    released and the server starts with the slots the plan fits (auto), the stopped reply
    still in the pane."""
    from k3engine.memory import ADMIT
    from k3studio.shared_engine import AUTO_MAX, slots_that_fit
    load(qtbot, window, *demo_model)
    figures, spec = window.memory.figures, window.spec()
    assert slots_that_fit(figures, spec, 10**12) == AUTO_MAX
    two = slots_that_fit(figures, spec, 10**12, most=2)
    assert two == 2
    from dataclasses import replace

    from k3engine.engine import MAX_GEN
    from k3engine.memory import plan_for
    need = plan_for(figures, replace(spec.load_spec(), sequences=2).plan_request(
        2 * (MAX_GEN + 1)), 10**12).total_bytes
    print(f"[app-serve] the plan of 2 slots needs {need / 1e6:.1f} MB")
    assert slots_that_fit(figures, spec, int(need / ADMIT) + 1) == 2
    assert slots_that_fit(figures, spec, int(need / ADMIT) - 1) == 1

    got = long_turn(qtbot, window, "Tell me everything")
    with qtbot.waitSignal(window.backend.turnFinished, timeout=TIMEOUT) as stopped:
        window.chat.send_btn.click()
        qtbot.waitUntil(lambda: len(got) >= 3, timeout=TIMEOUT)
        window.backend_panel.serve.setChecked(True)
        assert window.shared.state == "starting" and window.host.model_loaded
        assert "waiting for the reply" in window.backend_panel.serve_url.text()
        window.chat.stop_btn.click()
    assert stopped.args[0]["interrupted"]
    pending = dict(window.chat.pending)
    qtbot.waitUntil(lambda: window.shared.state == "serving", timeout=TIMEOUT)
    args = window.local_server.proc.arguments()
    auto = int(args[args.index("--parallel") + 1])
    print(f"[app-serve] auto slots on this machine: {auto}")
    assert auto == slots_that_fit(figures, spec, window.memory.available,
                                  window.baseline_bytes)
    assert not window.host.model_loaded
    qtbot.waitUntil(lambda: window.chat.pending is not None and
                    window.chat.pending["reasoning"] == pending["reasoning"], timeout=TIMEOUT)
    assert not window.chat.pending["continuable"]          # the server keeps no state for it
    with qtbot.waitSignal(window.host.loaded, timeout=TIMEOUT):
        serve(qtbot, window, False)
    # back on this machine's engine: the reply's ids are known, so Continue works again
    qtbot.waitUntil(lambda: window.chat.pending is not None and
                    window.chat.pending["continuable"], timeout=TIMEOUT)


def test_a_server_that_dies_gives_the_model_back_to_the_window(qtbot, window, demo_model):
    """The server ends on its own (killed here): Serve switches off, the chat returns to
    this machine's engine, which is loaded again, and the panel says what happened."""
    load(qtbot, window, *demo_model)
    window.backend_panel.slots.setValue(2)
    serve(qtbot, window, True)
    assert not window.host.model_loaded
    with qtbot.waitSignal(window.host.loaded, timeout=TIMEOUT):
        window.local_server.proc.kill()
    print(f"[app-serve] after the server was killed: {window.backend_panel.serve_url.text()!r}")
    assert window.shared.state == "off" and not window.backend_panel.serve.isChecked()
    assert window.backend_panel.serve_url.text().startswith("k3 serve ended")
    assert "killed or crashed" in window.backend_panel.serve_url.text()
    assert window.backend.active is window.host and window.backend_panel.local.isEnabled()
    qtbot.waitUntil(lambda: not window.host.busy, timeout=TIMEOUT)
    window.chat.limit.setValue(4)
    t = send(qtbot, window, "Still there?")
    assert not t["failed"] and t["n"] == 4


def test_the_batch_page_s_slot_rates_add_up_to_the_whole(qtbot):
    """The summary's and the lines' rates are all over the same last steps, so the slots'
    add up to `all` (a slot's rate since it began beside a recent total read as a
    contradiction in the screenshot: 46 + 68 + 64 shown beside 'all 105')."""
    import re
    from k3studio.batch_plots import BatchPlots
    plots = BatchPlots()
    qtbot.addWidget(plots)
    plots.reset(3)
    steps, counts = [], {1: 0, 2: 0, 3: 0}
    for n in range(14):                       # 2 leaves at step 3, 3 joins at step 5: the
        rows = [q for q in (1, 2, 3)          # last 8 steps are slots 1 and 3's
                if not (q == 3 and n < 5) and not (q == 2 and n >= 3)]
        for q in rows:
            counts[q] += 1
        steps.append({"n": n, "t": 0.1 * n, "batch": len(rows), "seconds": 0.1 + 0.01 * n,
                      "tokens": len(rows), "tokens_per_s": 0.0, "trunk_bytes": 0,
                      "expert_bytes": 0,
                      "slots": [{"slot": q - 1, "request": q, "tokens": counts[q],
                                 "tokens_per_s": 99.0} for q in rows]})
    plots.on_steps(steps)
    text = re.sub("<[^>]+>", "", plots.summary.text())
    whole = float(re.search(r"all ([\d.]+) tokens/s", text).group(1))
    parts = [float(x) for x in re.findall(r"slot \d+ ([\d.]+)", text)]
    print(f"[gate] batch page: all {whole} tokens/s, slots {parts}")
    assert len(parts) == 2 and abs(sum(parts) - whole) < 0.2
    assert "99.0" not in text                 # not the since-it-began figure
