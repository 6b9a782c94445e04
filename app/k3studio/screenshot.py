"""Screenshots of K3 Studio on the demo model, for docs/.

    xvfb-run -a -s "-screen 0 1600x1000x24" env QT_QPA_PLATFORM=xcb \\
        python -m k3studio.screenshot docs/ [--theme light|dark] [--size 1024x700] \\
        [--tag -1920] [--only first-run,conversation,panels-collapsed]

opens the real window (X11 under Xvfb), makes the demo model in a temporary data
directory, loads it with a trunk budget of about half its 2.65 MB trunk (so the trunk map
shows pinned layers and a ring) and an expert cache smaller than its 224 (layer, expert)
pairs (so the hit rate moves), and saves (SUFFIX is "" for the
light theme, "-dark" for the dark one, then --tag; --only saves just the named shots):

  k3studio-markdown SUFFIX.png  a saved conversation whose reply has Markdown and a code
                               block, with the conversation list beside it
  k3studio-first-run SUFFIX.png an empty conversation on the demo: what it is, example
                               prompts from its training corpus, the pointer to Download
  k3studio-conversation SUFFIX.png  four replies (the examples, each sent with one click),
                               each with its own stats, the telemetry panel beside them
  k3studio-panels-collapsed SUFFIX.png  the same with both side panels collapsed
  k3studio-chat SUFFIX.png      the window mid-generation, plots filling
  k3studio-prefill SUFFIX.png   a long prompt's prefill: progress, elapsed time and ETA
  k3studio-memory SUFFIX.png    the memory panel with the live plan and measured peak RSS
  k3studio-setup SUFFIX.png     the setup view with the checks and the doctor
  k3studio-error SUFFIX.png     a refusal (a folder that is not a model) with its fix

The demo model is tiny and knows only its small corpus, so the Markdown shot shows a
conversation written into the conversations folder first (the rendering is the same for a
reply the model streams).  Without a display it falls back to Qt's offscreen platform.
Settings and conversations go to a temporary directory: a person's own are never touched.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

GEN = 48
SHOT_AT = 24              # tokens generated when the mid-generation shot is taken

MARKDOWN_REPLY = """A mixture-of-experts layer has a small **router** that scores every expert \
for the current token and runs only the best few:

1. the router computes one score per expert (a matrix-vector product),
2. the top *k* scores are kept and normalised into weights,
3. the token's output is the weighted sum of those experts' outputs.

```python
def moe(x, router, experts, k=8):
    scores = router @ x
    top = scores.argsort()[-k:]
    w = softmax(scores[top])
    return sum(wi * experts[i](x) for wi, i in zip(w, top))
```

Only `k` of the experts are read per token, which is why K3 Studio can stream them from \
disk: the expert cache keeps the ones that are asked for most."""

OTHER_CONVERSATIONS = [
    ("How much memory does the trunk need?", "About 3 GB pinned is a good start."),
    ("Summarise the design document", "It describes one engine with three faces."),
]


def seed_conversations(data_dir: str) -> str:
    """Write the demo conversations into the folder; returns the Markdown one's file."""
    from k3engine.chat import History, Message

    from .conversations import ConversationStore, Meta, default_root
    store = ConversationStore(default_root(data_dir))
    for q, a in OTHER_CONVERSATIONS:
        cid = store.new_id()
        store.save(cid, History([Message("user", q), Message("assistant", a)]), Meta(cid))
    cid = store.new_id()
    store.save(cid, History([Message("system", "You are K3, a careful assistant."),
                             Message("user", "How does a mixture-of-experts model decide "
                                             "which experts to run?"),
                             Message("assistant", MARKDOWN_REPLY, "The user asks about "
                                     "routing; explain top-k with a short example.")]),
               Meta(cid, title="Mixture-of-experts routing"))
    return store.path(cid)


def grabber(app, win, out: str, suffix: str, saved: list[str], only=None):
    """grab(name, widget=None): save the widget (default: the window) as
    OUT/k3studio-NAME SUFFIX.png -- from the X server under xcb (what is on screen),
    rendered by Qt offscreen."""
    from PySide6.QtGui import QGuiApplication
    platform = QGuiApplication.platformName()

    def grab(name: str, widget=None) -> None:
        if only and name not in only:
            return
        widget = widget or win
        app.processEvents()
        path = os.path.join(out, f"k3studio-{name}{suffix}.png")
        pm = widget.screen().grabWindow(widget.winId()) if platform == "xcb" else widget.grab()
        pm.save(path, "PNG")
        saved.append(path)
        print(f"wrote {path} ({pm.width()}x{pm.height()}, {platform})", flush=True)
    return grab


def prepare(out: str, size: str, prefix: str) -> tuple[str, int, int, str]:
    """A screenshot run's set-up: the output folder (made), the window size from "WxH",
    Qt's platform (X11 under a display, else offscreen) and a temporary folder for the
    settings, data and tiktoken's cache, so a person's own are never touched."""
    out = os.path.abspath(out)
    width, height = (int(v) for v in size.lower().split("x"))
    os.makedirs(out, exist_ok=True)
    if not os.environ.get("QT_QPA_PLATFORM"):
        os.environ["QT_QPA_PLATFORM"] = "xcb" if os.environ.get("DISPLAY") else "offscreen"
    tmp = tempfile.mkdtemp(prefix=prefix)
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.join(tmp, "tiktoken"))
    return out, width, height, tmp


