"""Screenshots of the download / forecast / what-if pieces, for docs/ (the rest of the
window is screenshot.py's):

    xvfb-run -a -s "-screen 0 1600x1000x24" env QT_QPA_PLATFORM=xcb \\
        python -m k3studio.screenshot_pieces docs/

opens the real window on the demo model (made in a temporary data directory) and saves

  k3studio-whatif-window.png      the What-if tab after a reply, on a session trace whose
                                  window (shrunk to 1,000 requests for the shot) has moved
                                  on: "only the latest ... requests"
  k3studio-datapoint.png          File → Save benchmark datapoint…: the saved record, whole
  k3studio-partial-download.png   Setup pointed at an unfinished download: the check's words
                                  and its Resume download button

The unfinished download is a folder put into the state the downloader leaves when it stops
in its fourth shard (its manifest of expected figures, three shards in place, the fourth
part-way in .k3-download/): nothing is fetched.  The machine's figures are the forecast's
cache only (nothing is measured: the splits table stays empty on a machine never measured).
Settings, conversations and the record go to a temporary directory.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys

WINDOW = 1000              # requests the session trace keeps for the shot
PARTIAL_AT = 3             # shards in place; the next one is part-way


def partial_download(root: str) -> str:
    """A demo checkpoint in several shards, left as an interrupted `k3 download` leaves
    it; returns its folder."""
    from pathlib import Path

    from k3engine.tools import download as dl
    from k3engine.tools.make_checkpoint import dims_config, make_checkpoint
    src, dest = Path(root) / "source", Path(root) / "demo-model-download"
    make_checkpoint(str(src), dims_config("demo"), seed=1, shard_bytes=600_000)
    files = sorted(p.name for p in src.iterdir() if p.is_file())
    siblings = [{"name": n, "size": (src / n).stat().st_size,
                 "sha256": hashlib.sha256((src / n).read_bytes()).hexdigest()} for n in files]
    exp = dl.expected_from_siblings("k3studio/demo-model", "0" * 40, siblings)
    dest.mkdir()
    dl.save_manifest(dest, exp, "https://huggingface.co")
    shards = exp.shards()
    for n in files:
        if n not in shards or shards.index(n) < PARTIAL_AT:
            shutil.copyfile(src / n, dest / n)
    cut = shards[PARTIAL_AT]
    data = (src / cut).read_bytes()
    dl.part_path(dest, exp.files[cut]).write_bytes(data[:len(data) * 2 // 5])
    return str(dest)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3studio.screenshot_pieces")
    ap.add_argument("out", nargs="?", default="docs")
    ap.add_argument("--size", default="1280x800", help="window size WxH")
    ap.add_argument("--record", metavar="PATH",
                    help="keep the datapoint saved for the shot as PATH.json and PATH.md")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    from .screenshot import prepare
    out, width, height, tmp = prepare(args.out, args.size, "k3studio-pieces-")

    from PySide6.QtCore import QSettings, QTimer

    from k3engine import memory
    memory.TRACE_WINDOW_BYTES = memory.TRACE_PAIR_BYTES * WINDOW

    from .__main__ import make_app
    from .screenshot import grabber, run_window
    app = make_app()
    from .window import TAB_SETUP, MainWindow
    store = QSettings(os.path.join(tmp, "settings.ini"), QSettings.IniFormat)
    # budgets below the demo's trunk and expert pool, so the record shows reads and misses
    for k, v in dict(preset="custom", trunk_gb=0.003, cache_gb=0.002, threads=1, gen=48,
                     theme="light").items():
        store.setValue(k, v)
    win = MainWindow(store=store, data_dir=os.path.join(tmp, "data"))
    win.resize(width, height)
    win.show()
    saved: list[str] = []
    state = {"phase": "chat", "code": 0}
    grab = grabber(app, win, out, "", saved)

    def loaded(_info) -> None:
        if state["phase"] != "chat":
            return
        win.chat.input.setPlainText("Hello! Which day comes after Monday, and what is 3 + 4?")
        QTimer.singleShot(300, win.chat.send)

    def finished(_info) -> None:
        if state["phase"] == "chat":
            state["phase"] = "whatif"
            win.tabs.setCurrentWidget(win.whatif)
            wait_for(lambda: win.whatif.curve is not None, whatif_shot)

    def wait_for(cond, then, tries: int = 600) -> None:
        if cond():
            QTimer.singleShot(500, then)
        elif tries:
            QTimer.singleShot(100, lambda: wait_for(cond, then, tries - 1))
        else:
            print(f"timed out in phase {state['phase']}", file=sys.stderr)
            state["code"] = 1
            win.close()

    def whatif_shot() -> None:
        grab("whatif-window")
        state["phase"] = "datapoint"
        win.datapoint.save(args.record or os.path.join(tmp, "k3-datapoint.json"))

    def datapoint_saved(_result) -> None:
        dlg = win.datapoint.dialog
        QTimer.singleShot(600, lambda: (grab("datapoint", dlg), dlg.close(), partial()))

    def partial() -> None:
        state["phase"] = "partial"
        win.setup.set_paths(partial_download(tmp), "", "")
        win.tabs.setCurrentIndex(TAB_SETUP)
        wait_for(lambda: win.setup.inspection is not None and not win.setup.validating
                 and win.setup.inspection.download is not None,
                 lambda: (grab("partial-download"), win.close()))

    def failed(info) -> None:
        print(f"{state['phase']}: {info['message'] if isinstance(info, dict) else info}",
              file=sys.stderr)
        state["code"] = 1
        win.close()

    win.host.loaded.connect(loaded)
    win.host.turnFinished.connect(finished)
    win.host.errored.connect(failed)
    win.datapoint.saved.connect(datapoint_saved)
    win.datapoint.failed.connect(failed)
    run_window(app, win, lambda: win.use_demo(autoload=True))
    shutil.rmtree(tmp, ignore_errors=True)
    return state["code"] if len(saved) == 3 else 1


if __name__ == "__main__":
    sys.exit(main())
