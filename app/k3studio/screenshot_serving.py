"""Screenshot of K3 Studio serving its model while the window chats, for docs/serving.md:

    xvfb-run -a -s "-screen 0 1920x1080x24" env QT_QPA_PLATFORM=xcb \\
        python -m k3studio.screenshot_serving docs/ [--size 1024x700] [--tag -1920]

opens the real window on the demo model (made in a temporary data directory), switches
"Serve this model to other apps" on with 3 slots, starts two other apps (threads with the
official openai client, each sending requests back to back) and sends messages from the
window, then saves k3studio-serving TAG.png once the Batch page has plotted a while with
every slot busy: the aggregate tokens/s, one line per conversation and the batch size.
Serve is switched off before the window closes.  Settings and conversations go to a
temporary directory.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading

SLOTS = 3
SHOT_AFTER = 80               # steps plotted with every slot busy before the shot
QUESTIONS = ["What is the expert cache in K3 Studio?",
             "How does the trunk budget change the speed?",
             "Tell me about experts and routers."]


def other_app(base_url: str, model: str, stop: threading.Event, n: int) -> None:
    """Another app: chat requests back to back until `stop`."""
    from openai import OpenAI
    client = OpenAI(base_url=base_url, api_key="none", max_retries=0)
    i = n
    while not stop.is_set():
        try:
            stream = client.chat.completions.create(
                model=model, max_tokens=160, stream=True,
                messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
            for _ in stream:
                if stop.is_set():
                    stream.close()
                    return
        except Exception as e:  # noqa: BLE001 - the server stopping ends it
            print(f"other app {n}: {e}", file=sys.stderr)
            return
        i += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3studio.screenshot_serving")
    ap.add_argument("out", nargs="?", default="docs")
    ap.add_argument("--size", default="1280x800", help="window size WxH")
    ap.add_argument("--tag", default="", help="appended to the file name (e.g. -1920)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    from .screenshot import grabber, prepare, run_window
    out, width, height, tmp = prepare(args.out, args.size, "k3studio-serving-")

    from PySide6.QtCore import QSettings, QTimer

    from .__main__ import make_app
    app = make_app()
    from .window import SIDE, SIDE_TELEMETRY, TAB_CHAT, MainWindow
    store = QSettings(os.path.join(tmp, "settings.ini"), QSettings.IniFormat)
    for k, v in dict(preset="custom", trunk_gb=0.0015, cache_gb=0.003, threads=1, gen=200,
                     system_prompt="You are K3, a careful assistant.", theme="light",
                     serve_slots=SLOTS).items():
        store.setValue(k, v)
    win = MainWindow(store=store, data_dir=os.path.join(tmp, "data"))
    win.resize(width, height)
    win.show()
    saved: list[str] = []
    grab = grabber(app, win, out, args.tag, saved)
    stop = threading.Event()
    state = {"phase": "load", "asked": 0}

    def loaded(_info) -> None:
        if state["phase"] != "load":
            return
        state["phase"] = "serve"
        win.tabs.setCurrentIndex(TAB_CHAT)
        win.show_panel(SIDE, True)
        win.side.setCurrentIndex(SIDE_TELEMETRY)
        win.backend_panel.serve.setChecked(True)

    def serving(s: str) -> None:
        if s != "serving" or state["phase"] != "serve":
            return
        state["phase"] = "chat"
        url, model = win.shared.served.base_url, win.shared.served.model
        for n in range(SLOTS - 1):
            threading.Thread(target=other_app, args=(url, model, stop, n),
                             daemon=True).start()
        QTimer.singleShot(500, ask)

    def ask() -> None:
        if state["phase"] not in ("chat", "shot"):
            return
        win.chat.input.setPlainText(QUESTIONS[state["asked"] % len(QUESTIONS)])
        state["asked"] += 1
        win.chat.send()

    def finished(_info) -> None:
        QTimer.singleShot(200, ask)

    def ready() -> bool:                       # every slot busy, the window's among them
        p = win.shared.plots
        return (p.series.n >= SHOT_AFTER and len(p._seen) == SLOTS and win.backend.busy
                and int(p.series.view("batch")[-1]) == SLOTS)

    def steps(_s) -> None:
        if state["phase"] == "chat" and ready():
            state["phase"] = "shot"
            QTimer.singleShot(300, shoot)         # the plots' ranges follow on their paint

    def shoot() -> None:
        if not ready():
            state["phase"] = "chat"               # the next poll tries again
            return
        state["phase"] = "done"
        grab("serving")
        stop.set()
        win.chat.stop()
        QTimer.singleShot(1000, lambda: win.backend_panel.serve.setChecked(False))

    def off(s: str) -> None:
        if s == "off" and state["phase"] == "done":
            state["phase"] = "closing"
            QTimer.singleShot(500, win.close)

    win.host.loaded.connect(loaded)
    win.shared.changed.connect(serving)
    win.shared.changed.connect(off)
    win.shared.feed.steps.connect(steps)
    win.backend.turnFinished.connect(finished)
    run_window(app, win, lambda: win.use_demo(autoload=True))
    return 0 if saved else 1


if __name__ == "__main__":
    sys.exit(main())