def run_window(app, win, start) -> None:
    """Call `start` once the event loop runs, give up after 10 minutes, then destroy the
    window while Python is alive (dispose)."""
    from PySide6.QtCore import QTimer

    from .__main__ import dispose
    QTimer.singleShot(100, start)
    QTimer.singleShot(600_000, lambda: (print("timed out", file=sys.stderr), win.close()))
    app.exec()
    dispose(win)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3studio.screenshot")
    ap.add_argument("out", nargs="?", default="docs")
    ap.add_argument("--theme", choices=("light", "dark"), default="light")
    ap.add_argument("--size", default="1280x800", help="window size WxH")
    ap.add_argument("--tag", default="", help="appended to each file name (e.g. -1920)")
    ap.add_argument("--only", default="", help="comma-separated shot names to save")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    out, width, height, tmp = prepare(args.out, args.size, "k3studio-shots-")
    suffix = ("" if args.theme == "light" else "-dark") + args.tag
    only = {n for n in args.only.split(",") if n}

    from PySide6.QtCore import QSettings, QTimer

    from .__main__ import make_app
    app = make_app()
    from .window import TAB_CHAT, TAB_MEMORY, TAB_SETUP, MainWindow
    data = os.path.join(tmp, "data")
    store = QSettings(os.path.join(tmp, "settings.ini"), QSettings.IniFormat)
    for k, v in dict(preset="custom", trunk_gb=0.0015, cache_gb=0.003, threads=1, gen=GEN,
                     system_prompt="You are K3, a careful assistant.", theme=args.theme,
                     conversation_path=seed_conversations(data)).items():
        store.setValue(k, v)
    win = MainWindow(store=store, data_dir=data)
    win.resize(width, height)
    win.show()
    saved: list[str] = []
    state = {"shot": False, "code": 0, "phase": "markdown"}
    grab = grabber(app, win, out, suffix, saved, only)
    examples: list[str] = []

    def loaded(_info) -> None:
        if state["phase"] != "markdown":
            return
        win.tabs.setCurrentIndex(TAB_CHAT)
        QTimer.singleShot(400, markdown_shot)

    def markdown_shot() -> None:
        grab("markdown")
        state["phase"] = "conversation"
        win.new_conversation()
        QTimer.singleShot(600, first_run_shot)

    def first_run_shot() -> None:
        grab("first-run")
        card = win.chat.welcome
        examples.extend(b.text() for b in card.buttons)
        win.chat.limit.setValue(96)          # room for each reply to end by itself
        card.buttons[0].click()              # one click sends it

    def next_example() -> None:
        asked = sum(1 for m in win.chat.messages if m["role"] == "user")
        if asked < len(examples):
            win.chat.send_example(examples[asked])
            return
        grab("conversation")
        win.show_panel(0, False)
        win.show_panel(2, False)
        QTimer.singleShot(400, collapsed_shot)

    def collapsed_shot() -> None:
        grab("panels-collapsed")
        win.show_panel(0, True)
        win.show_panel(2, True)
        win.chat.limit.setValue(GEN)
        state["phase"] = "chat"
        win.new_conversation()
        win.chat.input.setPlainText("What is the expert cache in K3 Studio?")   # in its corpus
        QTimer.singleShot(300, win.chat.send)

    def records(_r) -> None:
        if state["phase"] == "chat" and not state["shot"] and win.plots.series.n >= SHOT_AT:
            state["shot"] = True
            grab("chat")

    def progress(p) -> None:
        if state["phase"] == "prefill" and not state["shot"] and p.get("eta_s") is not None \
                and p.get("done_bytes", 0) * 2 >= p.get("total_bytes", 1):
            state["shot"] = True
            grab("prefill")
            win.chat.stop()

    def finished(_info) -> None:
        if state["phase"] == "conversation":
            QTimer.singleShot(300, next_example)
        elif state["phase"] == "chat":
            QTimer.singleShot(300, after_chat)
        elif state["phase"] == "prefill":
            QTimer.singleShot(300, after_prefill)

    def after_chat() -> None:
        if not state["shot"]:
            grab("chat")
        win.tabs.setCurrentIndex(TAB_MEMORY)
        grab("memory")
        win.tabs.setCurrentIndex(TAB_SETUP)
        grab("setup")
        win.tabs.setCurrentIndex(TAB_CHAT)
        # a long prompt, so the prefill lasts long enough to be seen
        state["phase"], state["shot"] = "prefill", False
        win.new_conversation()
        win.chat.input.setPlainText(" ".join(["Tell me about experts and routers."] * 120))
        QTimer.singleShot(300, win.chat.send)

    def after_prefill() -> None:
        if not state["shot"]:
            grab("prefill")
        state["phase"] = "error"
        bad = os.path.join(tmp, "not-a-model")
        os.makedirs(bad, exist_ok=True)
        with open(os.path.join(bad, "notes.txt"), "w") as f:
            f.write("not a model\n")
        win.tabs.setCurrentIndex(TAB_SETUP)
        win.setup.set_paths(bad, "", "")
        QTimer.singleShot(1500, lambda: (grab("error"), win.close()))

    def failed(info) -> None:
        if state["phase"] == "error":
            return
        print(f"engine error: {info['message']}", file=sys.stderr)
        state["code"] = 1
        win.close()

    win.host.loaded.connect(loaded)
    win.host.records.connect(records)
    win.host.prefillProgress.connect(progress)
    win.host.turnFinished.connect(finished)
    win.host.errored.connect(failed)
    run_window(app, win, lambda: win.use_demo(autoload=True))
    want = len(only) if only else 9
    return state["code"] if len(saved) == want else 1


if __name__ == "__main__":
    sys.exit(main())
