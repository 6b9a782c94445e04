"""Screenshots of K3 Studio on the demo model, for docs/.

    xvfb-run -a -s "-screen 0 1600x1000x24" env QT_QPA_PLATFORM=xcb \\
        python -m k3studio.screenshot docs/

opens the real window (X11 under Xvfb), makes the demo model in a temporary data
directory, loads it with a small trunk budget (so the trunk map shows pinned layers and a
ring) and a small expert cache (so the hit rate moves), runs a short generation and saves:

  k3studio-chat.png     the main window mid-generation, plots filling
  k3studio-memory.png   the memory panel with the live plan and measured peak RSS
  k3studio-setup.png    the setup view with the checks and the doctor

Without a display it falls back to Qt's offscreen platform (same widgets, rendered to an
image), so it also runs in CI.  Settings go to a temporary INI file: a person's own
settings are never touched.
"""
from __future__ import annotations

import os
import sys
import tempfile

WIDTH, HEIGHT = 1500, 940
GEN = 48
SHOT_AT = 24              # tokens generated when the mid-generation shot is taken


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = os.path.abspath(argv[0] if argv else "docs")
    os.makedirs(out, exist_ok=True)
    if not os.environ.get("QT_QPA_PLATFORM"):
        os.environ["QT_QPA_PLATFORM"] = "xcb" if os.environ.get("DISPLAY") else "offscreen"
    tmp = tempfile.mkdtemp(prefix="k3studio-shots-")
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.join(tmp, "tiktoken"))

    from PySide6.QtCore import QSettings, QTimer
    from PySide6.QtGui import QGuiApplication

    from .__main__ import make_app
    app = make_app()
    from .window import TAB_CHAT, TAB_MEMORY, TAB_SETUP, MainWindow
    store = QSettings(os.path.join(tmp, "settings.ini"), QSettings.IniFormat)
    store.setValue("preset", "custom")
    store.setValue("trunk_gb", 0.006)
    store.setValue("cache_gb", 0.006)
    store.setValue("threads", 1)
    store.setValue("gen", GEN)
    store.setValue("system_prompt", "You are K3, a careful assistant.")
    win = MainWindow(store=store, data_dir=os.path.join(tmp, "data"))
    win.resize(WIDTH, HEIGHT)
    win.show()
    platform = QGuiApplication.platformName()
    saved: list[str] = []
    state = {"shot": False, "code": 0}

    def grab(name: str) -> None:
        app.processEvents()
        path = os.path.join(out, name)
        if platform == "xcb":
            pm = win.screen().grabWindow(win.winId())
        else:
            pm = win.grab()
        pm.save(path, "PNG")
        saved.append(path)
        print(f"wrote {path} ({pm.width()}x{pm.height()}, {platform})", flush=True)

    def loaded(_info) -> None:
        win.tabs.setCurrentIndex(TAB_CHAT)
        win.chat.input.setPlainText("Explain in one paragraph how a mixture-of-experts model "
                                    "decides which experts to run.")
        QTimer.singleShot(200, win.chat.send)

    def records(_r) -> None:
        if not state["shot"] and win.plots.series.n >= SHOT_AT:
            state["shot"] = True
            grab("k3studio-chat.png")

    def finished(_info) -> None:
        QTimer.singleShot(300, after)

    def after() -> None:
        if not state["shot"]:
            grab("k3studio-chat.png")
        win.tabs.setCurrentIndex(TAB_MEMORY)
        grab("k3studio-memory.png")
        win.tabs.setCurrentIndex(TAB_SETUP)
        grab("k3studio-setup.png")
        win.tabs.setCurrentIndex(TAB_CHAT)
        win.close()

    def failed(info) -> None:
        print(f"engine error: {info['message']}", file=sys.stderr)
        state["code"] = 1
        win.close()

    win.host.loaded.connect(loaded)
    win.host.records.connect(records)
    win.host.turnFinished.connect(finished)
    win.host.errored.connect(failed)
    QTimer.singleShot(100, lambda: win.use_demo(autoload=True))
    QTimer.singleShot(300_000, lambda: (print("timed out", file=sys.stderr), win.close()))
    app.exec()
    return state["code"] if len(saved) == 3 else 1


if __name__ == "__main__":
    sys.exit(main())
